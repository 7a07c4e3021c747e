"""Proving the ledger was not edited: recheck the chain and every typed row against it."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, text

from gatekeeper.errors import LedgerIntegrityError
from gatekeeper.identity import canonical_json
from gatekeeper.ledger.chain import GENESIS, entry_hash
from gatekeeper.ledger.tables import KINDS, encode


@dataclass(frozen=True)
class VerifyReport:
    ok: bool
    entries: int
    first_bad_seq: int | None  # None when ok, or when the only fault is a row with no entry
    problem: str  # the first problem, naming its seq; "" when ok
    problems: tuple[str, ...] = ()  # every problem found, in seq order

    def raise_if_bad(self) -> None:
        if not self.ok:
            raise LedgerIntegrityError(f"ledger verification failed: {self.problem}")


def _mismatch(kind: str, row: dict[str, Any], payload: Any) -> str | None:
    """The first field in which a stored row differs from its entry's payload, else None."""
    if not isinstance(payload, dict):
        return "payload"
    for name in sorted(set(row) | set(payload)):
        if name not in row:
            return name
        # A column missing from the payload was added by a later migration: it must still be NULL.
        want = encode(kind, {name: payload[name]})[name] if name in payload else None
        have = int(row[name]) if isinstance(row[name], bool) else row[name]
        if type(have) is not type(want) or have != want:
            return name
    return None


def verify(conn: Connection) -> VerifyReport:
    rows = {
        kind: {r["id"]: dict(r) for r in conn.execute(text(f"SELECT * FROM {kind}")).mappings()} for kind in KINDS
    }
    found: list[tuple[float, str]] = []  # (seq, text); rows without an entry sort last
    seen: set[tuple[str, int]] = set()
    expected, prev, count = 1, GENESIS, 0

    entries = conn.execute(text("SELECT seq, prev_hash, kind, record_id, payload, hash FROM entry ORDER BY seq"))
    for e in entries.mappings():
        count += 1
        seq = e["seq"]

        def bad(msg: str) -> None:
            found.append((seq, f"seq {seq}: {msg}"))

        if seq > expected:
            gap = f"{expected}" if seq - 1 == expected else f"{expected}..{seq - 1}"
            bad(f"seq {gap} missing before it")
        elif seq < expected:
            bad("seq out of order")
        expected = seq + 1
        if e["prev_hash"] != prev:
            bad("prev_hash does not link to the entry before it")
        prev = e["hash"]
        try:
            payload = json.loads(e["payload"])
            canonical = canonical_json(payload).decode()
        except (TypeError, ValueError):
            bad("payload is not valid JSON")
            continue
        if canonical != e["payload"]:
            bad("payload is not canonical JSON")
        elif entry_hash(seq, e["prev_hash"], e["kind"], e["record_id"], payload) != e["hash"]:
            bad("hash does not match the entry's contents")

        kind, record_id = e["kind"], e["record_id"]
        if kind not in KINDS:
            bad(f"unknown kind {kind!r}")
            continue
        if (kind, record_id) in seen:
            bad(f"a second entry for {kind} {record_id}")
            continue
        seen.add((kind, record_id))
        row = rows[kind].get(record_id)
        if row is None:
            bad(f"{kind} {record_id} is missing (its entry has no row)")
        elif (field := _mismatch(kind, row, payload)) is not None:
            bad(f"{kind} {record_id} does not match its entry (field {field!r})")

    for kind, by_id in rows.items():
        for record_id in by_id:
            if (kind, record_id) not in seen:
                found.append((math.inf, f"{kind} {record_id} has no entry in the chain"))

    if not found:
        return VerifyReport(ok=True, entries=count, first_bad_seq=None, problem="")
    found.sort(key=lambda p: p[0])  # stable: within one seq, checks keep their order
    first_seq, first_problem = found[0]
    return VerifyReport(
        ok=False,
        entries=count,
        first_bad_seq=None if first_seq == math.inf else int(first_seq),
        problem=first_problem,
        problems=tuple(p for _, p in found),
    )
