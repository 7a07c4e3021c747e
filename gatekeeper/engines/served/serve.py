"""Servers gatekeeper starts for a run (a served profile's ``serve`` and ``serve_on``): each on a free loopback
port, waited for until its ready path answers, and stopped when the run ends, however it ends.

A server runs in its own process group, so stopping it stops what it started (vLLM's engine core, say); on Linux
it is also told to exit if gatekeeper dies without stopping it. Its output goes to a file, whose last lines name
what went wrong when it never becomes ready.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from string import Template

from ...errors import GatekeeperError
from ...workspace import EngineProfile, Serve

HOST = "127.0.0.1"
_LINES = 12  # of the server's output, quoted when it never became ready


def free_port() -> int:
    """A loopback port nothing listens on now (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class Server:
    """One started server: ``url`` once ready; ``stop()`` ends it (idempotent)."""

    def __init__(self, spec: Serve, where: str, root: Path | None = None):
        self.spec, self.where = spec, where
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        # the command as run but for its port: what the identity records (an environment variable may name the build)
        self.command = [Template(a).safe_substitute(os.environ).replace("{host}", HOST) for a in spec.command]
        self.argv = [a.replace("{port}", str(self.port)) for a in self.command]
        self._log = tempfile.NamedTemporaryFile(prefix="gatekeeper-serve-", suffix=".log", delete=False)
        try:
            self.process = subprocess.Popen(
                self.argv, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT, cwd=root,
                start_new_session=True, preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        except OSError as e:
            self._close_log()
            raise GatekeeperError(f"{where}: cannot start {self.argv[0]!r} ({e.strerror or e}); fix the command, "
                                  "or give the executable's full path") from None

    def wait_ready(self) -> "Server":
        """Block until ``GET ready`` answers 200; exit 2 naming the command and its last output lines if the server
        exits first or is not ready within ``timeout`` seconds (it is stopped then)."""
        deadline = time.monotonic() + self.spec.timeout
        while True:
            code = self.process.poll()
            if code is not None:
                self._fail(f"exited with status {code} before it was ready")
            try:
                with urllib.request.urlopen(self.url + self.spec.ready, timeout=5) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, OSError):
                pass  # not listening yet, or still loading (503)
            if time.monotonic() > deadline:
                self._fail(f"was not ready within {self.spec.timeout:g} s (GET {self.spec.ready} never answered 200); "
                           "raise 'timeout' if it loads slowly, or fix 'ready'")
            time.sleep(0.25)

    def _fail(self, what: str) -> None:
        tail = self.output()
        self.stop()
        raise GatekeeperError(f"{self.where}: the server started by `{' '.join(self.argv)}` {what}; its last output:\n"
                              + ("\n".join("  " + line for line in tail) or "  (none)"))

    def output(self, lines: int = _LINES) -> list[str]:
        """The last lines the server wrote."""
        try:
            return Path(self._log.name).read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return []

    def stop(self) -> None:
        """SIGTERM to its process group, SIGKILL after 10 s; its output file removed."""
        if self.process.poll() is None:
            for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
                try:
                    os.killpg(self.process.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.process.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        try:  # what it left running in its group (a worker it forked) goes with it
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self._close_log()

    def _close_log(self) -> None:
        self._log.close()
        Path(self._log.name).unlink(missing_ok=True)


def start(profile: EngineProfile, root: Path | None = None) -> dict[str, Server]:
    """The servers ``profile`` asks gatekeeper to start, by side (``off``, ``on``; one server where both sides use one),
    each ready; none left running if one fails."""
    started: dict[str, Server] = {}
    by_spec: dict[int, Server] = {}
    try:
        for side in ("off", "on"):
            found = profile.started(side)
            if found is None:
                continue
            field, spec = found
            if id(spec) not in by_spec:  # kept before it is waited for: an interrupted wait stops it too
                by_spec[id(spec)] = Server(spec, f"{profile.where}: field '{field}'", root)
                by_spec[id(spec)].wait_ready()
            started[side] = by_spec[id(spec)]
    except BaseException:
        stop({str(k): s for k, s in by_spec.items()})
        raise
    return started


def stop(servers: dict[str, Server]) -> None:
    for server in {id(s): s for s in servers.values()}.values():
        server.stop()
