"""Appending to the hash chain: a typed row and its entry, written together.

An entry's hash covers its seq, the previous entry's hash, the kind and id of its
typed row, and that row's content (the payload), so editing, dropping or
reordering anything later shows up in ``verify``.
"""

from __future__ import annotations

from typing import Mapping

from sqlalchemy import Connection, insert, text

from gatekeeper.errors import GatekeeperError
from gatekeeper.identity import canonical_json, digest
from gatekeeper.ledger.records import decode, encode
from gatekeeper.ledger.tables import KINDS, STAMPED, Entry, utc_now

GENESIS = "0" * 64  # prev_hash of the first entry


def entry_hash(seq: int, prev_hash: str, kind: str, record_id: int, payload: Mapping[str, object]) -> str:
    return digest({"seq": seq, "prev_hash": prev_hash, "kind": kind, "record_id": record_id, "payload": payload})


def fetch_row(conn: Connection, kind: str, record_id: int) -> dict[str, object] | None:
    """A typed row as stored. SELECT * rather than the model: an older schema may lack newer columns."""
    row = conn.execute(text(f"SELECT * FROM {kind} WHERE id = :id"), {"id": record_id}).mappings().first()
    return dict(row) if row is not None else None


def append(conn: Connection, kind: str, values: Mapping[str, object]) -> int:
    """Insert a ``kind`` row and its chain entry; the caller holds the write transaction."""
    if kind not in KINDS:
        raise ValueError(f"unknown record kind {kind!r}")
    # Stamped here, under the write lock, so timestamps never run backwards along the chain.
    values = {**values, STAMPED.get(kind, "at"): utc_now()}
    try:
        stored = encode(kind, values)
    except (TypeError, ValueError) as e:
        raise GatekeeperError(f"{kind} record cannot be stored as JSON: {e}") from e
    if conn.dialect.name == "postgresql":
        # SQLite's BEGIN IMMEDIATE already serialises appenders; elsewhere lock the tail explicitly.
        conn.exec_driver_sql("LOCK TABLE entry IN SHARE ROW EXCLUSIVE MODE")

    table = KINDS[kind].__table__  # type: ignore[attr-defined]
    key = conn.execute(insert(table).values(**stored)).inserted_primary_key
    assert key is not None  # a single-row insert always reports its primary key
    record_id = key[0]
    # The payload is read back, so it is exactly what the row holds (defaults included).
    payload = decode(kind, fetch_row(conn, kind, record_id) or {})

    last = conn.execute(text("SELECT seq, hash FROM entry ORDER BY seq DESC LIMIT 1")).first()
    seq, prev_hash = (last.seq + 1, last.hash) if last is not None else (1, GENESIS)
    conn.execute(
        insert(Entry.__table__).values(  # type: ignore[attr-defined]
            seq=seq,
            prev_hash=prev_hash,
            kind=kind,
            record_id=record_id,
            payload=canonical_json(payload).decode(),
            hash=entry_hash(seq, prev_hash, kind, record_id, payload),
        )
    )
    return record_id
