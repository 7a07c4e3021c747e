"""Each page's data, as plain JSON: what ``PAGE.json`` returns and what the page's template draws. Every page
carries the integrity badge, and names its ledger records by their entry hash (the permalink)."""

from __future__ import annotations

import sys
from functools import lru_cache
from pathlib import Path
from typing import Callable, Literal, Mapping, Sequence, Union
from urllib.parse import quote, urlencode

from .. import signing
from ..cache.trie import common_prefix
from ..evidence import CaseResult, Comparison, Crash, EvaluationRecord, Top2
from ..gate.kinds import drifts, margin
from ..gate.state import flags as flag_states
from ..identity import directory_digest
from ..ledger.store import Head
from ..reports import export
from ..reports.diff import Diff, diff
from ..reports.outcomes import case_outcomes, divergence_text, flips, observed, sides, verdict_summary
from ..summaries import ApprovalRow, Calibrated, DepartureRecord, FlipRow
from ..workspace import Policy
from .flags import FlagRow
from .source import PAGE, Listed, NotFound, Power, Source, View

if sys.version_info >= (3, 11):
    from typing import TypedDict
else:  # importing typing_extensions costs every CLI start 20 ms: only where typing lacks these
    from typing_extensions import TypedDict

CASE_FILTERS = ("all", "differs", "regressed", "improved", "unchanged")
VERDICT_FILTERS = ("PASS", "FAIL", "INCONCLUSIVE", "none")


# --- each page's data: what PAGE.json returns and its template reads ---------------------------------------------


class Badge(TypedDict):
    """The integrity badge: whether the ledger verifies, its first problem and how many, and its head."""

    ok: bool
    problem: str
    problems: int
    entries: int | None
    head: Head | None


class FlagsPage(TypedDict):
    page: Literal["flags"]
    integrity: Badge
    flags: list[FlagRow]
    flags_error: str | None
    workspace: str


class LivePage(TypedDict):
    page: Literal["live"]
    integrity: Badge
    flags_error: str | None
    live: list[Mapping[str, object]]  # gate.guard.live: what the guard compared after each flip


class IntegrityPage(TypedDict):
    page: Literal["integrity"]
    integrity: Badge
    verify: Mapping[str, object]  # what ledger verify --json prints
    head: Head | None


class EvaluationsPage(TypedDict):
    page: Literal["evaluations"]
    integrity: Badge
    filters: dict[str, str]
    page_size: int
    flags: list[str]
    rows: list[Listed]
    total: int
    before: str | None
    next: str | None
    first: str


class CaseLine(TypedDict):
    """A case in the evaluation page's table: its status, where it parted, its drift and its flips off -> on."""

    case_id: str
    href: str
    status: str
    where: str
    drift: float | None
    passed: dict[str, str]
    seconds: dict[str, float]
    harmful: int
    beneficial: int


class SuiteFlips(TypedDict):
    suite: str
    harmful: int
    beneficial: int
    cases: int


class EvaluationPage(export.Shown):
    """One evaluation: its export view's fields, the per-case table under a filter, its approvals and flips."""

    page: Literal["evaluation"]
    integrity: Badge
    id: int
    permalink: str
    previous: int | None
    flips_by_suite: list[SuiteFlips]
    cases_filter: str
    case_counts: dict[str, int]
    cases: list[CaseLine]
    approvals: list[dict[str, object]]
    flips: list[dict[str, object]]
    refusals: Sequence[Mapping[str, object]]
    attestations: Sequence[Mapping[str, object]]
    attest: str


class TurnView(TypedDict, total=False):
    """One side's turn (empty where that side has no such turn)."""

    text: str
    tokens: list[int]
    top2: list[Top2] | None
    prompt_tokens: int | None
    cached_tokens: int | None
    prefill_s: float | None
    decode_s: float | None


class TokenRow(TypedDict):
    """A generated position, both sides' tokens with their text and top-2 margins."""

    position: int
    off: int | None
    on: int | None
    off_piece: str | None
    on_piece: str | None
    off_margin: float | None
    on_margin: float | None
    differs: bool


class TurnRow(TypedDict):
    turn: int
    off: TurnView
    on: TurnView
    tokens: list[TokenRow]
    divergent_char: int


class DivergenceRow(Comparison):
    """A comparison of the case that differs, with its two runs named and in words."""

    sides: list[str]
    text: str


class DriftPoint(TypedDict):
    turn: int
    step: int
    drift: float


class DepartureRow(DepartureRecord):
    """Where an arm's answer parts from the reference, with both tokens' text where the tokenizer is here."""

    arm: str
    emitted_piece: str | None
    reference_piece: str | None


class SampleRow(TypedDict):
    """A sampled case's sample: both sides' answers and the token where they part (None: they pair throughout)."""

    case_id: str
    href: str
    current: bool
    off: str
    on: str
    parts: int | None


class OutcomeRow(TypedDict):
    """One assertion's outcome with the flag off and on, and whether it flipped."""

    assertion: str
    type: str | None
    off: bool | None
    on: bool | None
    reason_off: str | None
    reason_on: str | None
    flip: str | None  # harmful | beneficial


class CasePage(TypedDict):
    page: Literal["case"]
    integrity: Badge
    evaluation: int
    flag: str
    status: str
    case_id: str
    href: str
    previous: int | None
    permalink: str
    divergences: list[DivergenceRow]
    turns: list[TurnRow]
    drift: list[DriftPoint]
    departures: list[DepartureRow]
    samples: list[SampleRow]
    outcomes: list[OutcomeRow]
    crash: dict[str, Crash]


class ComparePage(Diff):
    page: Literal["compare"]
    integrity: Badge
    reference: int
    candidate: int
    permalink: str


Page = Union[FlagsPage, LivePage, IntegrityPage, EvaluationsPage, EvaluationPage, CasePage, ComparePage]


def badge(src: Source, view: View | None = None) -> Badge:
    """The integrity badge every page shows: ``ledger verify``'s result in one line."""
    view = view or src.view()
    i = view.integrity
    return {"ok": view.ok, "problem": i.get("problem") or "", "problems": len(i.get("problems") or []),
            "entries": i.get("entries"), "head": view.head}


def flags(src: Source) -> FlagsPage:
    view = src.view()
    return {"page": "flags", "integrity": badge(src, view), "flags": view.flags, "flags_error": view.flags_error,
            "workspace": str(src.root)}


def live(src: Source) -> LivePage:
    """Each flag's live evidence: what the guard compared after the flip, per stage, its tests and any rollback."""
    view = src.view()
    return {"page": "live", "integrity": badge(src, view), "flags_error": view.flags_error,
            "live": [live for f in view.flags if (live := f["live"])]}


def integrity(src: Source) -> IntegrityPage:
    view = src.view()
    return {"page": "integrity", "integrity": badge(src, view), "verify": view.integrity, "head": view.head}


def evaluations(src: Source, query: dict[str, str]) -> EvaluationsPage:
    """The evaluations list, one page of ``PAGE`` at a time, with its filters."""
    filters = {k: (query.get(k) or "").strip() for k in ("flag", "verdict", "since", "until")}
    if filters["verdict"] and filters["verdict"] not in VERDICT_FILTERS:
        raise BadRequest(f"verdict must be one of {', '.join(VERDICT_FILTERS)}, not {filters['verdict']!r}")
    for k in ("since", "until"):
        if filters[k] and not _is_date(filters[k]):
            raise BadRequest(f"{k} must be a date YYYY-MM-DD, not {filters[k]!r}")
    before = query.get("before")
    if before is not None and not before.isdigit():
        raise BadRequest(f"before must be an evaluation id, not {before!r}")
    page = src.evaluations(flag=filters["flag"] or None, verdict=filters["verdict"] or None, since=filters["since"] or None,
                           until=filters["until"] or None, before=int(before) if before else None)
    policies = src.workspace.policies
    for row in page["rows"]:
        row["power"] = _power(row.pop("calibrations"), policies.get(row["flag"]))
    kept = {k: v for k, v in filters.items() if v}
    return {"page": "evaluations", "integrity": badge(src), "filters": filters, "page_size": PAGE,
            "flags": sorted(policies), "rows": page["rows"], "total": page["total"], "before": before,
            "next": f"/evaluations?{urlencode({**kept, 'before': page['next_before']})}" if page["next_before"] else None,
            "first": f"/evaluations?{urlencode(kept)}" if kept else "/evaluations"}


def evaluation(src: Source, ref: str, cases: str = "all") -> EvaluationPage:
    """One evaluation: its export view (verdict, reasons, stages, strength, calibrations, distances), the per-case
    table under a filter, and its approvals and flips with their signers."""
    if cases not in CASE_FILTERS:
        raise BadRequest(f"cases must be one of {', '.join(CASE_FILTERS)}, not {cases!r}")
    record = src.evaluation(ref)
    v = export.view(record)
    rows = case_rows(record)
    with src.ledger() as ledger:
        assert ledger is not None  # src.evaluation found the record in it
        flips = [f for f in ledger.flips(record["flag"]) if f["evaluation_id"] == record["id"]]
        refusals = ledger.refusals(record["flag"], record["id"])
    return {"page": "evaluation", "integrity": badge(src), "id": record["id"],
            "permalink": _permalink(src, record["id"]), "previous": src.previous(record["id"], record["flag"]),
            "flag": v["flag"], "gate": v["gate"], "status": v["status"], "verdict": v["verdict"], "reasons": v["reasons"],
            "operator": v["operator"], "started_at": v["started_at"], "finished_at": v["finished_at"],
            "aborted": v["aborted"], "config": v["config"], "identity_rows": v["identity_rows"], "stages": v["stages"],
            "chart": v["chart"], "strength": v["strength"], "near_ties": v["near_ties"],
            "calibrations": v["calibrations"], "probes": v["probes"],
            **export.sections(verdict_summary(record)),
            "flips_by_suite": _flips_by_suite(rows),
            "cases_filter": cases, "case_counts": {f: sum(_matches(r, f) for r in rows) for f in CASE_FILTERS},
            "cases": [r for r in rows if _matches(r, cases)],
            "approvals": [_signed(a) for a in record.get("approvals") or []],
            "flips": [_signed(f) for f in flips], "refusals": refusals, "attestations": src.attestations(record["id"]),
            "attest": f"gatekeeper ledger attest {record['id']} --sign KEY --output {record['flag']}-{record['id']}.intoto.json"}


def case_rows(record: EvaluationRecord) -> list[CaseLine]:
    """Per case: its status, where it parted, its drift, and its assertion flips off -> on (harmful: a pass that
    became a fail; beneficial: the reverse)."""
    firsts = {(r["case_id"], r["config"]): r["result"] for r in record["case_results"] if r["repeat"] == 0}
    out: list[CaseLine] = []
    for c in case_outcomes(record):
        off, on = firsts.get((c.case_id, "off")), firsts.get((c.case_id, "on"))
        harmful, beneficial = flips(off["outcomes"], on["outcomes"]) if off and on else (0, 0)
        out.append({"case_id": c.case_id, "href": case_href(record["id"], c.case_id), "status": c.status,
                    "where": divergence_text(c.divergence or c.unstable), "drift": c.drift, "passed": c.passed,
                    "seconds": c.seconds, "harmful": harmful, "beneficial": beneficial})
    return out


def case(src: Source, ref: str, case_id: str) -> CasePage:
    """One case: both outputs side by side per turn, token by token, where they part with both margins, the
    drift per step, and each assertion's outcome with the flag off and on."""
    record = src.evaluation(ref)
    runs = {(r["config"], r["repeat"]): r["result"] for r in record["case_results"] if r["case_id"] == case_id}
    if not runs:
        raise NotFound(f"evaluation {record['id']} has no case {case_id!r}")
    comparisons = [c["detail"] for c in record["comparisons"] if c["case_id"] == case_id and not c["equal"]]
    off, on = runs.get(("off", 0)), runs.get(("on", 0))
    identity = record.get("identity") or {}
    piece = {side: pieces(identity.get(side) or {}) for side in ("off", "on")}
    turns: list[TurnRow] = []
    for n in range(max(len(off["turns"]) if off else 0, len(on["turns"]) if on else 0)):
        a, b = _turn(off, n), _turn(on, n)
        turns.append({"turn": n + 1, "off": a, "on": b, "tokens": _aligned(a, b, piece["off"], piece["on"]),
                      "divergent_char": common_prefix(a.get("text") or "", b.get("text") or "")})
    steps = drifts(off, on) if off and on else {}
    return {"page": "case", "integrity": badge(src), "evaluation": record["id"], "flag": record["flag"],
            "status": record["status"], "case_id": case_id, "href": case_href(record["id"], case_id),
            "previous": src.previous(record["id"], record["flag"]),
            "permalink": _permalink(src, record["id"]) + f"/cases/{quote(case_id, safe='')}",
            "divergences": [{**d, "sides": list(sides(d)), "text": divergence_text(d)} for d in comparisons],
            "turns": turns, "drift": [{"turn": t, "step": s, "drift": d} for (t, s), d in sorted(steps.items())],
            "departures": _departures(record, case_id, piece), "samples": _samples(record, case_id),
            "outcomes": _outcomes(off, on), "crash": {k: r["crash"] for k, r in (("off", off), ("on", on)) if r and r.get("crash")}}


def _samples(record: EvaluationRecord, case_id: str) -> list[SampleRow]:
    """A sampled case's samples side by side (``SUITE/CASE~N``, each its own key): per sample, the flag-off and flag-on
    answers of its first runs and the token where they part (None: they pair token for token); empty for a case that
    was not sampled more than once."""
    base = case_id.split("~")[0]
    first = {(r["case_id"], r["config"]): r["result"] for r in record["case_results"]
             if r["repeat"] == 0 and r["case_id"].split("~")[0] == base and "~" in r["case_id"]}
    ids = sorted({cid for cid, _ in first}, key=lambda cid: int(cid.rsplit("~", 1)[1]))
    out: list[SampleRow] = []
    for cid in ids:
        off, on = first.get((cid, "off")), first.get((cid, "on"))
        a, b = (_tokens(r) for r in (off, on))
        parts = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))
        out.append({"case_id": cid, "href": case_href(record["id"], cid), "current": cid == case_id,
                    "off": off["text"] if off else "", "on": on["text"] if on else "", "parts": parts})
    return out if len(out) > 1 else []


def _tokens(result: CaseResult | None) -> list[int]:
    """Every turn's tokens of one answer, in order."""
    return [t for turn in (result["turns"] if result else []) for t in turn["tokens"]]


def _departures(record: EvaluationRecord, case_id: str, piece: dict[str, Callable[[int], str | None]]) -> list[DepartureRow]:
    """Where each arm's answers in this case part from the reference arm (gate/arms/reference.py), among the departures the
    record keeps (the first few of each arm), with the tokens' text where the tokenizer is here."""
    summary = verdict_summary(record)
    read = observed(summary.get("reference")) if summary else None
    arms = read["arms"] if read else {}
    return [{"arm": arm, **d, "emitted_piece": piece[arm](d["emitted"]), "reference_piece": piece[arm](d["reference"])}
            for arm, a in arms.items() for d in a.get("departures") or [] if d["case"] == case_id]


def compare(src: Source, a: str, b: str) -> ComparePage:
    """Two evaluations case by case (``ledger diff``), ``a`` the reference."""
    ra, rb = src.evaluation(a), src.evaluation(b)
    d = diff(ra, rb)
    for row in d["cases"]:
        row["href_a"] = case_href(ra["id"], row["case_id"]) if row["a"] else None
        row["href_b"] = case_href(rb["id"], row["case_id"]) if row["b"] else None
    return {"page": "compare", "integrity": badge(src), "reference": ra["id"], "candidate": rb["id"],
            "permalink": f"/compare/{_entry_ref(src, ra['id'])}/{_entry_ref(src, rb['id'])}", **d}


def case_href(evaluation_id: int, case_id: str) -> str:
    return f"/evaluations/{evaluation_id}/cases/{quote(case_id, safe='')}"


# --- helpers -----------------------------------------------------------------------------------------


class BadRequest(ValueError):
    """A query parameter out of range: 400 with the message."""


def _is_date(s: str) -> bool:
    from datetime import date

    try:
        date.fromisoformat(s)
    except ValueError:
        return False
    return True


def _entry_ref(src: Source, evaluation_id: int) -> str:
    return src.entry_hash("evaluation", evaluation_id) or str(evaluation_id)


def _permalink(src: Source, evaluation_id: int) -> str:
    return f"/evaluations/{_entry_ref(src, evaluation_id)}"


def _power(calibrations: list[Calibrated], policy: Policy | None) -> Power | None:
    """The share of cases the best calibration flagged at the policy's ``min_power`` noise (else the largest)."""
    if not calibrations:
        return None
    noise = policy.min_power.noise if policy is not None and policy.min_power is not None else 1.0
    share = max(flag_states.detected(c["result"], noise) for c in calibrations)
    wanted = policy.min_power.share if policy is not None and policy.min_power is not None else None
    return {"share": share, "noise": noise, "wanted": wanted, "calibrations": len(calibrations)}


def _matches(row: CaseLine, f: str) -> bool:
    return (f == "all" or (f == "differs" and row["status"] != "equal") or (f == "regressed" and row["harmful"] > 0)
            or (f == "improved" and row["beneficial"] > 0) or (f == "unchanged" and row["status"] == "equal"
                                                               and not row["harmful"] and not row["beneficial"]))


def _flips_by_suite(rows: list[CaseLine]) -> list[SuiteFlips]:
    suites: dict[str, SuiteFlips] = {}
    for r in rows:
        s = suites.setdefault(r["case_id"].split("/", 1)[0], {"suite": r["case_id"].split("/", 1)[0], "harmful": 0,
                                                               "beneficial": 0, "cases": 0})
        s["harmful"] += r["harmful"]
        s["beneficial"] += r["beneficial"]
        s["cases"] += 1
    return list(suites.values())


def _signed(row: ApprovalRow | FlipRow) -> dict[str, object]:
    """An approval or flip with its signer's key fingerprint (read from its signature), as ssh-keygen -l prints it."""
    fields: Mapping[str, object] = row
    out = {k: fields.get(k) for k in ("id", "flag", "state", "evaluation_id", "operator", "reason", "at", "signer",
                                       "signed_at") if k in fields}
    try:
        out["fingerprint"] = signing.parse(signature).fingerprint if (signature := row.get("signature")) else None
    except Exception:  # noqa: BLE001 - a damaged signature: the integrity badge names it; here it is just unknown
        out["fingerprint"] = "unreadable"
    return out


def _turn(result: CaseResult | None, n: int) -> TurnView:
    turns = result["turns"] if result else []
    if n >= len(turns):
        return {}
    t = turns[n]
    return {"text": t.get("text", ""), "tokens": t.get("tokens") or [], "top2": t.get("top2"),
            "prompt_tokens": t.get("prompt_tokens"), "cached_tokens": t.get("cached_tokens"),
            "prefill_s": t.get("prefill_s"), "decode_s": t.get("decode_s")}


def _margin(top2: list[Top2] | None, i: int) -> float | None:
    return margin(top2[i]) if top2 and i < len(top2) and len(top2[i] or []) >= 2 else None


def _aligned(a: TurnView, b: TurnView, piece_a: Callable[[int], str | None],
             piece_b: Callable[[int], str | None]) -> list[TokenRow]:
    """Both sides' generated tokens position by position, with their text and top-2 margins, marked where they
    differ."""
    ta, tb = a.get("tokens") or [], b.get("tokens") or []
    rows: list[TokenRow] = []
    for i in range(max(len(ta), len(tb))):
        x, y = (ta[i] if i < len(ta) else None), (tb[i] if i < len(tb) else None)
        rows.append({"position": i, "off": x, "on": y, "off_piece": None if x is None else piece_a(x),
                     "on_piece": None if y is None else piece_b(y), "off_margin": _margin(a.get("top2"), i),
                     "on_margin": _margin(b.get("top2"), i), "differs": x != y})
    return rows


def pieces(side: Mapping[str, Mapping[str, str | None]]) -> Callable[[int], str | None]:
    """Token id -> its text, from the tokenizer of the model a side ran, when that model is on this machine with the
    digest the evidence recorded (else no text: a tokenizer that changed since would mislabel the ids)."""
    profile, engine = side.get("profile") or {}, side.get("engine") or {}
    folder = Path(profile.get("tokenizer") or profile.get("model") or "")
    if not (folder / "tokenizer.json").is_file() or engine.get("model_digest") is None:
        return lambda _: None
    return _tokenizer(str(folder), engine["model_digest"] if not profile.get("tokenizer") else "")


@lru_cache(maxsize=8)
def _tokenizer(folder: str, model_digest: str) -> Callable[[int], str | None]:
    from tokenizers import Tokenizer

    if model_digest and directory_digest(folder) != model_digest:
        return lambda _: None
    tok = Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))
    return lambda i: tok.decode([i], skip_special_tokens=False)


def _outcomes(off: CaseResult | None, on: CaseResult | None) -> list[OutcomeRow]:
    oa, ob = off["outcomes"] if off else [], on["outcomes"] if on else []
    rows: list[OutcomeRow] = []
    for i in range(max(len(oa), len(ob))):
        x, y = (oa[i] if i < len(oa) else None), (ob[i] if i < len(ob) else None)
        kind = (x.get("type") if x else None) or (y.get("type") if y else None)
        name = (x.get("name") if x else None) or (y.get("name") if y else None) or f"#{i + 1} {kind}"
        passed_off, passed_on = (x.get("pass") if x else None), (y.get("pass") if y else None)
        rows.append({"assertion": name, "type": kind, "off": passed_off, "on": passed_on,
                     "reason_off": x.get("reason") if x else None, "reason_on": y.get("reason") if y else None,
                     "flip": "harmful" if passed_off and passed_on is False else
                     "beneficial" if passed_on and passed_off is False else None})
    return rows
