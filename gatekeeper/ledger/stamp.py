"""What identifies a ledger's state, read without reading the ledger: a cheap stamp that moves on every commit,
so a reader (the OpenFeature resolver, the review app) re-verifies only when something changed.

For SQLite: ``PRAGMA data_version`` on one read-only connection held open (it moves on every commit by any other
connection, an edit with the sqlite3 shell included), the file's identity (a file put in its place is another
database) and the chain's last entry. For other databases: the last entry, plus a period of ``recheck_s``
seconds, so a full recheck happens at least that often.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import sqlalchemy


class LedgerStamp:
    """The stamp of the ledger at ``url``; ``stamp()`` is equal for two calls only if nothing was committed between."""

    def __init__(self, url: str, recheck_s: float):
        from sqlalchemy.engine import make_url

        u = make_url(url)
        db = u.database or ""
        self.path = Path(db).expanduser().resolve() if u.get_backend_name() == "sqlite" and db not in ("", ":memory:") \
            and not db.startswith("file:") else None
        self.url, self.recheck_s = url, recheck_s
        self._lock = threading.Lock()
        self._conn: sqlite3.Connection | None = None
        self._file: tuple[int, int] | None = None
        self._engine: sqlalchemy.Engine | None = None

    def stamp(self) -> tuple:
        with self._lock:
            try:
                return self._sqlite() if self.path is not None else self._other()
            except Exception as e:  # noqa: BLE001 - unreadable now: a stamp of its own, so a repair is a change
                self.close_unlocked()
                return ("unreadable", type(e).__name__, str(e))

    def _sqlite(self) -> tuple:
        assert self.path is not None  # stamp reads the file only for a SQLite ledger
        try:
            st = self.path.stat()
        except FileNotFoundError:
            self.close_unlocked()
            return ("missing",)
        file = (st.st_dev, st.st_ino)  # a file put in its place is another database
        if self._conn is None or file != self._file:
            self.close_unlocked()
            self._conn = sqlite3.connect(f"{self.path.as_uri()}?mode=ro", uri=True, isolation_level=None,
                                         check_same_thread=False)
            self._file = file
        (version,) = self._conn.execute("PRAGMA data_version").fetchone()
        head = self._conn.execute("SELECT seq, hash FROM entry ORDER BY seq DESC LIMIT 1").fetchone()
        return (file, version, head)

    def _other(self) -> tuple:
        from sqlalchemy import text

        from gatekeeper.ledger.database import make_engine

        if self._engine is None:
            self._engine = make_engine(self.url, read_only=True)
        with self._engine.connect() as conn:
            head = conn.execute(text("SELECT seq, hash FROM entry ORDER BY seq DESC LIMIT 1")).first()
        return (tuple(head) if head else None, int(time.monotonic() // self.recheck_s))

    def close_unlocked(self) -> None:
        if self._conn is not None:
            self._conn.close()
        if self._engine is not None:
            self._engine.dispose()
        self._conn = self._file = self._engine = None

    def close(self) -> None:
        with self._lock:
            self.close_unlocked()
