"""Numbered schema migrations, recorded in the ``migrations`` table.

Each migration spells out its own DDL (tables frozen as they were at that version,
never the current models), so a database made by any older release upgrades in
place with its rows, and therefore its hash chain, untouched.
"""

from __future__ import annotations

from typing import Callable

from sqlalchemy import (
    Boolean,
    Column,
    Connection,
    Engine,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    Table,
    Text,
    inspect,
    select,
)

from gatekeeper.errors import GatekeeperError
from gatekeeper.ledger.database import read, write
from gatekeeper.ledger.records import CURRENT_VERSION, MIGRATIONS_TABLE
from gatekeeper.ledger.tables import utc_now


def _id() -> Column:
    return Column("id", Integer, primary_key=True)


def _text(name: str, nullable: bool = False) -> Column:
    return Column(name, Text, nullable=nullable)


def _evaluation_id(nullable: bool = False) -> Column:
    return Column("evaluation_id", Integer, ForeignKey("evaluation.id"), nullable=nullable)


# PostgreSQL: the trigger function every append-only table calls (plain string literals, no %: the driver
# would read them as placeholders). ``ledger verify`` compares the stored function and triggers with these.
PG_APPEND_ONLY_FUNCTION = "gatekeeper_append_only"
PG_APPEND_ONLY_BODY = """
BEGIN
    RAISE EXCEPTION USING ERRCODE = 'restrict_violation',
        MESSAGE = 'ledger is append-only: ' || TG_OP || ' on ' || TG_TABLE_NAME || ' rejected';
END
"""
_PG_REJECT = (f"CREATE OR REPLACE FUNCTION {PG_APPEND_ONLY_FUNCTION}() RETURNS trigger LANGUAGE plpgsql "
              f"AS $${PG_APPEND_ONLY_BODY}$$")
PG_APPEND_ONLY_EVENTS = (("UPDATE", "ROW"), ("DELETE", "ROW"), ("TRUNCATE", "STATEMENT"))  # (event, FOR EACH)


def pg_trigger_sql(table: str, op: str, each: str, on: str | None = None) -> str:
    """The CREATE TRIGGER of ``table``'s append-only trigger for ``op``; ``on`` names the table in it
    (default ``table``; PostgreSQL's ``pg_get_triggerdef`` gives it schema-qualified)."""
    return (f"CREATE TRIGGER {table}_no_{op.lower()} BEFORE {op} ON {on or table} "
            f"FOR EACH {each} EXECUTE FUNCTION {PG_APPEND_ONLY_FUNCTION}()")


def _append_only(conn: Connection, table: str) -> None:
    """Triggers that make a table reject UPDATE and DELETE (on PostgreSQL TRUNCATE too); SQLite and PostgreSQL only."""
    if conn.dialect.name == "sqlite":
        for op in ("UPDATE", "DELETE"):
            conn.exec_driver_sql(
                f"CREATE TRIGGER {table}_no_{op.lower()} BEFORE {op} ON {table} "
                "BEGIN SELECT RAISE(ABORT, 'ledger is append-only'); END"
            )
    elif conn.dialect.name == "postgresql":
        conn.exec_driver_sql(_PG_REJECT)  # idempotent; every migration runs under the write lock
        for op, each in PG_APPEND_ONLY_EVENTS:
            conn.exec_driver_sql(pg_trigger_sql(table, op, each))


_MIGRATIONS_TABLE = Table(
    MIGRATIONS_TABLE,
    MetaData(),
    Column("version", Integer, primary_key=True, autoincrement=False),
    _text("name"),
    _text("applied_at"),
)


def _0001_initial(conn: Connection) -> None:
    md = MetaData()
    tables = [
        Table(
            "entry", md,
            Column("seq", Integer, primary_key=True, autoincrement=False),
            _text("prev_hash"), _text("kind"), Column("record_id", Integer, nullable=False),
            _text("payload"), _text("hash"),
            Index("entry_kind_record", "kind", "record_id", unique=True),
        ),
        Table(
            "evaluation", md, _id(),
            _text("flag"), _text("operator"), _text("started_at"), Column("pid", Integer, nullable=False),
            _text("host"), _text("gate"), _text("identity"), _text("config"),
            Index("evaluation_flag", "flag"),
        ),
        Table(
            "case_result", md, _id(), _evaluation_id(),
            _text("case_id"), _text("config"), Column("repeat", Integer, nullable=False), _text("result"), _text("at"),
            Index("case_result_evaluation", "evaluation_id"),
        ),
        Table(
            "comparison", md, _id(), _evaluation_id(),
            _text("case_id"), Column("equal", Boolean, nullable=False), _text("detail"), _text("at"),
            Index("comparison_evaluation", "evaluation_id"),
        ),
        # One verdict and one abort at most per evaluation, enforced by the database too.
        Table(
            "verdict", md, _id(), _evaluation_id(),
            _text("verdict"), _text("reasons"), _text("summary"), _text("finished_at"),
            Index("verdict_evaluation", "evaluation_id", unique=True),
        ),
        Table(
            "aborted", md, _id(), _evaluation_id(), _text("reason"), _text("at"),
            Index("aborted_evaluation", "evaluation_id", unique=True),
        ),
        Table(
            "approval", md, _id(), _text("flag"), _evaluation_id(), _text("operator"), _text("reason"), _text("at"),
            Index("approval_flag", "flag"),
        ),
        Table(
            "flip", md, _id(), _text("flag"), _text("state"), _evaluation_id(nullable=True),
            _text("operator"), _text("reason"), _text("at"),
            Index("flip_flag", "flag"),
        ),
        Table(
            "refusal", md, _id(), _text("flag"), _evaluation_id(nullable=True),
            _text("operator"), _text("reasons"), _text("at"),
            Index("refusal_flag", "flag"),
        ),
    ]
    md.create_all(conn)
    for table in tables:
        _append_only(conn, table.name)


def _0002_flush_measurement(conn: Connection) -> None:
    md = MetaData()
    Table("flush", md, _id(), _text("trigger"), _text("old"), _text("new"), _text("detail"), _text("at"))
    Table("measurement", md, _id(), _text("operator"), _text("config"), _text("result"), _text("at"))
    md.create_all(conn)
    _append_only(conn, "flush")
    _append_only(conn, "measurement")
    # Nullable, so rows written before this migration keep matching their entries.
    conn.exec_driver_sql("ALTER TABLE flip ADD COLUMN approval_ids TEXT")


def _0003_calibration(conn: Connection) -> None:
    md = MetaData()
    Table("evaluation", md, _id())  # only what the foreign key names; it exists already
    calibration = Table("calibration", md, _id(), _evaluation_id(nullable=True), _text("flag"), _text("operator"),
                        _text("config"), _text("result"), _text("at"), Index("calibration_evaluation", "evaluation_id"))
    md.create_all(conn, tables=[calibration])
    _append_only(conn, "calibration")


def _0004_signatures(conn: Connection) -> None:
    # Nullable, so unsigned rows (and every row written before this migration) keep matching their entries.
    for table in ("approval", "flip"):
        for column in ("signature", "signer", "signed_at", "record_digest"):
            conn.exec_driver_sql(f"ALTER TABLE {table} ADD COLUMN {column} TEXT")


def _0005_shadow(conn: Connection) -> None:
    md = MetaData()
    Table("flip", md, _id())  # only what the foreign key names; it exists already
    shadow = Table("shadow", md, _id(), _text("flag"), Column("flip_id", Integer, ForeignKey("flip.id"), nullable=True),
                   _text("operator"), _text("summary"), _text("items"), _text("at"), Index("shadow_flag", "flag"))
    md.create_all(conn, tables=[shadow])
    _append_only(conn, "shadow")


# Numbered 1, 2, ...; records.CURRENT_VERSION is the last number (a test holds them together).
MIGRATIONS: list[tuple[int, str, Callable[[Connection], None]]] = [
    (1, "0001_initial", _0001_initial),
    (2, "0002_flush_measurement", _0002_flush_measurement),
    (3, "0003_calibration", _0003_calibration),
    (4, "0004_signatures", _0004_signatures),
    (5, "0005_shadow", _0005_shadow),
]


def _version(conn: Connection) -> int:
    if not inspect(conn).has_table(MIGRATIONS_TABLE):
        return 0
    return conn.scalar(select(_MIGRATIONS_TABLE.c.version).order_by(_MIGRATIONS_TABLE.c.version.desc()).limit(1)) or 0


def schema_version(engine: Engine) -> int:
    """The highest migration applied to the database (0 for a blank one)."""
    with read(engine) as conn:
        return _version(conn)


def migrate(engine: Engine, target: int | None = None) -> int:
    """Apply every migration above the database's version up to ``target`` (default: all)."""
    target = CURRENT_VERSION if target is None else target
    if not 0 <= target <= CURRENT_VERSION:
        raise ValueError(f"no migration {target}: versions run from 0 to {CURRENT_VERSION}")
    have = schema_version(engine)
    if have > CURRENT_VERSION:
        raise GatekeeperError(
            f"the ledger is at schema version {have}, newer than this gatekeeper knows ({CURRENT_VERSION}); "
            "upgrade gatekeeper to open it"
        )
    if have >= target:
        return have
    with write(engine) as conn:
        _MIGRATIONS_TABLE.create(conn, checkfirst=True)
        have = _version(conn)  # again, under the lock: another process may have migrated meanwhile
        for version, name, apply in MIGRATIONS:
            if have < version <= target:
                apply(conn)
                conn.execute(_MIGRATIONS_TABLE.insert().values(version=version, name=name, applied_at=utc_now()))
    return target
