"""The verified mark: where the last good ``ledger verify`` of a ledger got to, so the next one checks only what
was appended since (O(new entries), not O(ledger)).

It lives outside the rows it vouches for, in the workspace's ``ledger/evidence.db.verified.json`` (git-ignored by
the same ``evidence.db*`` line as the database: it describes this machine's copy), one mark per ledger keyed by
the digest of ``checkpoint.location``, so a ``--ledger`` on PostgreSQL has its own. A mark is a cache of work
done, not evidence: lost, unreadable or of another ledger, the next verify checks the whole chain and says why.
A ledger that no longer holds the entry the mark names (a cut tail, a rewritten one) is a problem.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gatekeeper.identity import digest
from gatekeeper.ledger.chain import entry_hash
from gatekeeper.ledger.checkpoint import location
from gatekeeper.ledger.verify import Point

if TYPE_CHECKING:
    from sqlalchemy import Connection

FILE = "evidence.db.verified.json"


def path(root: Path) -> Path:
    return Path(root) / "ledger" / FILE


def _key(url: str, root: Path) -> str:
    return digest(location(url, root))


def _marks(file: Path) -> dict[str, Any]:
    data = json.loads(file.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    return data


def load(root: Path, url: str) -> tuple[Point | None, str]:
    """The point the last good verify of the ledger at ``url`` reached, or None and why there is none."""
    file = path(root)
    try:
        mark = _marks(file).get(_key(url, root))
    except FileNotFoundError:
        return None, "no verified mark yet"
    except (OSError, ValueError, RecursionError) as e:
        return None, f"the verified mark {file.name} cannot be read ({type(e).__name__})"
    if mark is None:
        return None, "no verified mark for this ledger yet"
    try:
        rows = {str(k): int(v) for k, v in mark["rows"].items()}
        point = Point(seq=int(mark["seq"]), hash=str(mark["hash"]), entries=int(mark["entries"]),
                      first=str(mark["first"]), rows=rows)
    except (KeyError, TypeError, ValueError, AttributeError):
        return None, f"the verified mark {file.name} is not one"
    return point, ""


def save(root: Path, url: str, point: Point) -> None:
    """Record ``point`` for the ledger at ``url``, atomically; a workspace that cannot be written keeps its old mark
    (the next verify then checks more, never less)."""
    file = path(root)
    try:
        marks = _marks(file)
    except (OSError, ValueError, RecursionError):
        marks = {}
    marks[_key(url, root)] = {"seq": point.seq, "hash": point.hash, "entries": point.entries, "first": point.first,
                              "rows": point.rows}
    tmp = file.with_name(f".{file.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        tmp.write_text(json.dumps(marks, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        os.replace(tmp, file)
    except OSError:
        tmp.unlink(missing_ok=True)


def start(conn: Connection, point: Point) -> tuple[Point | None, str, str]:
    """Whether a verify may start from ``point``: (the point or None to check the whole chain, why the whole chain,
    a problem). The ledger must hold the entries the mark names, unchanged: its first (else it is another ledger,
    checked whole) and the last verified (else its tail was cut or rewritten: a problem, and checked whole)."""
    from sqlalchemy import text

    fix = f"if the database was replaced on purpose (a restored copy), delete ledger/{FILE}"
    try:
        held = {r.seq: r for r in conn.execute(text(
            "SELECT seq, prev_hash, kind, record_id, payload, hash FROM entry WHERE seq IN (1, :seq)"), {"seq": point.seq})}
        last = conn.scalar(text("SELECT MAX(seq) FROM entry"))
    except Exception as e:  # noqa: BLE001 - a damaged entry: the whole check names it
        return None, f"the entry the verified mark names cannot be read ({type(e).__name__})", ""
    first = held.get(1)
    if first is not None and first.hash != point.first:
        return None, "the verified mark is of another ledger (its first entry differs)", ""
    anchor = held.get(point.seq)
    if anchor is None:
        ends = f"ends at seq {last}" if last is not None else "is empty"
        return None, "the ledger no longer holds the entry the mark names", (
            f"truncated: the ledger {ends}, below seq {point.seq} that an earlier verify reached; its tail was cut "
            f"off ({fix})")
    try:
        rehashed = entry_hash(anchor.seq, anchor.prev_hash, anchor.kind, anchor.record_id, json.loads(anchor.payload))
    except (TypeError, ValueError, RecursionError):
        rehashed = None
    if anchor.hash != point.hash:
        return None, "the entry the mark names has changed", (
            f"forked: seq {point.seq} has hash {str(anchor.hash)[:16]}..., not {point.hash[:16]}... that an earlier "
            f"verify reached; the tail was rewritten ({fix})")
    if rehashed != anchor.hash:
        return None, "the entry the mark names no longer hashes to its hash", ""
    return point, "", ""
