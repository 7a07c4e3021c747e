"""What the review app reads: the workspace's ledger through a connection that cannot write, and the two views
every page shows (the integrity badge, the flags) made once per change of the ledger or the workspace.

Checking integrity is ``gatekeeper ledger verify`` whole (chain, rows, signatures, checkpoints), which reads every
entry; it runs when the ledger's stamp moves (a commit by anyone), never per request. The evaluations list is
one SQL query a page, keyed by id (``before``), so the 2,000th page costs what the first does.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from ..errors import GatekeeperError
from ..evidence import EvaluationRecord
from ..ledger import checkpoint as checkpoints
from ..ledger.stamp import LedgerStamp
from ..ledger.status import derive_status
from ..ledger.store import Head, Ledger, shown
from ..summaries import (  # typing's, or typing_extensions' before 3.11
    Calibrated,
    Decided,
    NotRequired,
    OutcomeSummary,
    Starter,
    TypedDict,
)
from ..workspace import Workspace, files_stamp

if TYPE_CHECKING:
    from ..ledger.audit import Integrity
    from ..ledger.intoto import VerificationRecord
    from .flags import FlagRow

RECHECK_S = 60.0  # databases without a commit counter (PostgreSQL): integrity is rechecked at least this often
FILES_EVERY_S = 1.0  # the workspace's files are looked at no more often than this
PAGE = 50  # evaluations per page


class Power(TypedDict):
    """The share of cases the best calibration flagged at the policy's noise, and the share it wants."""

    share: float
    noise: float
    wanted: float | None
    calibrations: int


class Listed(TypedDict):
    """An evaluation in the list: how it ended and what its verdict is worth. The query hands the page its
    calibrations, which the page turns into its power."""

    id: int
    flag: str
    status: str
    verdict: str | None
    gate: str
    operator: str
    started_at: str
    finished_at: str | None
    engine: str | None
    cases: int
    reasons: list[str]
    strength: str | None
    calibrations: NotRequired[list[Calibrated]]
    power: NotRequired[Power | None]


class EntryRef(TypedDict):
    """A ledger entry named by its hash: where it is in the chain, what it records, and its evaluation and flag."""

    seq: int
    hash: str
    kind: str
    record_id: int
    evaluation_id: int | None
    flag: str | None


class Listing(TypedDict):
    """A page of evaluations, the total that match, and the ``before`` of the next page (None on the last)."""

    rows: list[Listed]
    total: int
    next_before: int | None


@dataclass
class View:
    """What every page shows: the ledger's integrity (what ``ledger verify --json`` prints) and the flags."""

    integrity: Integrity
    flags: list[FlagRow] = field(default_factory=list)
    flags_error: str | None = None  # the flags could not be worked out (a workspace that does not resolve)
    head: Head | None = None

    @property
    def ok(self) -> bool:
        return bool(self.integrity.get("ok"))


class Source:
    """The workspace at ``root`` and its ledger at ``url``, read-only."""

    def __init__(self, root: Path, url: str, engine: str = "auto"):
        self.root, self.url, self.engine = root, url, engine
        ws = Workspace(root)
        _ = ws.policies  # a workspace that cannot be read is exit 2 before anything is served
        self.checkpoint_files = (ws.checkpoint_path, checkpoints.log_path(ws))
        self._stamp = LedgerStamp(url, RECHECK_S)
        self._ledger: Ledger | None = None
        self._lock = threading.Lock()  # one rebuild of the view at a time
        self._opening = threading.Lock()
        self._view: View | None = None
        self._view_stamp: tuple | None = None
        self._files: tuple = ()
        self._files_at = -FILES_EVERY_S

    def close(self) -> None:
        self._stamp.close()
        if self._ledger is not None:
            self._ledger.close()

    @property
    def workspace(self) -> Workspace:
        return Workspace(self.root)  # read afresh: an edited policy shows on the next page

    @contextmanager
    def ledger(self) -> Iterator[Ledger | None]:
        """The ledger, opened read-only once and kept; None while there is none (nothing recorded yet)."""
        with self._opening:
            if self._ledger is None and not (self._stamp.path is not None and not self._stamp.path.is_file()):
                self._ledger = Ledger(self.url, read_only=True)
            ledger = self._ledger
        yield ledger

    def stamp(self) -> tuple:
        now = time.monotonic()
        if now - self._files_at >= FILES_EVERY_S:
            self._files, self._files_at = files_stamp(self.root, self.checkpoint_files), now
        return (self._stamp.stamp(), self._files)

    def view(self) -> View:
        """The integrity and flags view, remade only when the ledger or the workspace changed."""
        stamp = self.stamp()
        if self._view is not None and stamp == self._view_stamp:
            return self._view
        with self._lock:
            if self._view is None or stamp != self._view_stamp:
                # stored with the stamp from before the read: a change meanwhile means a rebuild next time
                self._view, self._view_stamp = self._build(), stamp
            return self._view

    def _build(self) -> View:
        from ..gate.enable import attestation
        from ..ledger.audit import audit_ledger
        from .flags import flags_view

        ws = self.workspace
        if self._stamp.path is not None and not self._stamp.path.is_file():  # nothing recorded, unless a checkpoint says so
            problems = [f"there is no ledger at {shown(self.url)}, yet {name} records one up to seq {c['seq']}: it was "
                        "deleted or moved" for name, c in checkpoints.recorded(ws)[:1]]
            integrity: Integrity = {"ok": not problems, "entries": 0, "problem": problems[0] if problems else "",
                         "problems": problems, "checkpoints": [], "signatures": {"checked": 0, "problems": []}}
        else:
            try:
                audit = audit_ledger(self.url, ws, [], lambda lg: attestation.audit_signatures(ws, lg), read_only=True)
                integrity = audit.to_dict()
            except GatekeeperError as e:
                integrity = {"ok": False, "problem": str(e), "problems": [str(e)]}
        view = View(integrity)
        try:  # a ledger that cannot be opened read-only (another schema version) is a problem the badge already names
            with self.ledger() as ledger:
                view.head = ledger.head() if ledger is not None else None
                view.flags = flags_view(ws, ledger, self.engine, trusted=view.ok)
        except GatekeeperError as e:
            view.flags_error = str(e)
        except Exception as e:  # noqa: BLE001 - a damaged ledger: the badge says why; the flags say they are unknown
            if view.ok:
                raise
            view.flags_error = f"the flags cannot be read from a ledger that does not verify ({type(e).__name__})"
        return view

    # -- the queries pages make ------------------------------------------------------------------

    def evaluation(self, ref: str) -> EvaluationRecord:
        """One evaluation by id or by the hash (or a prefix of at least 12 digits) of any of its ledger entries."""
        with self.ledger() as ledger:
            if ledger is None:
                raise NotFound("nothing has been recorded yet")
            eid = int(ref) if ref.isdigit() and len(ref) < 12 else self.entry(ref)["evaluation_id"]  # else a hash
            record = ledger.evaluation(eid) if eid is not None else None
        if record is None:
            raise NotFound(f"no evaluation {ref} in the ledger")
        return record

    def entry(self, ref: str) -> EntryRef:
        """The entry whose hash is ``ref`` (or starts with it): seq, hash, kind, record id, and its evaluation."""
        from sqlalchemy import text

        from ..ledger.database import read

        ref = ref.lower()
        if len(ref) < 12 or len(ref) > 64 or any(c not in "0123456789abcdef" for c in ref):
            raise NotFound(f"{ref!r} is not an entry hash: give its 64 hex digits (or the first 12 or more)")
        with self.ledger() as ledger:
            if ledger is None:
                raise NotFound("nothing has been recorded yet")
            with read(ledger.engine) as conn:
                rows = conn.execute(text("SELECT seq, hash, kind, record_id, payload FROM entry WHERE hash LIKE :p "
                                         "ORDER BY seq LIMIT 2"), {"p": ref + "%"}).mappings().all()
        if not rows:
            raise NotFound(f"no ledger entry has the hash {ref}")
        if len(rows) > 1:
            raise NotFound(f"{ref} is the start of more than one entry's hash: give more of it")
        import json

        row = rows[0]
        payload = json.loads(row["payload"])
        return {"seq": row["seq"], "hash": row["hash"], "kind": row["kind"], "record_id": row["record_id"],
                "evaluation_id": row["record_id"] if row["kind"] == "evaluation" else payload.get("evaluation_id"),
                "flag": payload.get("flag")}

    def scalar(self, sql: str, **args: Any) -> Any:
        """One value the ledger answers ``sql`` with; None while there is no ledger."""
        from sqlalchemy import text

        from ..ledger.database import read

        with self.ledger() as ledger:
            if ledger is None:
                return None
            with read(ledger.engine) as conn:
                return conn.execute(text(sql), args).scalar()

    def entry_hash(self, kind: str, record_id: int) -> str | None:
        """The hash of a record's entry: what a permalink names."""
        return self.scalar("SELECT hash FROM entry WHERE kind = :k AND record_id = :r", k=kind, r=record_id)

    def evaluations(self, *, flag: str | None = None, verdict: str | None = None, since: str | None = None,
                    until: str | None = None, before: int | None = None, limit: int = PAGE) -> Listing:
        """A page of evaluations, newest first, with the filters applied in SQL: rows, the total that match, and the
        ``before`` of the next page (None on the last)."""
        import json

        from sqlalchemy import text

        from ..ledger.database import read

        where, args = [], {}
        if flag:
            where.append("e.flag = :flag")
            args["flag"] = flag
        if verdict in ("PASS", "FAIL", "INCONCLUSIVE"):
            where.append("v.verdict = :verdict")
            args["verdict"] = verdict
        elif verdict == "none":  # aborted or still running
            where.append("v.verdict IS NULL")
        if since:
            where.append("e.started_at >= :since")
            args["since"] = since
        if until:
            where.append("e.started_at < :until")
            args["until"] = until
        cond = " AND ".join(where) or "1 = 1"
        joined = "evaluation e LEFT JOIN verdict v ON v.evaluation_id = e.id"
        with self.ledger() as ledger:
            if ledger is None:
                return {"rows": [], "total": 0, "next_before": None}
            with read(ledger.engine) as conn:
                total = conn.execute(text(f"SELECT COUNT(*) FROM {joined} WHERE {cond}"), args).scalar() or 0
                page = conn.execute(text(
                    f"SELECT e.id, e.flag, e.operator, e.gate, e.started_at, e.pid, e.host, e.config, v.verdict, "
                    f"v.reasons, v.summary, v.finished_at FROM {joined} WHERE {cond}"
                    + (" AND e.id < :before" if before is not None else "") + " ORDER BY e.id DESC LIMIT :n"),
                    {**args, "before": before, "n": limit + 1}).mappings().all()
                rows = [dict(r) for r in page[:limit]]
                ids = [r["id"] for r in rows] or [0]
                marks = ",".join(str(int(i)) for i in ids)  # integers from the database: safe to inline
                aborted = {r[0]: r[1] for r in conn.execute(text(
                    f"SELECT evaluation_id, reason FROM aborted WHERE evaluation_id IN ({marks})"))}
                cases: dict[int, int] = dict(conn.execute(text(
                    f"SELECT evaluation_id, COUNT(DISTINCT case_id) FROM comparison WHERE evaluation_id IN ({marks}) "
                    "GROUP BY evaluation_id")).all())
                calibrations: dict[int, list[Calibrated]] = {}
                for cal in conn.execute(text(
                        f"SELECT evaluation_id, result FROM calibration WHERE evaluation_id IN ({marks})")).mappings():
                    calibrations.setdefault(cal["evaluation_id"], []).append({"result": json.loads(cal["result"])})
        out: list[Listed] = []
        for r in rows:
            summary = json.loads(r["summary"]) if r["summary"] else None
            started: Starter = {"pid": r["pid"], "host": r["host"]}
            verdict_row: Decided | None = {"verdict": r["verdict"]} if r["verdict"] else None
            aborted_row = {"reason": aborted[r["id"]]} if r["id"] in aborted else None
            out.append({
                "id": r["id"], "flag": r["flag"], "status": derive_status(started, verdict_row, aborted_row),
                "verdict": r["verdict"], "gate": r["gate"], "operator": r["operator"], "started_at": r["started_at"],
                "finished_at": r["finished_at"], "engine": (json.loads(r["config"]) or {}).get("engine"),
                "cases": cases.get(r["id"], 0), "reasons": json.loads(r["reasons"]) if r["reasons"] else [],
                "strength": strength_text(summary), "calibrations": calibrations.get(r["id"], [])})
        return {"rows": out, "total": total, "next_before": rows[-1]["id"] if len(page) > limit else None}


    def previous(self, evaluation_id: int, flag: str) -> int | None:
        """The evaluation of ``flag`` before this one: what a reviewer compares it with first."""
        return self.scalar("SELECT MAX(id) FROM evaluation WHERE flag = :f AND id < :i", f=flag, i=evaluation_id)


    def attestations(self, evaluation_id: int) -> list[VerificationRecord]:
        """The in-toto attestations of this evaluation kept in the workspace (``*.intoto.json``, as ``ledger attest
        --output`` names them), each checked as ``ledger verify-attestation`` checks it: signer, key, and whether
        the ledger still holds what it states."""
        from ..ledger import intoto

        ws = self.workspace
        found = sorted(p for p in self.root.rglob("*.intoto.json") if p.is_file())
        if not found or ws.allowed_signers is None:
            return []
        out: list[VerificationRecord] = []
        with self.ledger() as ledger:
            where = checkpoints.location(ledger.url, ws.root) if ledger is not None else None
            for path in found:
                try:
                    checked = intoto.verify(intoto.load(path), str(path.relative_to(self.root)), ws.allowed_signers,
                                            ledger, where)
                except GatekeeperError:
                    continue  # not an envelope: not an attestation of anything here
                if checked.statement is not None and checked.statement["evaluation"] == evaluation_id:
                    out.append(checked.to_dict())
        return out


def strength_text(summary: OutcomeSummary | None) -> str | None:
    """What a verdict is worth, in a few words: the grade of an exact gate, or the bound of a paired one."""
    if not summary:
        return None
    if s := summary.get("strength"):
        return s.get("grade") or "outputs differ"
    if p := summary.get("sequential") or summary.get("paired"):
        if "upper" in p:
            return f"loss ≤ {p['upper']:.3f} (margin {p['margin']:g})"
        return f"{len(p.get('suites') or {})} suites judged"
    return None


class NotFound(GatekeeperError):
    """A page about something the ledger does not hold: 404."""
