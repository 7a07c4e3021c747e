"""Looks: the evaluations of one change are looks at one question, so alpha is spent across them.

A paired bound (``paired.py``) or a sequential rule (``sequential.py``) keeps its level for one evaluation. Evaluating
the same change again after an INCONCLUSIVE ``underpowered:`` (docs/verdicts.md tells a user to add cases and do just
that) is one more look, and taking the first PASS of several looks at the full alpha passes a change whose loss is at
the margin far more often than alpha (``tests/test_statistics_looks.py`` simulates it: about 9% with two looks at
alpha 0.05, 11% with three).

**The schedule.** Look j of a change spends ``alpha * 2^-j`` (j = 1, 2, ...: alpha/2, alpha/4, ...), which sums to
alpha over any number of looks. A stated schedule, not an e-value product: a re-evaluation reruns the cases of the look
before it (and adds some), so its data are not fresh, and the union bound (Bonferroni) holds whatever the dependence
between looks where a product of e-values would not. The price: even a change evaluated once is judged at alpha/2.

**The change.** The flag and both sides' identity, less what belongs to the battery and to the policy (the battery
digest, the suites' decoding, the grader, the policy digest, a load's background drawn from the battery, the suites a
sampler names): adding cases, changing an assertion or widening the margin is another look at the same change, never a
fresh start. Another engine, model, adapter, candidate, declared change or rendering is another change.

**Which evaluations are looks.** Those judged from a bound (``non_inferiority``, and ``assertion_equivalence`` with a
margin above 0), finished or still running; an aborted one read nothing and spent nothing. Byte equivalence and
assertion equivalence at margin 0 compare exactly, with no bound: they are not looks, and spend nothing.

**What flip asks** (``problems``): a PASS is evidence only if it holds at the alpha its look is allotted, counted from
the change's history in the ledger; a PASS recorded before looks were counted is recomputed from its recorded counts at
that alpha, or refused where it cannot be (a sequential rule's bets are not recorded). A FAIL of the same change after a
PASS refuses that PASS, whatever the gate: the newest verdict on the change is against it.

Standard library only, beside ``identity`` and ``paired``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from ...evidence import EvaluationRecord, HistoryRow
from ...identity import digest
from ...summaries import LookSummary, OutcomeSummary, PairedSummary
from . import paired

SCHEDULE = "alpha * 2^-index"
BOUND_GATES = ("non_inferiority", "assertion_equivalence")
# identity parts that belong to the battery or the policy: they may change between looks at one change
NOT_THE_CHANGE = ("battery_digest", "policy_digest", "decoding", "grader")


def allotted(index: int, alpha: float) -> float:
    """The alpha look ``index`` (from 1) of a change spends: alpha * 2^-index; over all looks they sum to alpha."""
    if index < 1:
        raise ValueError(f"looks count from 1, got {index}")
    return alpha * 2.0 ** -index


def judged_by_bound(gate: str, margin: float) -> bool:
    """Whether a policy's verdicts rest on a confidence bound (and so are looks): not byte equivalence, and not
    assertion equivalence at margin 0 (identical outcomes, exactly)."""
    return gate == "non_inferiority" or (gate == "assertion_equivalence" and margin > 0)


def change_key(flag: str, identity: dict[str, Any]) -> str:
    """The digest of the change an evaluation looked at: the flag and both sides' identity without the battery's and
    the policy's parts (``NOT_THE_CHANGE``)."""
    sides = {}
    for side in ("off", "on"):
        part = {k: v for k, v in (identity.get(side) or {}).items() if k not in NOT_THE_CHANGE}
        load = part.get("load")
        if isinstance(load, dict) and load.get("background") == "battery":  # its digest is the battery's
            part["load"] = {k: v for k, v in load.items() if k != "source_digest"}
        if isinstance(part.get("sampler"), dict):  # which suites sample is the battery's
            part["sampler"] = {k: v for k, v in part["sampler"].items() if k != "suites"}
        sides[side] = part
    return digest({"flag": flag, **sides})


def is_look(row: HistoryRow) -> bool:
    """Whether one evaluation of the ledger's history (``Ledger.history``) was a look at a bound: not aborted, and
    recorded as one (``looks`` in its summary), or, recorded before looks were, judged by a paired bound or a
    sequential rule; one still running counts when its gate decides from a bound."""
    if row["status"] == "aborted":
        return False
    summary = row.get("summary")
    if summary is None:
        return row["gate"] in BOUND_GATES
    if "looks" in summary:
        return summary["looks"] is not None
    stats = summary.get("paired")
    return bool(summary.get("sequential")) or (isinstance(stats, dict) and stats.get("test") != "exact")


@dataclass
class Look:
    """Which look at its change an evaluation is, and the alpha it spends (the verdict record's ``looks``)."""

    index: int  # from 1
    of_change: list[int]  # the evaluations that looked at this change so far, this one last
    alpha: float  # the policy's alpha: what all looks at the change spend together
    alpha_spent: float  # this look's share: allotted(index, alpha)
    change: str  # change_key
    schedule: str = SCHEDULE

    def to_dict(self) -> LookSummary:
        return LookSummary(index=self.index, of_change=list(self.of_change), alpha=self.alpha,
                           alpha_spent=self.alpha_spent, change=self.change, schedule=self.schedule)


def line(looks: LookSummary) -> str:
    """One line for the views: which look, of which evaluations, and what it spent."""
    return (f"look {looks['index']} of this change (evaluations {', '.join(map(str, looks['of_change']))}): alpha "
            f"{looks['alpha_spent']:.4g} of the policy's {looks['alpha']:g} spent ({looks['schedule']})")


def take(history: list[HistoryRow], evaluation_id: int, gate: str, margin: float, alpha: float) -> Look | None:
    """The look an evaluation just started takes (None: its gate compares exactly and spends nothing). ``history``:
    the flag's evaluations (``Ledger.history``), this one among them. Every earlier evaluation of the change that is a
    look counts, one still running too (so two run side by side never take one index)."""
    if not judged_by_bound(gate, margin):
        return None
    me = next(h for h in history if h["id"] == evaluation_id)
    key = change_key(me["flag"], me["identity"])
    earlier = [h["id"] for h in _same(history, key) if h["id"] < evaluation_id and is_look(h)]
    index = len(earlier) + 1
    return Look(index, [*earlier, evaluation_id], alpha, allotted(index, alpha), key)


def following(history: list[HistoryRow], evaluation: EvaluationRecord | None) -> int:
    """The index the next look at ``evaluation``'s change would take (``battery size`` sizes for it): one past every
    look at that change in ``history`` (``Ledger.history``); 1 with no evaluation to name the change."""
    if evaluation is None:
        return 1
    key = change_key(evaluation["flag"], evaluation["identity"])
    return 1 + sum(1 for h in _same(history, key) if is_look(h))


def _same(history: Iterable[HistoryRow], key: str) -> list[HistoryRow]:
    return [h for h in history if change_key(h["flag"], h["identity"]) == key]


def _alpha(summary: OutcomeSummary) -> float | None:
    """The alpha a verdict recorded before looks were counted was judged at (the policy's, then)."""
    for part in (summary.get("sequential"), summary.get("paired")):
        if isinstance(part, dict) and isinstance(part.get("alpha"), (int, float)):
            return float(part["alpha"])
    return None


def _bound(stats: PairedSummary, alpha: float) -> tuple[str, float, float] | None:
    """One paired verdict's (verdict, lower, upper) again at ``alpha``, from its recorded counts and design effect
    (``paired.tango_bounds``, the bound it was judged by); None where the record cannot say."""
    try:
        n, b, c, e, m, test = stats["n"], stats["harmful"], stats["beneficial"], stats["deff"], stats["margin"], stats["test"]
    except KeyError:
        return None
    if test not in ("non_inferiority", "equivalence") or not e or e <= 0:
        return None
    lower, upper = paired.tango_bounds(b / e, c / e, n / e, alpha)
    if test == "equivalence":
        verdict = "pass" if -m <= lower and upper <= m else "fail" if lower > m or upper < -m else "underpowered"
    else:
        verdict = "pass" if upper <= m else "fail" if lower > m else "underpowered"
    return verdict, lower, upper


def recheck(summary: OutcomeSummary, alpha: float) -> tuple[bool, str] | None:
    """Whether a recorded paired PASS holds at ``alpha`` (and, if not, where it fails); None where it cannot be
    recomputed from the record (a sequential rule's bets are not recorded)."""
    stats = summary.get("paired")
    if summary.get("sequential") or not isinstance(stats, dict):
        return None
    if "suites" in stats:  # per-suite margins: each suite at alpha / k (Bonferroni), as when it was judged
        k = len(stats["suites"]) or 1
        for name, s in stats["suites"].items():
            found = _bound(s, alpha / k)
            if found is None:
                return None
            if found[0] != "pass":
                return False, f"suite {name} at alpha {alpha:.4g}/{k}: {_where(s, *found)}"
        return True, ""
    found = _bound(stats, alpha)
    if found is None:
        return None
    return found[0] == "pass", _where(stats, *found)


def _where(stats: PairedSummary, verdict: str, lower: float, upper: float) -> str:
    m = stats["margin"]
    if stats["test"] == "equivalence":
        return f"bounds [{lower:.3f}, {upper:.3f}] not within +-{m:g}"
    return f"upper bound {upper:.3f} > margin {m:g}"


def problems(history: list[HistoryRow], evaluation_id: int) -> list[str]:
    """Why the change's history keeps the PASS ``evaluation_id`` from being evidence (each reason starts ``looks:``);
    empty when it may be used. ``history``: the flag's evaluations (``Ledger.history``)."""
    me = next((h for h in history if h["id"] == evaluation_id), None)
    if me is None or me["status"] != "PASS":
        return []
    same = _same(history, change_key(me["flag"], me["identity"]))
    out = []
    if failed := [h["id"] for h in same if h["id"] > evaluation_id and h["status"] == "FAIL"]:
        out.append(f"looks: evaluation {failed[-1]} of the same change FAILed after evaluation {evaluation_id} passed, so "
                   f"the change's newest verdict is against it; read its reasons, and if the change is fixed, evaluate "
                   f"again (gatekeeper evaluate --flag {me['flag']}) and name that evaluation")
    if not is_look(me):
        return out
    summary = me["summary"]
    earlier = [h["id"] for h in same if h["id"] < evaluation_id and is_look(h)]
    recorded = summary.get("looks") if summary else None
    index = max(len(earlier) + 1, recorded["index"] if recorded else 0)
    budget = recorded["alpha"] if recorded else _alpha(summary) if summary else None
    spent = recorded["alpha_spent"] if recorded else budget
    which = f"evaluation {evaluation_id} is look {index} of this change (evaluations {', '.join(map(str, [*earlier, evaluation_id]))})"
    again = f"evaluate again (gatekeeper evaluate --flag {me['flag']})"
    if budget is None or spent is None:
        return out + [f"looks: {which}, and its record does not say at which alpha it passed; {again}: a new evaluation "
                      "records its look and the alpha it spends"]
    allowed = allotted(index, budget)
    if spent <= allowed * (1 + 1e-9):
        return out
    held = recheck(summary, allowed) if summary else None
    share = f"alpha {allowed:.4g} ({budget:g} * 2^-{index})"
    if held is None:
        return out + [f"looks: {which}; it passed at alpha {spent:g}{'' if recorded else ' before looks were counted'}, "
                      f"but its look is allotted {share}, at which its record (a sequential rule) cannot be judged "
                      f"again; {again}: a new evaluation records its look and the alpha it spends"]
    ok, where = held
    if ok:
        return out
    following = max(index, sum(is_look(h) for h in same)) + 1
    return out + [f"looks: {which}; it passed at alpha {spent:g}{'' if recorded else ' before looks were counted'}, "
                  f"but not at the {share} its look is allotted: {where}; add cases and {again} (look {following} is "
                  f"allotted {allotted(following, budget):.4g})"]
