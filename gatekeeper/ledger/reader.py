"""Reading flag states from a SQLite ledger without SQLAlchemy, for the commands that only read them
(``status``, ``hash``) and must start fast: SQLAlchemy alone takes longer to import than such a command
may take in all.

``open_reader`` picks: a read-only standard-library connection for a SQLite file at this gatekeeper's schema,
else the full ``Ledger``, so a database it would migrate, refuse (a newer schema) or not read (not a
database), and PostgreSQL, behave exactly as in every other command. The reads are ``Ledger``'s own
(``records``): the same rows, decoded the same way.

Imports: errors, evidence, summaries, ledger.records (the standard library only).
"""

from __future__ import annotations

import sqlite3
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, cast

from gatekeeper.errors import LedgerReadError
from gatekeeper.evidence import EvaluationRecord, HistoryRow
from gatekeeper.ledger.records import (
    BUSY_TIMEOUT_S,
    CURRENT_VERSION,
    JSON_FIELDS,
    MIGRATIONS_TABLE,
    decode,
    evaluation_record,
    history,
    latest_flips,
)
from gatekeeper.shadows import ShadowBatch
from gatekeeper.summaries import FlipRow


def sqlite_file(url: str) -> Path | None:
    """The file a plain ``sqlite:///PATH`` URL names; None for any other URL (another database, memory, a
    ``file:`` URI, query options or %-escapes: SQLAlchemy reads those)."""
    prefix = "sqlite:///"
    path = url[len(prefix):] if url.startswith(prefix) else ""
    if not path or path == ":memory:" or path.startswith("file:") or any(c in path for c in "?#%"):
        return None
    return Path(path)


def open_reader(url: str) -> Any:
    """The ledger at ``url`` for reading flag states and evaluations: a ``SQLiteReader`` where it can, else
    ``store.open_ledger(url, create=False)`` (a ``Ledger``, or None for a SQLite file that does not exist)."""
    path = sqlite_file(url)
    if path is not None:
        if not path.exists():
            return None
        reader = SQLiteReader.at_current_version(path)
        if reader is not None:
            return reader
    from gatekeeper.ledger.store import open_ledger

    return open_ledger(url, create=False)


class SQLiteReader:
    """A SQLite ledger at the current schema, read through one read-only connection. Answers what reading
    flag states needs (``flag_states``, ``flips``, ``evaluation``) as ``Ledger`` does; writes nothing."""

    def __init__(self, conn: sqlite3.Connection):
        self._conn = conn

    @classmethod
    def at_current_version(cls, path: Path) -> SQLiteReader | None:
        """A reader, or None where the file is not a ledger at this gatekeeper's schema or cannot be read."""
        try:
            conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, isolation_level=None,
                                   timeout=BUSY_TIMEOUT_S)
        except sqlite3.Error:
            return None
        try:
            has = conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (MIGRATIONS_TABLE,)).fetchone()
            version = conn.execute(f"SELECT MAX(version) FROM {MIGRATIONS_TABLE}").fetchone()[0] if has else 0
        except sqlite3.Error:
            version = None
        if version != CURRENT_VERSION:
            conn.close()
            return None
        return cls(conn)

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> SQLiteReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _snapshot(self) -> Iterator[None]:
        """One read transaction, as ``Ledger``'s reads: rows of several tables from the same moment."""
        try:
            self._conn.execute("BEGIN")
            try:
                yield
            finally:
                self._conn.execute("ROLLBACK")
        except sqlite3.Error as e:  # a damaged file reads as SQLAlchemy's DBAPIError would: ``.orig`` holds it
            raise LedgerReadError(e) from e

    def _rows(self, kind: str, **equal: object) -> list[dict[str, object]]:
        if kind not in JSON_FIELDS:
            raise ValueError(f"no kind of record {kind!r}")
        where = {name: value for name, value in equal.items() if value is not None}
        sql = f"SELECT * FROM {kind}" + "".join(f" {'AND' if i else 'WHERE'} {name} = ?" for i, name in enumerate(where))
        cursor = self._conn.execute(sql + " ORDER BY id", tuple(where.values()))
        names = [d[0] for d in cursor.description]
        return [decode(kind, dict(zip(names, row))) for row in cursor]

    def flips(self, flag: str | None = None) -> list[FlipRow]:
        with self._snapshot():
            return cast("list[FlipRow]", self._rows("flip", flag=flag))

    def flag_states(self) -> dict[str, FlipRow]:
        return latest_flips(self.flips())

    def shadows(self, flag: str | None = None, flip_id: int | None = None) -> list[ShadowBatch]:
        with self._snapshot():
            return cast("list[ShadowBatch]", self._rows("shadow", flag=flag, flip_id=flip_id))

    def evaluation(self, evaluation_id: int) -> EvaluationRecord | None:
        with self._snapshot():
            return evaluation_record(self._rows, evaluation_id)

    def history(self, flag: str) -> list[HistoryRow]:
        with self._snapshot():
            return history(self._rows, flag)
