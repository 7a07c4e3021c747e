"""What the ledger's rows hold, known without SQLAlchemy: the schema version this gatekeeper reads, which
columns of each kind of record hold JSON or booleans, how a row is encoded and decoded, and what a read
makes of rows (one evaluation with its evidence, each flag's latest flip); and how long a connection
waits for another's lock.

``store.Ledger`` and the SQLite ``reader`` both read through these, so both return the same dicts; the
table models (``tables``) and the migrations take their names and version from here.

Imports: evidence, summaries, identity, ledger.status (the standard library only).
"""

from __future__ import annotations

import json
from typing import Callable, Mapping, cast

from gatekeeper.evidence import AbortedRow, EvaluationRecord, HistoryRow, VerdictRow
from gatekeeper.identity import canonical_json
from gatekeeper.ledger.status import derive_status
from gatekeeper.summaries import FlipRow, StartedRow

# The number of the last migration (``migrations.MIGRATIONS``): the schema the table models describe.
CURRENT_VERSION = 5
MIGRATIONS_TABLE = "migrations"  # version, name, applied_at: one row per migration applied
BUSY_TIMEOUT_S = 30  # concurrent writers wait this long for the lock before failing

# Kind of record (its typed table's name) -> the columns that hold canonical JSON text.
JSON_FIELDS: dict[str, frozenset[str]] = {
    "evaluation": frozenset({"identity", "config"}),
    "case_result": frozenset({"result"}),
    "comparison": frozenset({"detail"}),
    "verdict": frozenset({"reasons", "summary"}),
    "aborted": frozenset(),
    "approval": frozenset(),
    "flip": frozenset({"approval_ids"}),
    "refusal": frozenset({"reasons"}),
    "flush": frozenset({"old", "new", "detail"}),
    "measurement": frozenset({"config", "result"}),
    "calibration": frozenset({"config", "result"}),
    "shadow": frozenset({"summary", "items"}),
}
# The columns stored as 0/1 and read as booleans (``Boolean`` in the table models).
BOOL_FIELDS: dict[str, frozenset[str]] = {"comparison": frozenset({"equal"})}

# rows(kind, **equal): the decoded rows of ``kind`` whose columns equal the given values (None filters
# skipped), oldest first, all read in one snapshot: column -> decoded value (each kind's row type says which).
Rows = Callable[..., list[dict[str, object]]]


def encode(kind: str, values: Mapping[str, object]) -> dict[str, object]:
    """Python values -> what the columns store (canonical JSON text, 0/1 for booleans)."""
    out: dict[str, object] = {}
    for name, value in values.items():
        if value is not None and name in JSON_FIELDS[kind]:
            value = canonical_json(value).decode()
        elif isinstance(value, bool):
            value = int(value)
        out[name] = value
    return out


def decode(kind: str, row: Mapping[str, object]) -> dict[str, object]:
    """Stored columns -> Python values; the inverse of ``encode``."""
    out: dict[str, object] = {}
    for name, value in row.items():
        if value is not None and name in JSON_FIELDS[kind]:
            value = json.loads(cast(str, value))  # a JSON column is text
        elif value is not None and name in BOOL_FIELDS.get(kind, ()):
            value = bool(value)
        out[name] = value
    return out


def evaluation_record(rows: Rows, evaluation_id: int) -> EvaluationRecord | None:
    """Everything about one evaluation: its started record, evidence, verdict or abort, status."""
    started = cast("list[StartedRow]", rows("evaluation", id=evaluation_id))
    if not started:
        return None
    verdict = cast("VerdictRow | None", next(iter(rows("verdict", evaluation_id=evaluation_id)), None))
    aborted = cast("AbortedRow | None", next(iter(rows("aborted", evaluation_id=evaluation_id)), None))
    return cast(EvaluationRecord, {
        **started[0],
        "status": derive_status(started[0], verdict, aborted),
        "verdict": verdict["verdict"] if verdict else None,
        "reasons": verdict["reasons"] if verdict else [],
        "verdict_record": verdict,
        "aborted_record": aborted,
        "case_results": rows("case_result", evaluation_id=evaluation_id),
        "comparisons": rows("comparison", evaluation_id=evaluation_id),
        "approvals": rows("approval", evaluation_id=evaluation_id),
        "calibrations": rows("calibration", evaluation_id=evaluation_id),
    })


def history(rows: Rows, flag: str) -> list[HistoryRow]:
    """Every evaluation of ``flag``, oldest first, without its case evidence: what the looks at one change are
    judged on (``gate/stats/looks.py``). Each holds its started record's id, flag, operator, gate, started_at, identity and
    config, its status, its verdict and the verdict record's reasons, summary and finished_at (None while it runs)."""
    out: list[HistoryRow] = []
    for started in cast("list[StartedRow]", rows("evaluation", flag=flag)):
        verdict = cast("VerdictRow | None", next(iter(rows("verdict", evaluation_id=started["id"])), None))
        aborted = cast("AbortedRow | None", next(iter(rows("aborted", evaluation_id=started["id"])), None))
        out.append({
            "id": started["id"], "flag": started["flag"], "operator": started["operator"], "gate": started["gate"],
            "started_at": started["started_at"], "identity": started["identity"], "config": started["config"],
            "status": derive_status(started, verdict, aborted),
            "verdict": verdict["verdict"] if verdict else None,
            "reasons": verdict["reasons"] if verdict else [],
            "summary": verdict["summary"] if verdict else None,
            "finished_at": verdict["finished_at"] if verdict else None,
        })
    return out


def latest_flips(flips: list[FlipRow]) -> dict[str, FlipRow]:
    """Flag -> its latest flip, from every flip oldest first; a flag never flipped is absent (at its default)."""
    return {f["flag"]: f for f in flips}
