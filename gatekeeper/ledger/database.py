"""Opening the database and taking its write lock.

Every append reads the chain's tail and writes after it, so the lock must be held
from the read on: with SQLite that is ``BEGIN IMMEDIATE``. pysqlite would issue its
own deferred BEGIN, so its transaction handling is switched off and ours emitted.
On PostgreSQL (psycopg 3) a write transaction takes one transaction-level advisory
lock first, so writers from any number of processes and hosts queue for it, checks
and migrations included, and it is released at commit or rollback; a read is one
REPEATABLE READ snapshot, so ``verify`` sees rows and entries from the same moment.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, OperationalError
from sqlalchemy.pool import StaticPool

from gatekeeper.errors import GatekeeperError
from gatekeeper.ledger.records import BUSY_TIMEOUT_S  # concurrent writers wait this long for the lock before failing

_WRITE = "ledger_write"  # execution option that asks for BEGIN IMMEDIATE
# PostgreSQL: the advisory lock every write transaction holds (advisory locks are per database). "gkledger".
PG_WRITE_LOCK = int.from_bytes(b"gkledger", "big")  # below 2**63: a bigint
URL_HINT = "use e.g. sqlite:///ledger/evidence.db or postgresql+psycopg://USER@HOST/DATABASE"


def _postgres(conn_or_engine) -> bool:
    return conn_or_engine.dialect.name == "postgresql"


def make_engine(url: str, read_only: bool = False) -> Engine:
    """An engine for ``url``; SQLite gets WAL, a busy timeout and BEGIN IMMEDIATE for writes. ``read_only``: the
    database itself refuses every write (SQLite opened with ``mode=ro``; PostgreSQL sessions whose transactions
    are read-only), for the readers that must never change a ledger (``gatekeeper review``, ``flags serve``)."""
    try:
        parsed = make_url(url)
    except ArgumentError as e:
        raise GatekeeperError(f"ledger URL {url!r} is not valid ({e}); {URL_HINT}") from e
    if parsed.get_backend_name() != "sqlite":
        if parsed.drivername == "postgresql":
            parsed = parsed.set(drivername="postgresql+psycopg")  # psycopg 3 is the driver gatekeeper ships with
        shown = parsed.render_as_string(hide_password=True)
        args = {"options": "-c default_transaction_read_only=on"} if read_only else {}
        try:
            return create_engine(parsed, pool_pre_ping=True, connect_args=args)
        except ArgumentError as e:
            raise GatekeeperError(f"ledger URL {shown!r} is not valid ({e}); {URL_HINT}") from e
        except ImportError as e:
            raise GatekeeperError(f"ledger URL {shown!r} needs a database driver that is not installed ({e}); "
                                  "for PostgreSQL use postgresql+psycopg://") from e

    database = parsed.database or ""
    memory = database in ("", ":memory:")
    if read_only and not memory and not database.startswith("file:"):
        # SQLite's own read-only mode; it still creates the -wal and -shm files a WAL reader needs, empty of data
        parsed = parsed.set(database=f"file:{Path(database).expanduser().resolve()}", query={"mode": "ro", "uri": "true"})
    elif not memory and not database.startswith("file:"):
        Path(database).expanduser().parent.mkdir(parents=True, exist_ok=True)
    kwargs: dict = {"connect_args": {"timeout": BUSY_TIMEOUT_S}}
    if memory:
        # One shared connection, else every checkout would see its own empty database.
        kwargs.update(poolclass=StaticPool, connect_args={"timeout": BUSY_TIMEOUT_S, "check_same_thread": False})
    engine = create_engine(parsed, **kwargs)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn, _record) -> None:
        dbapi_conn.isolation_level = None  # we issue BEGIN ourselves
        cur = dbapi_conn.cursor()
        cur.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_S * 1000}")
        cur.execute("PRAGMA foreign_keys = ON")
        if not memory and not read_only:
            cur.execute("PRAGMA journal_mode = WAL")  # readers never block the writer
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.get_execution_options().get(_WRITE) else "BEGIN")

    return engine


def _lost_server(e: OperationalError) -> bool:
    """A PostgreSQL connection that could not be made or was lost: no SQLSTATE (refused, unknown host),
    class 08 (connection exception) or 57P (the server shut down or is starting up)."""
    state = getattr(e.orig, "sqlstate", None)
    return e.connection_invalidated or state is None or state.startswith(("08", "57P"))


def unreachable(url, e: OperationalError) -> GatekeeperError:
    """The one-line error for a PostgreSQL ledger whose server cannot be reached (the URL's password hidden)."""
    why = (str(e.orig).splitlines() or [type(e.orig).__name__])[0].strip()
    return GatekeeperError(f"cannot open the ledger at {make_url(url).render_as_string(hide_password=True)}: {why}; "
                           "check that the PostgreSQL server is running and reachable, and that the URL's host, "
                           "port, user and database are right")


@contextmanager
def _reachable(engine: Engine) -> Iterator[None]:
    """On PostgreSQL, a server that cannot be reached (or goes away) is a GatekeeperError, not a crash."""
    try:
        yield
    except OperationalError as e:
        if not _postgres(engine) or not _lost_server(e):
            raise
        raise unreachable(engine.url, e) from e


@contextmanager
def write(engine: Engine) -> Iterator[Connection]:
    """One write transaction, holding the database's write lock from its first statement."""
    with _reachable(engine), engine.connect().execution_options(**{_WRITE: True}) as conn, conn.begin():
        if _postgres(conn):
            conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({PG_WRITE_LOCK})")
        yield conn


@contextmanager
def read(engine: Engine) -> Iterator[Connection]:
    """One read transaction: a consistent snapshot of the ledger."""
    with _reachable(engine), engine.connect() as conn:
        if _postgres(conn):
            conn = conn.execution_options(isolation_level="REPEATABLE READ")
        with conn.begin():
            yield conn
