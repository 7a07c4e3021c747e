"""``ledger verify`` whole: the chain and every record (``verify``), every signature (the check is handed
in: rechecking a signed approval or flip is the gate's, ``gate.enable.attestation.audit_signatures``), that the
ledger still extends every checkpoint the workspace records and each one given (``checkpoint``), and a
policy's ``checkpoint_after_flip``, merged into one typed result. What it finds is data: the command only
prints it and exits 1 when it is not ok.

A ledger is read before it is opened (opening migrates it, which would rewrite a ``migrations`` table that
was edited); on a ledger found damaged, what cannot be read for a later check is one more problem naming it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence, TypeVar

from gatekeeper.errors import GatekeeperError
from gatekeeper.ledger import checkpoint as cp
from gatekeeper.ledger.database import make_engine, read
from gatekeeper.ledger.store import open_ledger
from gatekeeper.ledger.verify import VerifyReport, preflight, reference, tables, verify

from ..summaries import NotRequired, TypedDict  # typing's, or typing_extensions' before 3.11

T = TypeVar("T")


class SignaturesChecked(TypedDict):
    """The ledger's signatures rechecked: how many, and each problem found."""

    checked: int
    problems: list[str]


class Coverage(TypedDict):
    """How much of the chain this verify rechecked: all of it, or the entries after the seq its last good verify
    reached (``mark``); and why all of it (``--full``, no mark yet, ...)."""

    full: bool
    from_seq: int | None  # None: the whole chain
    why: str  # why the whole chain; "" when from a mark


class Integrity(TypedDict):
    """What ``ledger verify --json`` prints (``LedgerAudit.to_dict``) and the review app's integrity badge reads. A
    ledger that cannot be read at all has only ``error`` beside ok and the problems; the review app's own lines (no
    ledger, or one it cannot open) have what they know."""

    ok: bool
    error: NotRequired[str]  # the unreadable ledger's one line
    entries: NotRequired[int | None]
    first_bad_seq: NotRequired[int | None]
    problem: str  # the first problem; "" when ok
    problems: list[str]
    signatures: NotRequired[SignaturesChecked]
    checkpoints: NotRequired[list[cp.Checked]]
    checkpoint_sources: NotRequired[dict[str, int]]  # how many checkpoints: {"workspace": n, "given": n}
    coverage: NotRequired[Coverage]  # the whole chain or from a seq


class SignatureCheck(Protocol):
    """What rechecking the ledger's signatures found (``gate.enable.attestation.SignatureAudit``)."""

    checked: int  # signatures rechecked
    problems: list[tuple[int | None, str]]  # (seq, "seq N: code: ..."), in seq order


@dataclass
class LedgerAudit:
    problems: list[str]  # every problem found, the first one first; [] when ok
    entries: int | None  # the ledger's entries; None when it was not read that far
    first_bad_seq: int | None
    signatures: SignaturesChecked | None = None  # None when not checked
    checkpoints: list[cp.CheckpointReport] = field(default_factory=list)  # each checkpoint checked
    sources: dict[str, int] = field(default_factory=dict)  # how many checkpoints: {"workspace": n, "given": n}
    unreadable: str | None = None  # a SQLite ledger that cannot be read at all: the one line saying so
    since: int | None = None  # the chain was checked after this seq only (a mark); None: whole
    why_full: str = ""  # why the whole chain was checked

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> Integrity:
        """What ``ledger verify --json`` prints."""
        if self.unreadable is not None:
            line = self.unreadable
            return {"ok": False, "error": line, "problem": line, "problems": [line]}
        # checkpoint_sources: how many checkpoints the workspace recorded and --checkpoint gave (none: a cut-off or
        # forged tail cannot show)
        return {"ok": self.ok, "entries": self.entries, "first_bad_seq": self.first_bad_seq,
                "problem": self.problems[0] if self.problems else "", "problems": self.problems,
                "signatures": self.signatures or {"checked": 0, "problems": []},
                "checkpoints": [c.to_dict() for c in self.checkpoints], "checkpoint_sources": self.sources,
                "coverage": {"full": self.since is None, "from_seq": self.since, "why": self.why_full}}


def audit_ledger(url: str, ws: Any, given: Sequence[Path], signatures: Callable[[Any], SignatureCheck],
                 read_only: bool = False, full: bool = False) -> LedgerAudit:
    """Everything ``ledger verify`` checks of the ledger at ``url`` and the workspace ``ws``'s checkpoints, and
    each checkpoint file in ``given``; ``signatures(ledger)`` rechecks the ledger's signatures. A checkpoint file
    or line that is no checkpoint, no ledger at ``url``, or a file that is no database is GatekeeperError (exit 2);
    a SQLite ledger SQLite cannot read is the result with ``unreadable`` set; any other error reading an intact
    ledger is raised as it is (a bug). ``read_only``: the ledger is read through a connection that cannot write
    (``gatekeeper review``), so one at an older schema version is an error rather than migrated. The chain is checked
    from where the workspace's last good verify of it got to (``mark``), or whole with ``full`` or without a mark."""
    # a file or line that is no checkpoint: exit 2, before anything else
    named = [(str(f), cp.load(f)) for f in given]
    own = [(name, c) for name, c in cp.recorded(ws) if all(c != g for _, g in named)]
    loaded = named + own
    sources = {"workspace": len(own), "given": len(named)}
    try:
        early, unopened = _before_opening(url, read_only)  # before opening, which would migrate a ledger whose migrations were edited
        if early:
            return LedgerAudit(early, unopened.entries if unopened else None,
                               unopened.first_bad_seq if unopened else None, sources=sources,
                               why_full="the schema or migrations are damaged")
        ledger = open_ledger(url, create=False, read_only=read_only)
        if ledger is None:
            raise GatekeeperError(f"no ledger at {url}; nothing has been recorded yet")
        with ledger:
            report = ledger.verify(ws.root, full=full, record=False)  # recorded once everything below passed
            # On a damaged ledger these read rows verify has already named; what they cannot read is one more problem.
            audit = _reached(report, "signatures", lambda: signatures(ledger))
            where = cp.location(ledger.url, ws.root)

            def against(c: cp.Checkpoint, name: str) -> Callable[[], cp.CheckpointReport]:
                return lambda: cp.check(c, name, ledger, where, ws.allowed_signers)

            checked = [_reached(report, f"checkpoint {name}", against(c, name)) for name, c in loaded]
            fresh = _reached(report, "checkpoint_after_flip", lambda: cp.uncovered_flips(
                ws, ledger, [c for c in checked if not isinstance(c, str) and c.ok]))
    except Exception as e:  # noqa: BLE001 - only a database error is turned into one line; anything else re-raised
        line = _unreadable(url, e)
        if line is None:
            raise
        return LedgerAudit([line], None, None, sources=sources, unreadable=line)
    unreached = [x for x in (audit, *checked, fresh) if isinstance(x, str)]
    sigs = None if isinstance(audit, str) else audit
    good = [c for c in checked if not isinstance(c, str)]
    flips = [] if isinstance(fresh, str) else fresh
    # a mark the ledger no longer extends comes last: a checkpoint that shows the same cut or fork says more
    problems = [*(p for p in report.problems if p != report.behind), *(p for _, p in (sigs.problems if sigs else [])),
                *(p for c in good for p in c.problems), *flips, *unreached, *([report.behind] if report.behind else [])]
    if not problems:
        ledger.record_verified(ws.root, report)
    first_bad = report.first_bad_seq if not report.ok else next(
        (s for s, _ in (sigs.problems if sigs else []) if s is not None), None)
    return LedgerAudit(problems, report.entries, first_bad,
                       {"checked": sigs.checked, "problems": [p for _, p in sigs.problems]} if sigs else None,
                       good, sources, since=report.since, why_full=report.why_full)


def _reached(report: VerifyReport, what: str, check: Callable[[], T]) -> T | str:
    """``check()``; on a ledger verify found damaged, an error reading it is the line saying what went unchecked."""
    try:
        return check()
    except GatekeeperError:
        raise
    except Exception as e:  # noqa: BLE001
        if report.ok:
            raise  # an intact ledger: a bug, exit 3
        return f"{what}: not checked, the damaged ledger cannot be read for it ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"


def _before_opening(url: str, read_only: bool) -> tuple[list[str], VerifyReport | None]:
    """Problems in a ledger's ``migrations`` table and layout, read without opening (migrating) it, with
    everything else verify finds where the tables are the current ones; and that report, if made."""
    from sqlalchemy.exc import OperationalError

    sqlite = url.startswith("sqlite:///")
    if sqlite and not Path(url[len("sqlite:///"):]).is_file() or not (sqlite or url.startswith("postgresql")):
        return [], None  # none there, or another database: opening it says what there is
    engine = make_engine(url, read_only=read_only)
    try:
        with read(engine) as conn:
            early = preflight(conn)
            if early and tables(conn) == reference()["tables"]:  # the rest can be checked unopened too
                report = verify(conn)
                return list(dict.fromkeys([*report.problems, *early])), report
            return early, None
    except OperationalError:
        return [], None  # a server that cannot be reached: opening the ledger says so
    finally:
        engine.dispose()


def _unreadable(url: str, e: Exception) -> str | None:
    """A SQLite ledger that cannot be read at all: the one line saying it is damaged (SQLite's own words), or
    GatekeeperError (exit 2) when the file is not an SQLite database or cannot be opened. None: ``e`` is not that."""
    import sqlite3

    from sqlalchemy.exc import DBAPIError

    cause = e if isinstance(e, DBAPIError) else e.__cause__
    orig = getattr(cause, "orig", None)
    if isinstance(e, UnicodeDecodeError) and url.startswith("sqlite:"):
        why = "its schema holds bytes that are not UTF-8"  # pysqlite failed to decode SQLite's own message
    elif not url.startswith("sqlite:") or not isinstance(orig, sqlite3.DatabaseError):
        return None
    else:
        why = (str(orig).splitlines() or [type(orig).__name__])[0]
    where = url[len("sqlite:///"):] if url.startswith("sqlite:///") else url
    if "file is not a database" in why or "unable to open" in why:
        raise GatekeeperError(f"{where}: not a ledger: SQLite cannot open it as a database ({why})") from None
    return f"{where}: the ledger is damaged and SQLite cannot read it ({why})"
