"""Gate kinds: what must hold between the flag-off and flag-on runs, and the verdict it gives.

``byte_equivalence``: token ids, text and assertion outcomes identical (and, for the cache flag,
the cache exercised); ``assertion_equivalence``: assertion outcomes identical (margin 0) or equivalent
within the margin; ``non_inferiority``: a one-sided bound on the loss in pass rate that rules out a loss
larger than the margin (both judged on paired outcomes, ``stats/paired.py``). Each kind is one object, looked up by the
policy's ``gate``; the gate runs the configurations, asks the kind to compare each case, then to decide.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterable, Iterator, Literal

from ..evidence import CaseResult, Change, Comparison, DivergentSide, Top2
from ..summaries import Flips, Statistics, Step, StrengthSummary, SuiteCensus
from ..workspace import Policy
from .stats import paired
from .stats.sequential import Sequential

NEAR_TIE = 0.1  # a top-2 logit margin at or below this is a near-tie: a few ULPs can flip it
# one side's margin a near-tie, the other's above twice NEAR_TIE (clear of bfloat16's rounding near a tie) and at
# least this many times it
COLLAPSE = 10
AT_RISK = 10  # a step whose top-2 margin is within this many times the largest drift could flip under it

Decision = tuple[str, list[str]]


@dataclass
class Strength:
    """How close equal outputs came to parting: the top-2 logit drift between the two sides.

    Drift is read at the generated steps both sides share before any divergence (same token
    chosen); ``where`` is ``{case, turn, step}`` (turn from 1, step = generated token from 0).
    Served engines give log-probabilities, so their drift is in those (differences agree)."""

    grade: str | None  # bit_exact | equal_outputs; None when the outputs differ
    max_drift: float | None  # None when no step had top-2 logits on both sides
    where: Step | None  # the largest drift's step; None when there is none
    steps_at_risk: int  # shared steps whose top-2 margin is within AT_RISK × max_drift
    steps: int  # shared steps compared
    unknown: int  # of those, steps where a side gave no top-2 logits: drift unknown there
    unknown_where: Step | None  # the first such step
    # the assertion outcome pairs beside the drift: {pairs, harmful, beneficial} (paired.flip_counts); None: not counted
    flips: Flips | None = None

    def to_dict(self) -> StrengthSummary:
        return StrengthSummary(grade=self.grade, max_drift=self.max_drift, where=self.where,
                               steps_at_risk=self.steps_at_risk, steps=self.steps, unknown=self.unknown,
                               unknown_where=self.unknown_where, flips=self.flips)

    def reason(self) -> str:
        """The grade of a PASS, as its reason."""
        if self.grade == "bit_exact":
            return f"bit_exact: top-2 logits identical at all {self.steps} generated steps of both configurations"
        unknown = (f"drift unknown at {self.unknown} of {self.steps} steps (no top-2 logits, first at {_at(self.unknown_where)})"
                   if self.unknown else "")
        if self.where is None:
            return f"equal_outputs: {unknown or 'no generated step to compare'}; bit_exact cannot be shown"
        return (f"equal_outputs: max drift {self.max_drift:.3g} at {_at(self.where)}; {self.steps_at_risk} of "
                f"{self.steps} steps at risk (top-2 margin within {AT_RISK}× the drift){'; ' + unknown if unknown else ''}")

    def bound_reason(self, bound: float) -> str | None:
        """Why a policy's ``max_drift`` cannot take this evidence; None when the drift is within it."""
        if self.max_drift is None:
            return (f"drift: the policy bounds the drift at {bound:g}, but no top-2 logits were compared"
                    f"{f' (none at {self.unknown} of {self.steps} steps)' if self.unknown else ''}")
        if self.max_drift > bound:
            return (f"drift: top-2 logits moved by {self.max_drift:.3g} at {_at(self.where)}, above the policy's "
                    f"max_drift {bound:g} ({self.steps_at_risk} of {self.steps} steps at risk)")
        return None

    def drift_reason(self) -> str:
        """Why a policy that requires ``bit_exact`` cannot take this equal-outputs evidence."""
        if self.where is not None:
            return (f"drift: the policy requires bit_exact, but top-2 logits moved by {self.max_drift:.3g} at "
                    f"{_at(self.where)} ({self.steps_at_risk} of {self.steps} steps at risk)")
        if not self.unknown:
            return "drift: the policy requires bit_exact, but no generated step was compared"
        return (f"drift: the policy requires bit_exact, but the drift is unknown at {self.unknown} of {self.steps} "
                f"steps (no top-2 logits, first at {_at(self.unknown_where)})")


def _at(where: Step | None) -> str:
    return "-" if where is None else f"{where['case']} turn {where['turn']} step {where['step']}"


def _shared_steps(a: CaseResult, b: CaseResult) -> Iterator[tuple[int, int, Top2 | None, Top2 | None]]:
    """(turn, step, top-2 of a, top-2 of b) at each generated step before the two results part;
    a turn that parts ends it (later turns extend different transcripts)."""
    for n, (ta, tb) in enumerate(zip(a["turns"], b["turns"])):
        a2, b2 = ta.get("top2") or [], tb.get("top2") or []
        for s, (x, y) in enumerate(zip(ta["tokens"], tb["tokens"])):
            if x != y:
                return
            yield n + 1, s, a2[s] if s < len(a2) else None, b2[s] if s < len(b2) else None
        if ta["tokens"] != tb["tokens"]:
            return


def step_drift(x: Top2 | None, y: Top2 | None) -> float | None:
    """How far two steps' top-2 logits moved ([[id, logit], [id, logit]] each); None where a side has none."""
    if not x or not y or len(x) < 2 or len(y) < 2:
        return None
    if x == y:
        return 0.0
    return max(abs(float(x[0][1]) - float(y[0][1])), abs(float(x[1][1]) - float(y[1][1])))


def drifts(a: CaseResult, b: CaseResult) -> dict[tuple[int, int], float]:
    """The drift at each shared generated step (turn, step) where both sides have top-2 logits."""
    return {(turn, step): d for turn, step, x, y in _shared_steps(a, b) if (d := step_drift(x, y)) is not None}


def strength(pairs: Iterable[tuple[str, CaseResult, CaseResult]], outputs_differ: bool) -> Strength:
    """The drift over (case id, flag-off result, flag-on result) pairs."""
    steps, unknown, unknown_where = 0, 0, None
    worst: tuple[float, Step] | None = None  # the largest drift (the first, on a tie) and where
    margins: list[float] = []
    for cid, a, b in pairs:
        for turn, step, x, y in _shared_steps(a, b):
            steps += 1
            drift = step_drift(x, y)
            if drift is None:
                unknown += 1
                unknown_where = unknown_where or Step(case=cid, turn=turn, step=step)
                continue
            assert x is not None and y is not None  # a known drift means both sides have top-2 logits
            margins.append(min(x[0][1] - x[1][1], y[0][1] - y[1][1]))
            if x == y:
                continue
            if worst is None or drift > worst[0]:
                worst = (drift, Step(case=cid, turn=turn, step=step))
    known = steps - unknown
    max_drift = worst[0] if worst else (0.0 if known else None)
    at_risk = sum(m <= AT_RISK * worst[0] for m in margins) if worst else 0
    grade = None if outputs_differ else ("bit_exact" if worst is None and known and not unknown else "equal_outputs")
    return Strength(grade, max_drift, worst[1] if worst else None, at_risk, steps, unknown, unknown_where)


def near_ties(results: Iterable[tuple[str, CaseResult]]) -> dict[str, SuiteCensus]:
    """Per suite, over (suite, result) pairs of the flag-off baseline: decode steps with a known top-2
    margin, how many are near-ties (margin at or below NEAR_TIE), the smallest margin, steps without one."""
    out: dict[str, SuiteCensus] = {}
    for suite, result in results:
        row = out.setdefault(suite, SuiteCensus(steps=0, near_ties=0, min_margin=None, unknown=0))
        for t in result["turns"]:
            top2 = t.get("top2") or []
            for s in range(len(t["tokens"])):
                m = margin(top2[s]) if s < len(top2) and len(top2[s]) >= 2 else None
                if m is None:
                    row["unknown"] += 1
                    continue
                row["steps"] += 1
                row["near_ties"] += m <= NEAR_TIE
                row["min_margin"] = m if row["min_margin"] is None else min(row["min_margin"], m)
    return out


def insensitive(census: dict[str, SuiteCensus]) -> list[str]:
    """Advice (never a failure) for each suite whose baseline never came near a tie."""
    return [f"insensitive: suite {suite}: none of its {row['steps']} flag-off decode steps has a top-2 margin at or "
            f"below {NEAR_TIE:g} (smallest {row['min_margin']:.3g}), so a drift of a few ULPs cannot flip any of "
            "them: this suite cannot show a numeric divergence; add cases whose greedy choices come near a tie (gatekeeper battery mine finds them)"
            for suite, row in census.items() if row["steps"] and not row["near_ties"]]


@dataclass
class Evidence:
    """What a kind decides on: the cases that differ and the figures of both sides."""

    cases: int
    differing: list[tuple[str, Comparison]]  # case id, its comparison
    passes: dict[str, int]  # assertions passed, flag off (first run) and on
    cached: int | None  # prompt tokens the flag-on side served from cache; None: the engine did not say
    bound: int  # the stable-prefix bound of the flag-on side's prompts, in whole units of the cache's granularity
    exercises_cache: bool  # the flag turns the prefix cache on: it must be shown to serve
    baseline_repeats: int
    strength: Strength | None = None  # the top-2 logit drift between the sides (kinds with ``numeric``)
    # per suite, each assertion's outcome pair: (cluster, passed flag off, passed flag on)
    pairs: dict[str, list[paired.Pair]] = field(default_factory=dict)

    @property
    def exercised(self) -> float:
        return min(1.0, self.cached / self.bound) if self.bound and self.cached else 0.0


def margin(step: Top2 | None) -> float | None:
    """One step's top-2 logit margin (best minus second); None without top-2 logits."""
    return None if not step else float(step[0][1] - step[1][1])


def first_divergence(a: list[int], b: list[int]) -> int:
    """The first position where two token lists differ (the shorter one's length if one extends the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _diff(a: Any, b: Any) -> dict[str, Any]:
    from deepdiff import DeepDiff  # only when outcomes differ: the import costs every CLI start 0.15 s

    return DeepDiff(a, b).to_dict()


def _collapse(ma: float | None, mb: float | None) -> Literal["a", "b"] | None:
    """Which side's margin alone collapsed ("a" or "b"), else None: its margin is at or below NEAR_TIE
    while the other's is known, above twice NEAR_TIE and at least COLLAPSE times it. Both near a tie is a
    near-tie (rounding may flip either), not a collapse; a side without top-2 logits shows nothing."""
    if ma is None or mb is None:
        return None
    sides: tuple[tuple[Literal["a", "b"], float, float], ...] = (("a", ma, mb), ("b", mb, ma))
    for name, low, high in sides:
        if low <= NEAR_TIE and high > 2 * NEAR_TIE and high >= COLLAPSE * low:
            return name
    return None


def _num(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4g}"


def divergence(d: Comparison, sides: tuple[str, str] = ("flag-off", "flag-on"), pieces: bool = False) -> str:
    """The parenthesised account of a first divergence that reasons and ledger views print: both tokens
    (with their pieces if ``pieces``), both top-2 margins, and "near-tie" (both sides near a tie: a few
    ULPs can flip it) or "one-sided collapse" (only one side near a tie: rounding cannot explain it).
    ``sides`` names sides a and b. Entries recorded before ``collapse`` existed lack it: read with .get."""
    none = DivergentSide(token=None, piece=None, margin=None)
    a, b = d.get("a") or none, d.get("b") or none

    def token(s: DivergentSide) -> str:
        return f"{s.get('token')} {s.get('piece')!r}" if pieces else f"{s.get('token')}"

    label = ""
    if d.get("near_tie"):
        label = ", near-tie"
    elif d.get("collapse") in ("a", "b"):
        (low, low_side), (high, high_side) = (((b, sides[1]), (a, sides[0])) if d["collapse"] == "b"
                                              else ((a, sides[0]), (b, sides[1])))
        label = (f", one-sided collapse: the margin fell to {_num(low.get('margin'))} ({low_side}) while it is "
                 f"{_num(high.get('margin'))} ({high_side}); rounding cannot explain it")
    return f"({token(a)} vs {token(b)}, margin {_num(a.get('margin'))} vs {_num(b.get('margin'))}{label})"


def token_diff(a: CaseResult, b: CaseResult, detok: Callable[[list[int]], str]) -> Comparison | None:
    """None when token ids, text bytes and outcomes are identical; else where and how they part."""
    for n, (ta, tb) in enumerate(zip(a["turns"], b["turns"])):
        if ta["tokens"] == tb["tokens"] and ta["text"] == tb["text"]:
            continue
        pos = first_divergence(ta["tokens"], tb["tokens"])
        side: dict[str, DivergentSide] = {}
        for name, t in (("a", ta), ("b", tb)):
            token = t["tokens"][pos] if pos < len(t["tokens"]) else None
            top2 = t.get("top2") or []
            side[name] = DivergentSide(token=token, piece=detok([token]) if token is not None else None,
                                       margin=margin(top2[pos] if pos < len(top2) else None))
        ma, mb = side["a"]["margin"], side["b"]["margin"]
        return Comparison(
            turn=n + 1,
            first_divergent_position=pos,
            a=side["a"], b=side["b"],
            near_tie=ma is not None and mb is not None and max(ma, mb) <= NEAR_TIE,
            collapse=_collapse(ma, mb),
            text_a=ta["text"], text_b=tb["text"],
            outcomes_diff=_diff(a["outcomes"], b["outcomes"]) if a["outcomes"] != b["outcomes"] else {},
        )
    if a["outcomes"] != b["outcomes"]:
        return Comparison(turn=None, outcomes_diff=_diff(a["outcomes"], b["outcomes"]))
    return None


def outcome_diff(off: CaseResult, on: CaseResult) -> Comparison | None:
    """None when every assertion has the same outcome; else which changed, and both texts."""
    changed = [Change(assertion=a.get("name") or f"#{n + 1} {a['type']}", off=a["pass"], on=b["pass"])
               for n, (a, b) in enumerate(zip(off["outcomes"], on["outcomes"])) if a["pass"] != b["pass"]]
    if not changed:
        return None
    return {"changed": changed, "text_a": off["text"], "text_b": on["text"],
            "outcomes_diff": _diff(off["outcomes"], on["outcomes"])}


class GateKind:
    """How the flag-on run is compared with the flag-off one, and what verdict that gives."""

    name: ClassVar[str]
    numeric: ClassVar[bool] = False  # the sides should agree to the bit: grade a PASS by drift, count near-ties

    def __init__(self, policy: Policy, sides: tuple[str, str] = ("flag off", "flag on")):
        self.policy = policy
        self.sides = sides  # how the reasons name the two configurations

    def compare(self, off: CaseResult, on: CaseResult, detok: Callable[[list[int]], str]) -> Comparison | None:
        return outcome_diff(off, on)

    def decide(self, e: Evidence) -> Decision:
        raise NotImplementedError

    def statistics(self, e: Evidence) -> Statistics | None:
        """What the kind's verdict rests on beyond the reasons (a paired bound), for the record; None: nothing."""
        return None

    def sequential(self, e: Evidence, rule: Sequential) -> Decision:
        """A sequential evaluation's verdict; only the kinds judged on paired outcomes have one (plan() refuses the rest)."""
        raise NotImplementedError


class ByteEquivalence(GateKind):
    name = "byte_equivalence"
    numeric = True

    def compare(self, off: CaseResult, on: CaseResult, detok: Callable[[list[int]], str]) -> Comparison | None:
        return token_diff(off, on, detok)

    def decide(self, e: Evidence) -> Decision:
        floor = self.policy.exercise_floor.min_cached_share
        if e.differing:
            reasons = []
            for cid, d in e.differing:
                if d.get("turn") is None:
                    reasons.append(f"differs: {cid} assertion outcomes differ")
                else:
                    reasons.append(f"differs: {cid} turn {d['turn']} first divergent token at position {d['first_divergent_position']} "
                                   f"{divergence(d, self.sides)}")
            return "FAIL", reasons
        same = (f"equal: all {e.cases} cases identical in token ids, text and assertion outcomes; "
                f"baseline stable over {e.baseline_repeats} runs")
        notes = []
        if e.exercises_cache and e.cached is None:
            blind = (f"not_observable: the flag-on engine reports no cached-token figure, so it cannot show that its "
                     f"cache served any of the {e.bound}-token stable-prefix bound")
            if not self.policy.exercise_floor.accept_unobservable:
                return "INCONCLUSIVE", [blind + "; use a server that reports usage.prompt_tokens_details.cached_tokens "
                                        "(or timings.cache_n), or set exercise_floor.accept_unobservable: true", same]
            notes.append(blind + " (accepted: exercise_floor.accept_unobservable)")
        elif e.exercises_cache and e.cached == 0:
            return "INCONCLUSIVE", [f"not_exercised: the cache served 0 tokens of a {e.bound}-token stable-prefix bound"]
        elif e.exercises_cache and e.exercised < floor:
            return "INCONCLUSIVE", [f"not_exercised: the cache served {e.cached} of a {e.bound}-token stable-prefix bound "
                                    f"({e.exercised:.2f} < floor {floor})"]
        elif e.exercises_cache:
            same += f"; cache served {e.exercised:.0%} of the stable-prefix bound"
        s = e.strength
        if self.policy.require == "bit_exact" and (s is None or s.grade != "bit_exact"):
            why = s.drift_reason() if s else "drift: the policy requires bit_exact, but no top-2 logits were compared"
            return "INCONCLUSIVE", [why, same, *notes]
        if self.policy.max_drift is not None:
            over = s.bound_reason(self.policy.max_drift) if s else (
                f"drift: the policy bounds the drift at {self.policy.max_drift:g}, but no top-2 logits were compared")
            if over:
                return "INCONCLUSIVE", [over, same, *notes]
        return "PASS", [same, *notes] + ([s.reason()] if s else [])


class Paired(GateKind):
    """A kind judged on paired assertion outcomes (gate/stats/paired.py): a one-sided bound on the loss in pass rate
    at the policy's ``alpha``, clustered by its ``cluster``, against its ``margin`` (or per-suite ``margins``,
    Bonferroni over the suites). PASS only when the bound rules the margin out, FAIL when the evidence shows a
    loss beyond it, else INCONCLUSIVE with the cases the margin needs: never a PASS on too little."""

    VERDICTS = {"pass": "PASS", "fail": "FAIL", "underpowered": "INCONCLUSIVE"}

    def judge(self, e: Evidence) -> paired.Paired | paired.Suites:
        raise NotImplementedError

    def statistics(self, e: Evidence) -> Statistics | None:
        return self.judge(e).to_dict()

    def flips(self, e: Evidence) -> list[str]:
        """Each assertion that changed, by case: harmful first."""
        off, on = self.sides
        changed = [(cid, c) for cid, d in e.differing for c in d.get("changed", [])]
        return ([f"regressed: {cid} assertion {c['assertion']!r} passes {off}, fails {on}" for cid, c in changed if c["off"]]
                + [f"improved: {cid} assertion {c['assertion']!r} fails {off}, passes {on}" for cid, c in changed if not c["off"]])

    def decide(self, e: Evidence) -> Decision:
        result = self.judge(e)
        return self.VERDICTS[result.verdict], self.flips(e) + [result.reason()]

    def sequential(self, e: Evidence, rule: Sequential) -> Decision:
        """A sequential evaluation's verdict: the rule's (gate/stats/sequential.py), INCONCLUSIVE where it stopped undecided."""
        return {"pass": "PASS", "fail": "FAIL"}.get(rule.decision, "INCONCLUSIVE"), self.flips(e) + [rule.reason()]


class AssertionEquivalence(Paired):
    """Margin 0: identical assertion outcomes, exactly (no statistics, and its reason says so); a margin: a two-sided
    equivalence test (two one-sided bounds within +-margin)."""

    name = "assertion_equivalence"

    def judge(self, e: Evidence) -> paired.Paired:
        pairs = [p for suite in e.pairs.values() for p in suite]
        return paired.equivalence(pairs, self.policy.margin, self.policy.alpha, self.policy.power)

    def decide(self, e: Evidence) -> Decision:
        off, on = self.sides
        if self.policy.margin or not e.differing:
            verdict, reasons = super().decide(e)
            if verdict == "PASS" and not self.policy.margin:
                reasons = [f"equal: all {e.cases} cases have the same assertion outcomes {off} and {on} ({e.passes['off']} "
                           f"passed); baseline stable over {e.baseline_repeats} runs", *reasons]
            return verdict, reasons
        return "FAIL", [f"differs: {cid} assertion {c['assertion']!r} {'passed' if c['off'] else 'failed'} {off}, "
                        f"{'passes' if c['on'] else 'fails'} {on}" for cid, d in e.differing for c in d["changed"]] + \
            [self.judge(e).reason()]


class NonInferiority(Paired):
    name = "non_inferiority"

    def judge(self, e: Evidence) -> paired.Paired | paired.Suites:
        p = self.policy
        if p.margins:  # an adapter may be asked to win on its own suite and lose nothing elsewhere
            return paired.by_suite(e.pairs, {s: p.margins.get(s, p.margin) for s in e.pairs}, p.alpha, p.power)
        return paired.decide([x for suite in e.pairs.values() for x in suite], p.margin, p.alpha, p.power)


KINDS: dict[str, type[GateKind]] = {k.name: k for k in (ByteEquivalence, AssertionEquivalence, NonInferiority)}
