"""A real PostgreSQL server for the ledger tests, and the backend parametrization they share.

One server per test run (session scope), started from Debian's server binaries (``make test`` installs
the ``postgresql`` package when they are missing) in a temporary directory, listening on a free
loopback port and a Unix socket in that directory; every test gets a fresh database. PostgreSQL
refuses to run as root, so under root (CI) initdb and postgres run as ``nobody`` in a directory
owned by it. When the server cannot start, the tests that need it fail, naming why: never a skip.

Test modules use it with ``pytest_plugins = ["postgres"]`` and the ``ledger_url`` fixture (or
``backend``), and the helpers below for what a test does to the database behind the ledger's back.
They import it too, before pytest loads it as a plugin, hence no assertion rewriting: PYTEST_DONT_REWRITE.
"""

from __future__ import annotations

import glob
import itertools
import os
import pwd
import re
import shutil
import socket
import sqlite3
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest

from gatekeeper.identity import child_env

USER = "gatekeeper"  # the server's superuser; trust authentication on loopback and the socket only
START_TIMEOUT_S = 60
BACKENDS = ["sqlite", "postgresql"]
_BIN_HINT = ("install Debian's postgresql package (`make test` does: its `postgresql` target), "
             "or put initdb and postgres on PATH")


def server_binaries() -> Path | None:
    """The folder holding initdb, pg_ctl and postgres: PATH first, else the newest /usr/lib/postgresql/N/bin."""
    found = shutil.which("initdb")
    if found and shutil.which("postgres", path=str(Path(found).parent)):
        return Path(found).parent
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres"),
                      key=lambda p: [int(x) for x in re.findall(r"\d+", p)], reverse=True)
    for postgres in versions:
        if (Path(postgres).parent / "initdb").is_file():
            return Path(postgres).parent
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    root: Path
    port: int
    proc: subprocess.Popen
    log: Path
    bindir: Path | None = None

    @property
    def data(self) -> Path:
        return self.root / "data"

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://{USER}@127.0.0.1:{self.port}/{database}"

    def connect(self, database: str = "postgres"):
        import psycopg

        return psycopg.connect(host="127.0.0.1", port=self.port, user=USER, dbname=database, autocommit=True)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(2)  # SIGINT: PostgreSQL's fast shutdown
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.root, ignore_errors=True)

    def crash(self) -> None:
        """``pg_ctl stop -m fast``: the server goes away mid-work, cutting every connection. (Not ``immediate``:
        the test server runs with fsync and synchronous_commit off, so that would lose committed rows.)"""
        drop, _, _ = _as_server_user()
        subprocess.run([str(self.bindir / "pg_ctl"), "stop", "-D", str(self.data), "-m", "fast", "-w"],
                       cwd=self.root, capture_output=True, check=True, **drop)
        self.proc.wait(timeout=30)

    def restart(self) -> None:
        """Start postgres again on the same data and port (after ``crash``); raises RuntimeError if it will not."""
        self.proc = _launch(self.bindir, self.root, self.port, self.log)
        if not _wait_ready(self):
            raise RuntimeError(f"postgres did not restart: {self.log.read_text(errors='replace').strip()[-2000:]}")


def _launch(bindir: Path, root: Path, port: int, log: Path, durable: bool = False) -> subprocess.Popen:
    drop, _, _ = _as_server_user()
    env = child_env(LC_ALL="C", LANG="C")
    # Tests need no durability; a benchmark keeps the server's defaults (fsync on) to measure what a team gets.
    fast = [] if durable else ["-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off"]
    with open(log, "ab") as out:
        return subprocess.Popen(
            [str(bindir / "postgres"), "-D", str(root / "data"), "-p", str(port), "-c", "listen_addresses=127.0.0.1",
             "-c", f"unix_socket_directories={root}", *fast, "-c", "max_connections=200"],
            cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT, **drop,
        )


def _wait_ready(server: Server) -> bool:
    """Whether ``server`` accepts connections within START_TIMEOUT_S (False once its process has exited)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while server.proc.poll() is None and time.monotonic() < deadline:
        try:
            server.connect().close()
            return True
        except Exception:  # not accepting connections yet
            time.sleep(0.1)
    return False


def _as_server_user() -> tuple[dict[str, Any], int | None, int | None]:
    """Popen arguments that drop root to ``nobody`` (PostgreSQL will not run as root), and its uid/gid."""
    if os.geteuid() != 0:
        return {}, None, None
    nobody = pwd.getpwnam("nobody")

    def drop() -> None:
        os.setgroups([])
        os.setgid(nobody.pw_gid)
        os.setuid(nobody.pw_uid)

    return {"preexec_fn": drop}, nobody.pw_uid, nobody.pw_gid


def start_server(durable: bool = False) -> Server:
    """initdb a cluster in a fresh temporary directory and start postgres on it (``durable``: with fsync, as
    deployed); raises RuntimeError with the reason."""
    bindir = server_binaries()
    if bindir is None:
        raise RuntimeError(f"no PostgreSQL server binaries (initdb, postgres) found; {_BIN_HINT}")
    drop, uid, gid = _as_server_user()
    # As root, under /tmp: $TMPDIR may be a folder that nobody cannot enter. Short, too: the socket path has a limit.
    root = Path(tempfile.mkdtemp(prefix="gk-pg-", dir="/tmp" if uid is not None and os.path.isdir("/tmp") else None))
    try:
        if uid is not None:
            os.chown(root, uid, gid)
        os.chmod(root, 0o700)
        data, log = root / "data", root / "server.log"
        env = child_env(LC_ALL="C", LANG="C")
        init = subprocess.run(
            [str(bindir / "initdb"), "-D", str(data), "-U", USER, "--auth=trust", "-E", "UTF8", "--locale=C",
             "--no-sync"],
            cwd=root, env=env, capture_output=True, text=True, **drop,
        )
        if init.returncode != 0:
            raise RuntimeError(f"initdb failed (exit {init.returncode}): {init.stderr.strip() or init.stdout.strip()}")
        last = ""
        for _ in range(3):  # a port taken between choosing and binding it: try another
            port = _free_port()
            server = Server(root, port, _launch(bindir, root, port, log, durable), log, bindir)
            if _wait_ready(server):
                return server
            if server.proc.poll() is None:
                server.proc.kill()
                server.proc.wait()
            last = log.read_text(errors="replace").strip()[-2000:] or "it never accepted a connection"
        raise RuntimeError(f"postgres did not start: {last}")
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise


def serving() -> Iterator[Server]:
    """A fresh server for as long as the caller holds it; a test that needs one fails (not skips) without it."""
    try:
        import psycopg  # noqa: F401
    except ImportError:
        pytest.fail("psycopg (3) is not installed; `pip install -e .` installs it", pytrace=False)
    try:
        server = start_server()
    except (RuntimeError, OSError) as e:
        pytest.fail(f"cannot start a PostgreSQL server for the tests: {e}", pytrace=False)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def pg_server() -> Iterator[Server]:
    """The run's PostgreSQL server."""
    yield from serving()


_databases = itertools.count(1)


@pytest.fixture
def pg_url(pg_server: Server) -> str:
    """A fresh, empty database on the run's server, as a ``postgresql+psycopg://`` URL."""
    return new_database(pg_server)


def new_database(server: Server) -> str:
    """A fresh, empty database on ``server``, as a ``postgresql+psycopg://`` URL."""
    name = f"ledger_{os.getpid()}_{next(_databases)}"
    with server.connect() as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return server.url(name)


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def new_ledger_url(backend: str, request: pytest.FixtureRequest, tmp_path: Path):
    """A factory of URLs for ledgers not made yet on this test's backend: ``new_ledger_url("old")``."""
    server = request.getfixturevalue("pg_server") if backend == "postgresql" else None

    def make(name: str) -> str:
        return new_database(server) if server is not None else f"sqlite:///{tmp_path / name}.db"

    return make


@pytest.fixture
def ledger_url(backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A URL for a ledger not made yet: a SQLite file under tmp_path, or a fresh PostgreSQL database."""
    if backend == "postgresql":
        return request.getfixturevalue("pg_url")
    return f"sqlite:///{tmp_path / 'ledger' / 'evidence.db'}"


# -- behind the ledger's back ------------------------------------------------------------------------

def is_postgres(url: str) -> bool:
    return url.startswith("postgresql")


def _sqlite_path(url: str) -> str:
    return url[len("sqlite:///"):]


class Raw:
    """A plain DB-API connection (autocommit) to the database behind a ledger URL, for tampering.

    ``execute`` takes SQLite's ``?`` placeholders on both backends."""

    def __init__(self, url: str):
        self.postgres = is_postgres(url)
        if self.postgres:
            import psycopg
            from sqlalchemy.engine import make_url

            u = make_url(url)
            self.conn = psycopg.connect(host=u.host, port=u.port, user=u.username, dbname=u.database, autocommit=True)
        else:
            self.conn = sqlite3.connect(_sqlite_path(url), isolation_level=None)

    def execute(self, sql: str, params: tuple = ()):
        if self.postgres:
            return self.conn.execute(sql.replace("?", "%s"), params)
        return self.conn.execute(sql, params)

    def scalar(self, sql: str, params: tuple = ()) -> Any:
        return self.execute(sql, params).fetchone()[0]

    def triggers(self) -> list[tuple[str, str]]:
        """(trigger, table) for every trigger the ledger's migrations made."""
        if self.postgres:
            rows = self.execute("SELECT tgname, tgrelid::regclass::text FROM pg_trigger WHERE NOT tgisinternal")
        else:
            rows = self.execute("SELECT name, tbl_name FROM sqlite_master WHERE type = 'trigger'")
        return sorted(tuple(r) for r in rows.fetchall())

    def drop_trigger(self, name: str, table: str) -> None:
        self.execute(f"DROP TRIGGER {name} ON {table}" if self.postgres else f"DROP TRIGGER {name}")

    def drop_triggers(self) -> Raw:
        for name, table in self.triggers():
            self.drop_trigger(name, table)
        return self

    def columns(self) -> dict[str, list[str]]:
        """Table -> its column names in order, for every table of the database."""
        if self.postgres:
            tables = [r[0] for r in self.execute(
                "SELECT table_name FROM information_schema.tables WHERE table_schema = 'public' ORDER BY table_name")]
            return {t: [r[0] for r in self.execute(
                "SELECT column_name FROM information_schema.columns WHERE table_schema = 'public' AND table_name = ? "
                "ORDER BY ordinal_position", (t,))] for t in tables}
        tables = [r[0] for r in self.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")]
        return {t: [c[1] for c in self.execute(f"PRAGMA table_info({t})")] for t in tables}

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> Raw:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def db_errors() -> tuple[type[BaseException], ...]:
    """What either driver raises when the database rejects a statement."""
    import psycopg

    return (sqlite3.DatabaseError, psycopg.Error)
