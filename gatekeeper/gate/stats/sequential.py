"""Sequential evaluation: a bound on the loss that may be looked at after every case, stopping when it decides.

Why not paired.py's bound, looked at again and again: Tango's bound holds at 1 - alpha for a number of cases
fixed before the data are seen. Checked after every case and stopped at the first PASS, a change whose true loss
is at the margin PASSes far more often than alpha (``tests/test_sequential.py`` measures it): every look is one
more chance for noise to cross the margin.

The rule here is a **confidence sequence by betting** (Waudby-Smith & Ramdas 2023, "Estimating means of
bounded random variables by betting", JRSS-B 86(1):1-27; one side of their betting confidence sequence, with
their aGRAPA bet). Each cluster (a case, by default) gives one observation d = (harmful - beneficial) / pairs in
[-1, 1], the share of its assertions it lost; mu is the mean of d, the **loss per case** (each case weighs the
same; with equal assertions per case it is paired.py's pooled loss).

Why it is anytime-valid. For a candidate loss m the upper side's wealth is K+_t(m) = prod_{i<=t} (1 + l_i (m - d_i)),
a bet l_i >= 0, sized from d_1 .. d_{i-1} only, that the loss is below m. Each factor is positive (l_i is capped
below 1 / (1 - m)), and if mu >= m its expectation given the past is 1 + l_i (m - mu) <= 1: K+(m) is a
nonnegative supermartingale from 1, so by Ville's inequality P(K+_t(m) >= 1/alpha for some t) <= alpha. That
holds for every t at once, so it holds at any stopping time: after every case, at the first case where the rule
decides, at a budget. K+ grows with m, so U_t = inf {m : K+_t(m) >= 1/alpha} is a one-sided 1 - alpha upper
confidence sequence: P(mu >= U_t for some t) <= alpha. The lower side mirrors it with 1 + l_i (d_i - m).

Decisions are paired.py's, on these bounds: non-inferiority PASSes when U_t <= margin and FAILs when L_t > margin
(each side at alpha); equivalence (two one-sided tests, each at alpha) PASSes when -margin <= L_t and U_t <= margin
and FAILs when L_t > margin or U_t < -margin; otherwise the rule continues. A decision needs K at one threshold
only, kept as a running sum of logs: O(1) a case. The bounds themselves (for the record) are found by bisection.

Bet sizes change how soon the rule decides, never its level: aGRAPA, l_i = (m - mean) / (var + (m - mean)^2) from
the running mean and variance of the cases before (a prior pseudo-case: loss 0, variance 1/4), computed at the
threshold the side decides on (the margin; -margin for equivalence's lower side) and used for every m, so K is
monotone in m; clipped to [0, CAP x the largest bet that keeps every factor positive at every threshold the side
decides on].

The order: the argument needs each case to be a fresh draw, which a battery in the order it was written (easy
cases first, one suite after another) is not. The runner puts the clusters in a seeded random order (``order``):
a random order of cases drawn from the pipeline's traffic is itself such a draw, and the seed is recorded.

Standard library only, like paired.py.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from ...summaries import SequentialSummary
from .paired import Pair

RULE = "betting_confidence_sequence"
CAP = 0.75  # of the largest safe bet: a harmful flip at the cap keeps a quarter of the wealth (Waudby-Smith & Ramdas: 1/2 or 3/4)
PRIOR_VAR = 0.25  # the pseudo-case the bets start from (loss 0) has this variance

Decision = Literal["pass", "fail", "continue"]
Stop = Literal["decided", "max_cases", "max_seconds", "battery_exhausted"]
TESTS = ("non_inferiority", "equivalence")


@dataclass(frozen=True)
class Budget:
    """What a sequential evaluation may spend, and the seed of its order (evaluate --max-cases, --max-seconds, --seed)."""

    seed: int
    max_cases: int | None = None
    max_seconds: float | None = None


def order(clusters: Sequence[str], seed: int) -> list[int]:
    """Indices of the cases, clusters in a random order drawn from ``seed`` and each cluster's cases together, in
    the order given (``clusters[i]``: case i's cluster). The same seed and battery give the same order."""
    keys = list(dict.fromkeys(clusters))
    random.Random(seed).shuffle(keys)
    rank = {k: n for n, k in enumerate(keys)}
    return sorted(range(len(clusters)), key=lambda i: (rank[clusters[i]], i))


def case_loss(pairs: Iterable[Pair]) -> tuple[float, int, int, int] | None:
    """One cluster's observation: (d, pairs, harmful, beneficial), d = (harmful - beneficial) / pairs; None: no pairs."""
    n = b = c = 0
    for _, off, on in pairs:
        n += 1
        b += bool(off) and not on
        c += (not off) and bool(on)
    return ((b - c) / n, n, b, c) if n else None


@dataclass
class _Side:
    """One side's wealth: bets sized at ``at`` (the threshold it is tuned for), each capped at ``cap``; ``sign`` +1
    for the upper side (bets the loss is below m: factors 1 + l (m - d)), -1 for the lower (1 + l (d - m))."""

    sign: int
    at: float
    cap: float
    thresholds: tuple[float, ...]  # where decisions read it: log K at each, kept as a running sum
    log_k: list[float] = field(default_factory=list)
    bets: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.log_k = [0.0] * len(self.thresholds)

    def bet(self, mean: float, var: float) -> float:
        edge = self.sign * (self.at - mean)  # how far the estimate lies on the side this one bets on
        if edge <= 0.0:
            return 0.0
        return min(edge / (var + edge * edge), self.cap)

    def update(self, d: float, bet: float) -> None:
        self.bets.append(bet)
        for n, m in enumerate(self.thresholds):
            self.log_k[n] += math.log1p(bet * self.sign * (m - d))

    def log_wealth(self, m: float, ds: Sequence[float]) -> float:
        return sum(math.log1p(b * self.sign * (m - d)) for b, d in zip(self.bets, ds))

    def bound(self, level: float, ds: Sequence[float]) -> float:
        """The confidence sequence's end on this side: the m where log K(m) first reaches ``level``, searched over
        the m where every factor stays positive (beyond them nothing is claimed, which keeps the level)."""
        floor = 1.0 - 1.0 / self.cap  # upper side: factors 1 + cap (m - 1) > 0 above it; the lower side mirrors it
        lo, hi = (max(floor, -1.0), 1.0) if self.sign > 0 else (-1.0, min(-floor, 1.0))
        if self.sign > 0:
            if self.log_wealth(hi, ds) < level:
                return hi
            if self.log_wealth(lo + 1e-12, ds) >= level:
                return lo
            for _ in range(60):  # K+ grows with m: reject above the root
                mid = 0.5 * (lo + hi)
                lo, hi = (lo, mid) if self.log_wealth(mid, ds) >= level else (mid, hi)
            return hi
        if self.log_wealth(lo, ds) < level:
            return lo
        if self.log_wealth(hi - 1e-12, ds) >= level:
            return hi
        for _ in range(60):  # K- falls with m: reject below the root
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if self.log_wealth(mid, ds) >= level else (lo, mid)
        return lo


class Sequential:
    """The rule's state, updated cluster by cluster: ``update(d)`` (or ``observe(pairs)``) and then ``decision``.

    ``test``: non_inferiority (one-sided, PASS when the upper bound is <= margin, FAIL when the lower is > margin)
    or equivalence (two one-sided, each at alpha). ``margin`` > 0: margin 0 asks for identical outcomes or for
    improvements, which no bet on a loss of exactly 0 can show (use the fixed battery there).
    """

    def __init__(self, test: str, margin: float, alpha: float = 0.05, budget: Budget | None = None,
                 battery_cases: int | None = None, unit: str = "cases"):
        if test not in TESTS:
            raise ValueError(f"test must be one of {TESTS}, got {test!r}")
        if not 0.0 < alpha < 0.5:
            raise ValueError(f"alpha must lie in (0, 0.5), got {alpha}")
        if not 0.0 < margin < 1.0:
            raise ValueError(f"margin must lie in (0, 1) for a sequential rule, got {margin}")
        self.test, self.margin, self.alpha = test, margin, alpha
        self.budget, self.battery_cases, self.unit = budget, battery_cases, unit
        self.level = math.log(1.0 / alpha)
        m = margin
        if test == "non_inferiority":  # each side decides at +margin only
            self.upper = _Side(+1, m, CAP / (1.0 - m), (m,))
            self.lower = _Side(-1, m, CAP / (1.0 + m), (m,))
        else:  # the upper side decides at +margin (PASS) and -margin (FAIL: a gain beyond it); the lower mirrors it
            self.upper = _Side(+1, m, CAP / (1.0 + m), (m, -m))
            self.lower = _Side(-1, -m, CAP / (1.0 + m), (-m, m))
        self.ds: list[float] = []
        self._sum = 0.0  # of the observations (the prior pseudo-case adds 0)
        self._sq = PRIOR_VAR  # of squared deviations from the mean before each one, with the prior's variance
        self.pairs = self.harmful = self.beneficial = self.cases = 0
        self.stopped: Stop | None = None
        self.seconds: float | None = None

    # --- updating -------------------------------------------------------------------------------------

    def update(self, d: float, cases: int = 1) -> Decision:
        """One cluster's loss d in [-1, 1] (``cases`` of the battery's cases); the decision after it."""
        self.cases += cases
        if not -1.0 <= d <= 1.0:
            raise ValueError(f"a cluster's loss lies in [-1, 1], got {d}")
        t = len(self.ds) + 1  # the prior counts as one observation
        mean, var = self._sum / t, self._sq / t
        for side in (self.upper, self.lower):
            side.update(d, side.bet(mean, var))
        self._sq += (d - mean) ** 2
        self._sum += d
        self.ds.append(d)
        return self.decision

    def observe(self, pairs: Iterable[Pair], cases: int = 1) -> Decision:
        """One cluster's outcome pairs (``cases`` of the battery's cases); a cluster without pairs changes nothing."""
        found = case_loss(pairs)
        if found is None:
            self.cases += cases
            return self.decision
        d, n, b, c = found
        self.pairs, self.harmful, self.beneficial = self.pairs + n, self.harmful + b, self.beneficial + c
        return self.update(d, cases)

    def stop(self, why: Stop, seconds: float | None = None) -> None:
        self.stopped, self.seconds = why, seconds

    # --- reading --------------------------------------------------------------------------------------

    def _rejects(self, side: _Side, threshold: float) -> bool:
        return side.log_k[side.thresholds.index(threshold)] >= self.level

    @property
    def decision(self) -> Decision:
        m = self.margin
        if self.test == "non_inferiority":
            if self._rejects(self.lower, m):  # L > margin (FAIL first: both at once means the sequence missed)
                return "fail"
            return "pass" if self._rejects(self.upper, m) else "continue"
        if self._rejects(self.lower, m) or self._rejects(self.upper, -m):
            return "fail"
        return "pass" if self._rejects(self.upper, m) and self._rejects(self.lower, -m) else "continue"

    def bounds(self) -> tuple[float, float]:
        """(lower, upper): the confidence sequence now, each end at 1 - alpha."""
        return self.lower.bound(self.level, self.ds), self.upper.bound(self.level, self.ds)

    @property
    def loss(self) -> float:
        """The mean loss per cluster so far."""
        return self._sum / len(self.ds) if self.ds else 0.0

    def method(self) -> str:
        return (f"betting confidence sequence (Waudby-Smith & Ramdas 2023), aGRAPA bets capped at {CAP:g} of the "
                f"largest safe bet, one-sided alpha {self.alpha:g} each side, looked at after every {self.unit[:-1]}")

    def reason(self) -> str:
        """One line: what the rule decided, on how much, and why it stopped."""
        lower, upper = self.bounds()
        pct, m = f"{100.0 * (1.0 - self.alpha):.4g}%", self.margin
        of = f" of {self.battery_cases}" if self.battery_cases is not None else ""
        order = f" in a random order (seed {self.budget.seed})" if self.budget else ""
        clusters = f", {len(self.ds)} {self.unit}" if len(self.ds) != self.cases else ""
        counts = (f"sequential: {self.cases}{of} cases run{order}{clusters}; loss per case {self.loss:.3f} "
                  f"({self.harmful} harmful, {self.beneficial} beneficial flips of {self.pairs} assertions)")
        rule = "anytime-valid betting confidence sequence"
        decision = self.decision
        if self.test == "equivalence":
            ends = f"{rule}, one-sided {pct} bounds [{lower:.3f}, {upper:.3f}]"
            if decision == "pass":
                return f"equivalent: {counts}; {ends} within +-{m:g}"
            if decision == "fail":
                return f"not_equivalent: {counts}; {ends} lie outside +-{m:g}"
            short = f"bounds [{lower:.3f}, {upper:.3f}] not within +-{m:g}"
        else:
            if decision == "pass":
                return f"non_inferior: {counts}; {rule}, one-sided {pct} upper bound {upper:.3f} <= margin {m:g}"
            if decision == "fail":
                return f"inferior: {counts}; {rule}, one-sided {pct} lower bound {lower:.3f} > margin {m:g}"
            short = f"upper bound {upper:.3f} > margin {m:g}"
        if self.stopped in ("max_cases", "max_seconds") and self.budget is not None:
            spent = f" ({self.seconds:.1f} s spent)" if self.stopped == "max_seconds" and self.seconds is not None else ""
            option = (f"--max-cases {self.budget.max_cases}" if self.stopped == "max_cases"
                      else f"--max-seconds {self.budget.max_seconds:g}{spent}")
            return (f"underpowered: {counts}: the budget {option} was reached before the rule decided; {short} "
                    f"({rule}); raise {option.split()[0]} or widen the margin")
        return (f"underpowered: {counts}: the battery ran out before the rule decided; {short} ({rule}); add cases "
                "or widen the margin")

    def to_dict(self) -> SequentialSummary:
        lower, upper = self.bounds()
        b = self.budget
        return {
            "rule": RULE, "test": self.test, "method": self.method(),
            "alpha": self.alpha, "margin": self.margin, "cap": CAP, "prior_variance": PRIOR_VAR,
            "seed": b.seed if b else None, "max_cases": b.max_cases if b else None,
            "max_seconds": b.max_seconds if b else None,
            "battery_cases": self.battery_cases, "cases": self.cases, "clusters": len(self.ds), "unit": self.unit,
            "pairs": self.pairs, "harmful": self.harmful, "beneficial": self.beneficial,
            "loss": self.loss, "lower": lower, "upper": upper,
            "decision": self.decision, "stopped": self.stopped, "seconds": self.seconds, "reason": self.reason(),
        }
