"""Each battery case's part in a recorded evaluation: what the gate found for it, where the sides parted,
how far the logits drifted and what it cost. The JUnit report and ``ledger diff`` read evaluations
through this one view."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Sequence, TypeVar, cast

from gatekeeper.evidence import AssertionOutcome, CaseResult, Comparison, EvaluationRecord
from gatekeeper.gate.kinds import divergence, drifts
from gatekeeper.summaries import NotObservable, OutcomeSummary

EQUAL, DIFFERS, UNSTABLE = "equal", "differs", "baseline_unstable"
T = TypeVar("T", bound=Mapping[str, object])


@dataclass
class CaseOutcome:
    case_id: str  # suite/id
    status: str  # equal | differs | baseline_unstable (its baseline runs disagreed)
    divergence: Comparison | None = None  # the flag-off vs flag-on comparison, when they differ
    unstable: Comparison | None = None  # the baseline comparison that disagreed
    drift: float | None = None  # largest top-2 logit drift, off vs on, over the steps they share; None: unknown
    seconds: dict[str, float] = field(default_factory=dict)  # configuration -> model seconds of its first run
    passed: dict[str, str] = field(default_factory=dict)  # configuration -> "k/n" assertions passed

    @property
    def suite(self) -> str:
        return "probes" if self.case_id.startswith("probe:") else self.case_id.split("/", 1)[0]  # gate/arms/probes.py

    @property
    def name(self) -> str:
        return self.case_id.removeprefix("probe:").split("/", 1)[-1]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def case_outcomes(record: EvaluationRecord) -> list[CaseOutcome]:
    """One outcome per case, in the order the cases ran."""
    firsts: dict[str, dict[str, CaseResult]] = {}  # case -> config -> its first run's result
    for r in record["case_results"]:
        if r["repeat"] == 0:
            firsts.setdefault(r["case_id"], {})[r["config"]] = r["result"]
    out = {cid: CaseOutcome(cid, EQUAL) for cid in firsts}
    for c in record["comparisons"]:
        case = out.setdefault(c["case_id"], CaseOutcome(c["case_id"], EQUAL))
        if c["equal"]:
            continue
        if c["detail"].get("pair", "off#0~on#0").split("~")[1].startswith("off"):
            case.status, case.unstable = UNSTABLE, c["detail"]
        else:
            case.divergence = c["detail"]
            case.status = DIFFERS if case.status == EQUAL else case.status
    for cid, runs in firsts.items():
        case = out[cid]
        for config, result in runs.items():
            turns = result.get("turns") or []
            case.seconds[config] = round(sum((t.get("prefill_s") or 0) + (t.get("decode_s") or 0) for t in turns), 4)
            outcomes = result.get("outcomes") or []
            case.passed[config] = f"{sum(bool(o.get('pass')) for o in outcomes)}/{len(outcomes)}"
        if "off" in runs and "on" in runs:
            steps = drifts(runs["off"], runs["on"])
            case.drift = max(steps.values()) if steps else None
    return list(out.values())


def verdict_summary(record: EvaluationRecord) -> OutcomeSummary | None:
    """The summary the verdict recorded (gate-specific figures: paired, sequential, distance, reference...); None
    where the evaluation has no verdict."""
    verdict = record.get("verdict_record")
    return (verdict["summary"] if verdict else None) or None


def observed(part: T | NotObservable | None) -> T | None:
    """A summary the engine gave (distance, reference); None where it was not read or not observable."""
    return None if part is None or "not_observable" in part else cast(T, part)


def case_flips(record: EvaluationRecord) -> dict[str, tuple[int, int]]:
    """Per case, its (harmful, beneficial) assertion flips, off#0 against on#0, for the gates judged on them
    (a paired or sequential verdict); empty for the others, whose reports then read as they did."""
    summary = verdict_summary(record)
    if not summary or not (summary.get("paired") or summary.get("sequential")):
        return {}
    firsts = {(r["case_id"], r["config"]): r["result"].get("outcomes") or [] for r in record["case_results"] if r["repeat"] == 0}
    return {cid: flips(off, firsts[(cid, "on")]) for (cid, config), off in firsts.items()
            if config == "off" and (cid, "on") in firsts}


def flips(off: Sequence[AssertionOutcome], on: Sequence[AssertionOutcome]) -> tuple[int, int]:
    """(harmful, beneficial): assertions that passed with the flag off and fail with it on, and the reverse."""
    pairs = list(zip(off, on))
    return sum(a["pass"] and not b["pass"] for a, b in pairs), sum(b["pass"] and not a["pass"] for a, b in pairs)


def divergence_text(d: Comparison | None) -> str:
    """Where two runs parted, in one line: the turn, position, both tokens and their top-2 margins."""
    if not d:
        return "-"
    if d.get("turn") is None:
        changed = d.get("changed") or []
        what = ", ".join(f"{c['assertion']} {'pass' if c['off'] else 'fail'}->{'pass' if c['on'] else 'fail'}"
                         for c in changed)
        return f"assertion outcomes differ{': ' + what if what else ''}"
    return f"turn {d['turn']} position {d['first_divergent_position']}: tokens {divergence(d, sides(d), pieces=True)}"


def sides(d: Comparison) -> tuple[str, str]:
    """How a comparison's two runs are named: flag-off and flag-on, or the runs of its pair (``off#0~off#1``)."""
    pair = (d.get("pair") or "off#0~on#0").split("~")
    if len(pair) != 2 or pair == ["off#0", "on#0"]:
        return ("flag-off", "flag-on")
    return (pair[0], pair[1])
