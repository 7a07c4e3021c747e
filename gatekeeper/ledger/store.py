"""``Ledger``: the one object the CLI, the gate and the runtime use to write and read evidence."""

from __future__ import annotations

import json
import os
import socket
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Literal, Mapping, TypedDict, cast, overload

from sqlalchemy import Boolean, Connection, func, insert, select, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, DBAPIError

from gatekeeper.errors import GatekeeperError, LedgerIntegrityError, Superseded
from gatekeeper.evidence import AbortedRow, EvaluationRecord, HistoryRow, VerdictRow
from gatekeeper.ledger.chain import append
from gatekeeper.ledger.database import make_engine, read, write
from gatekeeper.ledger.migrations import migrate, schema_version
from gatekeeper.ledger.records import CURRENT_VERSION, decode, evaluation_record, history, latest_flips
from gatekeeper.ledger.status import derive_status
from gatekeeper.ledger.tables import KINDS, SEAL_FIELDS, Entry
from gatekeeper.ledger.verify import VerifyReport, verify
from gatekeeper.shadows import Kept, ShadowBatch, ShadowSummary
from gatekeeper.summaries import (
    ApprovalRow,
    CalibrationRow,
    ChainEntry,
    FlipRow,
    FlushRow,
    RefusalRow,
    StartedRow,
    StoredEntry,
)

VERDICTS = ("PASS", "FAIL", "INCONCLUSIVE")
FLIP_STATES = ("on", "off")


class EvaluationLine(TypedDict):
    """An evaluation in ``ledger list``: how it ended and how much evidence it holds."""

    id: int
    flag: str
    operator: str
    gate: str
    started_at: str
    status: str
    verdict: str | None
    reasons: list[str]
    case_results: int
    comparisons: int


class Head(TypedDict):
    """The chain's last entry and how many entries there are: what a checkpoint records."""

    seq: int
    hash: str
    entries: int


def _table(kind: str):
    return KINDS[kind].__table__  # type: ignore[attr-defined]


def _rows(conn: Connection, kind: str, after: int | None = None, **equal: object) -> list[dict[str, object]]:
    """Rows of ``kind`` whose columns equal the given values (None filters are skipped), oldest first; with ``after``,
    only those whose id is above it: column -> decoded value (each kind's row type says which)."""
    t = _table(kind)
    q = select(t).order_by(t.c.id)
    if after is not None:
        q = q.where(t.c.id > after)
    for name, value in equal.items():
        if value is not None:
            q = q.where(t.c[name] == value)
    return [decode(kind, dict(r)) for r in conn.execute(q).mappings()]


class Ledger:
    """An append-only, hash-chained evidence ledger at a SQLAlchemy URL (SQLite by default)."""

    def __init__(self, url: str, read_only: bool = False):
        """``read_only``: open it without writing anything, ever (the database refuses writes); a ledger at another
        schema version is then an error, since opening it would migrate it."""
        self.url = url
        self.engine = make_engine(url, read_only=read_only)
        try:
            if read_only:
                _at_current_version(self.engine, url)
            else:
                migrate(self.engine)
        except BaseException as e:
            self.engine.dispose()
            if isinstance(e, DBAPIError):
                raise GatekeeperError(f"cannot open the ledger at {shown(url)}: {e.orig}") from e
            raise

    @classmethod
    def for_workspace(cls, root: Path, url: str | None = None) -> Ledger:
        """The workspace's ledger: ``url`` if given, else ``<root>/ledger/evidence.db``."""
        return cls(url or f"sqlite:///{Path(root) / 'ledger' / 'evidence.db'}")

    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def version(self) -> int:
        return schema_version(self.engine)

    # -- writing -----------------------------------------------------------

    def _append(
        self, kind: str, values: Mapping[str, object], evaluation_id: int | None = None, open_only: bool = False,
        check: Callable[[Connection], None] | None = None,
    ) -> int:
        # Any check runs under the same lock as the append, so two finishers cannot both pass it.
        with write(self.engine) as conn:
            if evaluation_id is not None:
                self._require_evaluation(conn, evaluation_id, open_only)
            if check is not None:
                check(conn)
            return append(conn, kind, values)

    @staticmethod
    def _require_evaluation(conn: Connection, evaluation_id: int, open_only: bool) -> None:
        """The evaluation exists and, for ``open_only``, has neither a verdict nor an abort record yet."""
        if not _rows(conn, "evaluation", id=evaluation_id):
            raise GatekeeperError(f"there is no evaluation {evaluation_id} in the ledger")
        if not open_only:
            return
        if verdict := _rows(conn, "verdict", evaluation_id=evaluation_id):
            raise GatekeeperError(
                f"evaluation {evaluation_id} already has a verdict ({verdict[0]['verdict']}); start a new evaluation"
            )
        if _rows(conn, "aborted", evaluation_id=evaluation_id):
            raise GatekeeperError(f"evaluation {evaluation_id} was aborted; start a new evaluation")

    def start_evaluation(self, flag: str, operator: str, gate: str, identity: dict, config: dict) -> int:
        values = dict(flag=flag, operator=operator, pid=os.getpid(), host=socket.gethostname(), gate=gate,
                      identity=identity, config=config)
        return self._append("evaluation", values)

    def add_case_result(self, evaluation_id: int, case_id: str, config: str, repeat: int, result: dict) -> int:
        values = dict(evaluation_id=evaluation_id, case_id=case_id, config=config, repeat=repeat, result=result)
        return self._append("case_result", values, evaluation_id, open_only=True)

    def add_comparison(self, evaluation_id: int, case_id: str, equal: bool, detail: dict) -> int:
        values = dict(evaluation_id=evaluation_id, case_id=case_id, equal=bool(equal), detail=detail)
        return self._append("comparison", values, evaluation_id, open_only=True)

    def finish_evaluation(self, evaluation_id: int, verdict: str, reasons: list[str], summary: dict) -> int:
        if verdict not in VERDICTS:
            raise GatekeeperError(f"verdict {verdict!r} is not one of {', '.join(VERDICTS)}")
        values = dict(evaluation_id=evaluation_id, verdict=verdict, reasons=list(reasons), summary=summary)
        return self._append("verdict", values, evaluation_id, open_only=True)

    def abort_evaluation(self, evaluation_id: int, reason: str) -> int:
        return self._append("aborted", dict(evaluation_id=evaluation_id, reason=reason), evaluation_id, open_only=True)

    def add_approval(self, flag: str, evaluation_id: int, operator: str, reason: str,
                     seal: dict[str, str] | None = None) -> int:
        """``seal``: a signed approval's ``SEAL_FIELDS`` (signature, signer, signed_at, record_digest)."""
        values = dict(flag=flag, evaluation_id=evaluation_id, operator=operator, reason=reason, **_seal(seal))
        return self._append("approval", values, evaluation_id)

    def add_flip(
        self,
        flag: str,
        state: str,
        operator: str,
        reason: str,
        evaluation_id: int | None = None,
        approval_ids: list[int] | None = None,
        seal: dict[str, str] | None = None,
        after: int | None = None,
    ) -> int:
        """A flip; with ``after``, only while the flag's last flip is that one (checked under the append's lock), else
        ``Superseded``: of a fleet's proxies that find a breach at once, one rolls the flag back."""
        if state not in FLIP_STATES:
            raise GatekeeperError(f"flag state {state!r} is not one of: on, off")
        values = dict(flag=flag, state=state, evaluation_id=evaluation_id, operator=operator, reason=reason,
                      approval_ids=None if approval_ids is None else list(approval_ids), **_seal(seal))

        def last_is_after(conn: Connection) -> None:
            flips = _rows(conn, "flip", flag=flag)
            if not flips or flips[-1]["id"] != after:
                raise Superseded(f"{flag}'s last flip is {flips[-1]['id'] if flips else 'none'}, not {after}: "
                                 f"{flips[-1]['operator'] if flips else 'nobody'} flipped it since")

        return self._append("flip", values, evaluation_id, check=last_is_after if after is not None else None)

    def add_refusal(self, flag: str, operator: str, reasons: list[str], evaluation_id: int | None = None) -> int:
        values = dict(flag=flag, evaluation_id=evaluation_id, operator=operator, reasons=list(reasons))
        return self._append("refusal", values, evaluation_id)

    def add_flush(self, trigger: str, old: dict, new: dict, detail: dict | None = None) -> int:
        return self._append("flush", dict(trigger=trigger, old=old, new=new, detail=detail or {}))

    def add_measurement(self, operator: str, config: dict, result: dict) -> int:
        return self._append("measurement", dict(operator=operator, config=config, result=result))

    def add_calibration(self, flag: str, evaluation_id: int | None, operator: str, config: dict, result: dict) -> int:
        values = dict(flag=flag, evaluation_id=evaluation_id, operator=operator, config=config, result=result)
        return self._append("calibration", values, evaluation_id)

    def add_shadow(self, flag: str, flip_id: int | None, operator: str, summary: ShadowSummary, items: list[Kept]) -> int:
        """A batch of the guard's live comparisons (``traffic/live/guarded.py``)."""
        values = dict(flag=flag, flip_id=flip_id, operator=operator, summary=summary, items=list(items))
        return self._append("shadow", values)

    # -- reading -----------------------------------------------------------

    def evaluations(self, limit: int | None = None) -> list[EvaluationLine]:
        """Evaluations, newest first, with derived status and evidence counts."""
        with read(self.engine) as conn:
            t = _table("evaluation")
            q = select(t).order_by(t.c.id.desc())
            if limit is not None:
                q = q.limit(limit)
            started = cast("list[StartedRow]", [decode("evaluation", dict(r)) for r in conn.execute(q).mappings()])
            verdicts = {r["evaluation_id"]: r for r in cast("list[VerdictRow]", _rows(conn, "verdict"))}
            aborts = {r["evaluation_id"]: r for r in cast("list[AbortedRow]", _rows(conn, "aborted"))}
            counts = {kind: self._counts(conn, kind) for kind in ("case_result", "comparison")}
        out: list[EvaluationLine] = []
        for s in started:
            v, a = verdicts.get(s["id"]), aborts.get(s["id"])
            out.append({
                "id": s["id"], "flag": s["flag"], "operator": s["operator"], "gate": s["gate"],
                "started_at": s["started_at"], "status": derive_status(s, v, a),
                "verdict": v["verdict"] if v else None, "reasons": v["reasons"] if v else [],
                "case_results": counts["case_result"].get(s["id"], 0),
                "comparisons": counts["comparison"].get(s["id"], 0),
            })
        return out

    @staticmethod
    def _counts(conn: Connection, kind: str) -> dict[int, int]:
        t = _table(kind)
        return dict(conn.execute(select(t.c.evaluation_id, func.count()).group_by(t.c.evaluation_id)).all())

    def evaluation(self, evaluation_id: int) -> EvaluationRecord | None:
        """Everything about one evaluation: its started record, evidence, verdict or abort, status."""
        with read(self.engine) as conn:
            return evaluation_record(lambda kind, **equal: _rows(conn, kind, **equal), evaluation_id)

    def history(self, flag: str) -> list[HistoryRow]:
        """Every evaluation of ``flag``, oldest first, with its status and verdict but not its case evidence
        (``records.history``): the looks ``gate/stats/looks.py`` counts."""
        with read(self.engine) as conn:
            return history(lambda kind, **equal: _rows(conn, kind, **equal), flag)

    def _read(self, kind: str, after: int | None = None, **equal: object) -> list[dict[str, object]]:
        with read(self.engine) as conn:
            return _rows(conn, kind, after, **equal)

    def records(self, kind: str) -> list[dict[str, object]]:
        """Every row of one kind, oldest first: column -> decoded value (each kind's row type says which)."""
        return self._read(kind)

    def flips(self, flag: str | None = None) -> list[FlipRow]:
        return cast("list[FlipRow]", self._read("flip", flag=flag))

    def approvals(self, flag: str | None = None, evaluation_id: int | None = None) -> list[ApprovalRow]:
        return cast("list[ApprovalRow]", self._read("approval", flag=flag, evaluation_id=evaluation_id))

    def refusals(self, flag: str | None = None, evaluation_id: int | None = None) -> list[RefusalRow]:
        return cast("list[RefusalRow]", self._read("refusal", flag=flag, evaluation_id=evaluation_id))

    def flushes(self) -> list[FlushRow]:
        return cast("list[FlushRow]", self._read("flush"))

    def measurements(self) -> list[dict[str, Any]]:
        return self._read("measurement")

    def shadows(self, flag: str | None = None, flip_id: int | None = None, after: int | None = None) -> list[ShadowBatch]:
        """The guard's batches, oldest first: of one flag, of the flip to on they watched, written after batch ``after``."""
        return cast("list[ShadowBatch]", self._read("shadow", after, flag=flag, flip_id=flip_id))

    def calibrations(self, evaluation_id: int | None = None) -> list[CalibrationRow]:
        return cast("list[CalibrationRow]", self._read("calibration", evaluation_id=evaluation_id))

    def flag_states(self) -> dict[str, FlipRow]:
        """The latest flip of every flag ever flipped; an absent flag is at its default (off)."""
        return latest_flips(self.flips())

    def entries(self) -> list[ChainEntry]:
        """The whole chain, oldest first, payloads decoded: what an export carries."""
        t = Entry.__table__  # type: ignore[attr-defined]
        with read(self.engine) as conn:
            rows = conn.execute(select(t).order_by(t.c.seq)).mappings()
            return [cast(ChainEntry, {**r, "payload": json.loads(r["payload"])}) for r in rows]

    def seqs(self, kind: str) -> dict[int, int]:
        """Record id -> the seq of its entry, for every row of ``kind``: read by the (kind, record_id) index, so it costs
        the rows of that kind, not the whole chain."""
        t = Entry.__table__  # type: ignore[attr-defined]
        with read(self.engine) as conn:
            rows: list[Any] = list(conn.execute(select(t.c.record_id, t.c.seq).where(t.c.kind == kind)))
        return {int(r[0]): int(r[1]) for r in rows}

    def verify(self, root: Path | None = None, full: bool = False, record: bool = True) -> VerifyReport:
        """The chain and every row (``verify.verify``). With ``root`` (the workspace's): from the point its last good
        verify of this ledger reached (``mark``), unless ``full``, and (``record``) the point this one reaches is
        recorded there; a caller that checks more first (the checkpoints) records it with ``record_verified``."""
        from gatekeeper.ledger import mark

        since, why = (None, "--full") if full or root is None else mark.load(root, self.url)
        with read(self.engine) as conn:
            behind = ""
            if since is not None:
                since, why, behind = mark.start(conn, since)
            report = verify(conn, since, behind)
        if record:
            self.record_verified(root, report)
        return replace(report, why_full=why if report.since is None else "")

    def record_verified(self, root: Path | None, report: VerifyReport) -> None:
        """Record in the workspace at ``root`` where a good ``verify`` got to: the next one starts there."""
        from gatekeeper.ledger import mark

        if root is not None and report.ok and report.reached is not None:
            mark.save(root, self.url, report.reached)

    def head(self) -> Head | None:
        """The chain's last entry (seq, hash) and how many entries there are; None when empty."""
        t = Entry.__table__  # type: ignore[attr-defined]
        with read(self.engine) as conn:
            last = conn.execute(select(t.c.seq, t.c.hash).order_by(t.c.seq.desc()).limit(1)).first()
            count = conn.scalar(select(func.count()).select_from(t))
        if last is None:
            return None
        return {"seq": last.seq, "hash": last.hash, "entries": count or 0}  # count is None only for an empty table

    def entry(self, seq: int) -> StoredEntry | None:
        """One entry as stored (payload as text), or None."""
        t = Entry.__table__  # type: ignore[attr-defined]
        with read(self.engine) as conn:
            row = conn.execute(select(t).where(t.c.seq == seq)).mappings().first()
        return cast(StoredEntry, dict(row)) if row is not None else None


def _at_current_version(engine, url: str) -> None:
    version = schema_version(engine)
    if version != CURRENT_VERSION:
        how = ("upgrade it once with 'gatekeeper ledger verify'" if version < CURRENT_VERSION
               else "upgrade gatekeeper to read it")
        raise GatekeeperError(f"the ledger at {shown(url)} is at schema version {version}, not this gatekeeper's "
                              f"{CURRENT_VERSION}, and a reader never writes; {how}")


def _seal(seal: dict[str, str] | None) -> dict[str, str]:
    if not seal:
        return {}
    if set(seal) != set(SEAL_FIELDS):
        raise ValueError(f"a seal has exactly the fields {', '.join(SEAL_FIELDS)}")
    return dict(seal)


@overload
def open_ledger(url: str, *, create: Literal[True]) -> Ledger: ...
@overload
def open_ledger(url: str, *, create: bool, read_only: bool = False) -> Ledger | None: ...
def open_ledger(url: str, *, create: bool, read_only: bool = False) -> Ledger | None:
    """The ledger at ``url``; with ``create=False`` a missing SQLite file gives None instead of a new database;
    ``read_only``: opened through a connection that cannot write (see ``Ledger``)."""
    if not create and url.startswith("sqlite:///") and not Path(url[len("sqlite:///"):]).exists():
        return None
    return Ledger(url, read_only=read_only)


def shown(url: str) -> str:
    """A ledger URL fit for messages: its password hidden."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return url


def _count(conn: Connection, table: str) -> int:
    return conn.scalar(text(f"SELECT COUNT(*) FROM {table}")) or 0


def copy_ledger(source: Ledger, destination: Ledger) -> VerifyReport:
    """Replay ``source`` into the empty ``destination`` entry by entry, in seq order: each typed row with
    its id, then its entry with its seq and hash, as stored. The source must verify first; the copy is one
    write transaction on the destination that is verified before it commits, so a failed copy leaves the
    destination empty. Returns the destination's verification, read afresh after the commit."""
    with read(source.engine) as src:
        report = verify(src)
        if not report.ok:
            raise LedgerIntegrityError(f"the source ledger does not verify ({report.problem}); nothing was copied")
        rows = {kind: {r["id"]: dict(r) for r in src.execute(text(f"SELECT * FROM {kind}")).mappings()}
                for kind in KINDS}
        chain = Entry.__table__  # type: ignore[attr-defined]
        entries = [dict(e) for e in src.execute(select(chain).order_by(chain.c.seq)).mappings()]

    with write(destination.engine) as dst:
        held = {t: n for t in ("entry", *KINDS) if (n := _count(dst, t))}
        if held:
            what = ", ".join(f"{t}: {n}" for t, n in held.items())
            raise GatekeeperError(f"the destination {shown(destination.url)} is not empty (rows of {what}); "
                                  "ledger copy only fills an empty ledger")
        for e in entries:
            table = _table(e["kind"])
            row = rows[e["kind"]][e["record_id"]]
            unknown = set(row) - set(table.c.keys())
            if unknown:
                raise GatekeeperError(f"{e['kind']} {e['record_id']} has columns this gatekeeper does not know: "
                                      f"{', '.join(sorted(unknown))}")
            # SQLite keeps booleans as 0/1; the destination's own type takes them.
            values = {k: bool(v) if v is not None and isinstance(table.c[k].type, Boolean) else v for k, v in row.items()}
            dst.execute(insert(table).values(**values))
            dst.execute(insert(chain).values(**e))
        if dst.dialect.name == "postgresql":
            # Rows came with their ids: move each id sequence past them, or the next append would collide.
            for kind in KINDS:
                dst.exec_driver_sql(
                    f"SELECT setval(pg_get_serial_sequence('{kind}', 'id'), COALESCE(MAX(id), 1), MAX(id) IS NOT NULL) "
                    f"FROM {kind}"
                )
        copied = verify(dst)
        if not copied.ok or copied.entries != len(entries):
            raise LedgerIntegrityError(
                f"the copy does not verify ({copied.problem or f'{copied.entries} of {len(entries)} entries'}); "
                "nothing was copied")
    return destination.verify()
