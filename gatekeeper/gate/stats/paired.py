"""Paired verdicts for changes that are not meant to be exact: how much pass rate may the flag cost?

A battery is run twice, flag off and flag on; each assertion on each case gives a *pair* of outcomes,
``(cluster, off, on)``. Of n pairs, b are harmful flips (off passes, on fails) and c beneficial flips
(off fails, on passes); the loss is the drop in pass rate, delta = (b - c) / n.

Counting lost assertions against a fixed margin PASSes on almost no evidence (a 20-case battery with no
flips says little about a 5% loss). This module bounds the loss instead, with a one-sided confidence bound,
and decides:

* PASS when the upper bound on the loss is <= the margin (the loss is shown to be small);
* FAIL when the lower bound is > the margin (the loss is shown to be too large);
* otherwise *underpowered*: the battery cannot tell, and the verdict says how many pairs it would need.

The interval is Tango's score interval for a difference of paired proportions (Tango 1998, Stat Med
17:891; compared with other intervals by Newcombe 1998, Stat Med 17:2635, and by Fagerland, Lydersen &
Laake 2014, Stat Med 33:2850, who recommend it): it keeps close to its level at small n, never collapses to zero width
(with no discordant pairs at all its upper bound is z^2 / (n + z^2), not 0 as Wald's is), and it is the
inversion of the same score statistic a non-inferiority test uses, so the bound and the test agree.

Assertions of one case (and turns of one conversation) fail together, so they are not n independent
observations. Pairs carry a cluster (by default the case id); with fewer clusters than pairs the counts
are deflated by a Rao-Scott design effect, taken at its worst case, before the interval is computed (see
``_design_effect``).

Standard library only (and the summaries it returns): this is imported by the gate (``kinds.py``) on every evaluation.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from statistics import NormalDist

from ...summaries import Flips, PairedSummary, SuitesSummary

# (cluster, off passed, on passed): the same assertion on the same case with the flag off and on.
Pair = tuple[str, bool, bool]

_STANDARD = NormalDist()


def _z(p: float) -> float:
    """The standard normal quantile at p."""
    return _STANDARD.inv_cdf(p)


def _check_alpha(alpha: float) -> None:
    if not 0.0 < alpha < 0.5:
        raise ValueError(f"alpha must lie in (0, 0.5), got {alpha}")


# --- Tango's score interval -----------------------------------------------------------------------------


def _restricted_p21(b: float, c: float, n: float, delta: float) -> float:
    """Tango's restricted MLE of the beneficial-cell probability p21 given delta = p12 - p21.

    Maximizing the multinomial likelihood under the constraint gives 2n p^2 + B p + C = 0 with
    B = -b - c + (2n - b + c) delta and C = -c delta (1 - delta); the larger root is the estimate.
    """
    a = 2.0 * n
    bq = -b - c + (2.0 * n - b + c) * delta
    cq = -c * delta * (1.0 - delta)
    disc = max(bq * bq - 4.0 * a * cq, 0.0)
    return (math.sqrt(disc) - bq) / (2.0 * a)


def _score_parts(b: float, c: float, n: float, delta: float) -> tuple[float, float]:
    """Numerator and standard deviation of Tango's score statistic T(delta) = num / sd.

    Kept apart so the bisection compares num against z * sd and never divides by a zero sd (which happens
    at delta = 0 with no discordant pairs, and at delta = +-1).
    """
    p21 = _restricted_p21(b, c, n, delta)
    var = n * (2.0 * p21 + delta * (1.0 - delta))
    return b - c - n * delta, math.sqrt(max(var, 0.0))


def tango_bounds(b: float, c: float, n: float, alpha: float = 0.05) -> tuple[float, float]:
    """One-sided (lower, upper) confidence bounds, each at level 1 - alpha, on delta = (p12 - p21).

    Tango's score interval: the bounds are the two deltas where the score statistic equals -+z_{1-alpha}.
    T(delta) decreases in delta, so each is found by bisection on a bracket that contains it: the upper
    bound between the estimate and 1, the lower between -1 and the estimate. Counts may be fractional (after a
    design-effect deflation). For a two-sided 95% interval pass alpha = 0.025.
    """
    _check_alpha(alpha)
    if n <= 0:
        return -1.0, 1.0
    z = _z(1.0 - alpha)
    est = (b - c) / n

    def above_lower(delta: float) -> bool:  # T(delta) > z: delta lies below the lower bound
        num, sd = _score_parts(b, c, n, delta)
        return num - z * sd > 0.0

    def below_upper(delta: float) -> bool:  # T(delta) >= -z: delta lies at or below the upper bound
        num, sd = _score_parts(b, c, n, delta)
        return num + z * sd >= 0.0

    lo, hi = est, 1.0
    if below_upper(hi):
        upper = 1.0
    else:
        for _ in range(64):
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if below_upper(mid) else (lo, mid)
        upper = hi
    lo, hi = -1.0, est
    if not above_lower(lo):
        lower = -1.0
    else:
        for _ in range(64):
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if above_lower(mid) else (lo, mid)
        lower = lo
    return lower, upper


# --- sample size ----------------------------------------------------------------------------------------


def _needed_exact(discordance: float, margin: float, alpha: float, power: float, loss: float) -> float:
    """Pairs needed, before rounding up (see ``cases_needed``)."""
    if margin <= loss:
        return math.inf
    psi = discordance
    if not abs(loss) <= psi <= 1.0:
        raise ValueError(f"discordance {psi} must lie in [|loss|, 1] (loss {loss})")
    # Expected cell rates of a change with this loss and discordance; the score test's variance is Tango's
    # restricted one at delta = margin (for these expected rates), the alternative's is psi - loss^2.
    p12, p21 = (psi + loss) / 2.0, (psi - loss) / 2.0
    v0 = 2.0 * _restricted_p21(p12, p21, 1.0, margin) + margin * (1.0 - margin)
    v1 = psi - loss * loss
    za, zb = _z(1.0 - alpha), _z(power)
    return (za * math.sqrt(v0) + zb * math.sqrt(v1)) ** 2 / (margin - loss) ** 2


def cases_needed(discordance: float, margin: float, alpha: float = 0.05, power: float = 0.8, loss: float = 0.0) -> float:
    """Pairs a change with true loss ``loss`` at discordance ``psi = (b + c) / n`` needs to PASS with probability ``power``.

    Nam's (1997, Biometrics 53:1422) sample size for the score test Tango's interval inverts:
    n = (z_{1-alpha} sqrt(v0) + z_power sqrt(psi - loss^2))^2 / (margin - loss)^2, v0 being the restricted
    variance at delta = margin. The simpler (z_{1-alpha} + z_power)^2 (psi - loss^2) / (margin - loss)^2
    (464 at psi 0.03, margin 0.02) takes v0 = psi - loss^2, but the score test judges the bound with the
    larger variance at the margin, so it promises more power than the test has (about 0.73 instead of 0.8 at
    464; this gives 558, which simulates at about 0.8). At psi = 0 the formula reduces to the zero-discordance minimum
    z^2 (1 - margin) / margin (the n at which z^2 / (n + z^2) = margin); it is never fewer.

    Returns a whole number of pairs (rounded up), or ``math.inf`` when margin <= loss: no n makes a change
    whose true loss reaches the margin pass more often than alpha.
    """
    _check_alpha(alpha)
    n = _needed_exact(discordance, margin, alpha, power, loss)
    if math.isinf(n):
        return math.inf
    floor = _z(1.0 - alpha) ** 2 * (1.0 - margin) / margin
    return float(math.ceil(max(n, floor) - 1e-9))


def supported_margin(n: float, discordance: float, alpha: float = 0.05, power: float = 0.8) -> float:
    """The smallest margin n pairs support at this discordance: the loss a harmless change could be shown below.

    Inverts ``cases_needed`` (both its formula and its zero-discordance floor) by bisection on the margin.
    Returns 1.0 when n < 1 (no evidence supports any margin below a total loss).
    """
    _check_alpha(alpha)
    if n < 1:
        return 1.0
    z = _z(1.0 - alpha)
    floor = z * z / (n + z * z)  # the zero-discordance minimum, inverted
    lo, hi = 1e-9, 1.0
    for _ in range(64):
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if _needed_exact(discordance, mid, alpha, power, 0.0) <= n else (mid, hi)
    return max(hi, floor)


# --- clusters -------------------------------------------------------------------------------------------


@dataclass
class _Tally:
    n: int
    harmful: int
    beneficial: int
    sizes: list[int]  # pairs per cluster


def _tally(pairs: Iterable[Pair]) -> _Tally:
    sizes: dict[str, int] = {}
    b = c = 0
    for cluster, off, on in pairs:
        d = int(bool(off)) - int(bool(on))  # +1 harmful, -1 beneficial, 0 concordant
        b += d == 1
        c += d == -1
        sizes[cluster] = sizes.get(cluster, 0) + 1
    return _Tally(sum(sizes.values()), b, c, list(sizes.values()))


def flip_counts(pairs: Iterable[Pair]) -> Flips:
    """The assertion outcome pairs and their flips, for a kind that reports them beside another verdict (byte equivalence)."""
    t = _tally(pairs)
    return Flips(pairs=t.n, harmful=t.harmful, beneficial=t.beneficial)


def _design_effect(t: _Tally) -> float:
    """The design effect the counts are deflated by (Rao-Scott): the worst case, perfectly correlated clusters.

    That is sum_j m_j^2 / n (m_j: cluster j's pairs), n / k for k equal clusters: one observation per cluster, 1 with
    one pair per cluster. For pairs that share their cell probabilities (the model the interval assumes) no dependence
    within a case makes the loss estimate vary more than this, so nothing is estimated from few clusters; it depends on the
    cluster sizes alone, never on where the flips fell, so one more harmful flip only raises the bound (an estimated,
    cluster-robust design effect falls when a flip lands in a case of its own, which let a harmful flip turn
    INCONCLUSIVE into PASS). The price is power: a battery weighs as many observations as it has cases, which is what
    "add cases, not assertions" (docs/verdicts.md) asks of it anyway.
    """
    return sum(m * m for m in t.sizes) / t.n if t.n else 1.0


# --- verdicts -------------------------------------------------------------------------------------------


def _pct(alpha: float) -> str:
    return f"{100.0 * (1.0 - alpha):.4g}%"


def _needs(needed: float) -> str:
    return "no finite number of pairs" if math.isinf(needed) else f"{int(needed)}"


@dataclass
class Paired:
    """A paired verdict: the loss in pass rate with the flag on, its confidence bounds, and what they decide."""

    test: str  # non_inferiority | equivalence | exact
    n: int  # assertion pairs
    clusters: int  # independence units (cases, by default)
    harmful: int  # off pass, on fail
    beneficial: int  # off fail, on pass
    loss: float  # (harmful - beneficial) / n: the drop in pass rate
    lower: float  # one-sided 1 - alpha lower bound on the loss
    upper: float  # one-sided 1 - alpha upper bound on the loss
    deff: float  # Rao-Scott design effect the counts were deflated by (the worst case for these cluster sizes)
    method: str
    margin: float
    alpha: float
    power: float
    verdict: str  # pass | fail | underpowered
    needed: float  # pairs the margin needs at the observed discordance and this design effect (inf: none)
    supported_margin: float  # the smallest margin these pairs support at the observed discordance
    unit: str = "cases"

    def to_dict(self) -> PairedSummary:
        return PairedSummary(
            test=self.test, n=self.n, clusters=self.clusters, harmful=self.harmful, beneficial=self.beneficial,
            loss=self.loss, lower=self.lower, upper=self.upper, deff=self.deff, method=self.method, margin=self.margin,
            alpha=self.alpha, power=self.power, verdict=self.verdict,
            needed=None if math.isinf(self.needed) else int(self.needed),  # JSON has no infinity
            supported_margin=self.supported_margin, unit=self.unit, reason=self.reason())

    def _counts(self) -> str:
        return (
            f"loss {self.loss:.3f} ({self.harmful} harmful, {self.beneficial} beneficial flips of {self.n} assertions "
            f"in {self.clusters} {self.unit})"
        )

    def _short_method(self) -> str:
        extra = f", design effect {self.deff:.2f}" if self.deff > 1.0 else ""
        return f"Tango score interval{extra}"

    def reason(self) -> str:
        """One line saying what was decided and why."""
        m, pct = self.margin, _pct(self.alpha)
        if self.test == "exact":
            return f"exact: margin 0 asks for identical outcomes; {self.harmful} harmful, {self.beneficial} beneficial flips of {self.n} assertions"
        if self.test == "equivalence":
            bounds = f"one-sided {pct} bounds [{self.lower:.3f}, {self.upper:.3f}]"
            if self.verdict == "pass":
                return f"equivalent: {self._counts()}; {bounds} within +-{m:g} ({self._short_method()})"
            if self.verdict == "fail":
                return f"not_equivalent: {self._counts()}; {bounds} lie outside +-{m:g} ({self._short_method()})"
            return (
                f"underpowered: {bounds} not within +-{m:g} with {self.n} assertion pairs; at the observed discordance "
                f"the margin needs {_needs(self.needed)}; add cases or widen the margin"
            )
        if self.verdict == "pass":
            return f"non_inferior: {self._counts()}; one-sided {pct} upper bound {self.upper:.3f} <= margin {m:g} ({self._short_method()})"
        if self.verdict == "fail":
            return f"inferior: {self._counts()}; one-sided {pct} lower bound {self.lower:.3f} > margin {m:g} ({self._short_method()})"
        line = (
            f"underpowered: upper bound {self.upper:.3f} > margin {m:g} with {self.n} assertion pairs; at the observed "
            f"discordance the margin needs {_needs(self.needed)}"
        )
        if m <= 0:
            return line + "; margin 0 needs improvements to pass: beneficial flips must outweigh harmful ones"
        return line + f" (these pairs support a margin of {self.supported_margin:.3f}); add cases or widen the margin"


def _method(alpha: float, deff: float, t: _Tally) -> str:
    text = f"Tango score interval, one-sided alpha {alpha:.4g}"
    if len(t.sizes) < t.n:
        text += f", Rao-Scott design effect {deff:.2f} over {len(t.sizes)} clusters (worst case)"
    return text


def _decide(
    t: _Tally,
    margin: float,
    alpha: float,
    power: float,
    *,
    deff: float | None = None,
    equivalence: bool = False,
    unit: str = "cases",
) -> Paired:
    """The verdict from a tally; ``deff`` overrides the estimated design effect (tests force 1 to show why it matters)."""
    _check_alpha(alpha)
    if margin < 0:
        raise ValueError(f"margin must be >= 0, got {margin}")
    n, b, c = t.n, t.harmful, t.beneficial
    e = _design_effect(t) if deff is None else deff
    lower, upper = tango_bounds(b / e, c / e, n / e, alpha)
    loss = (b - c) / n if n else 0.0
    psi = (b + c) / n if n else 0.0
    # TOST with a true loss of 0 must clear both bounds: the power of each one-sided test is (1 + power) / 2.
    p = (1.0 + power) / 2.0 if equivalence else power
    needed = cases_needed(psi, margin, alpha, p) * e if margin > 0 else math.inf
    if not math.isinf(needed):
        needed = float(math.ceil(needed - 1e-9))
    if equivalence:
        verdict = (
            "pass" if -margin <= lower and upper <= margin else "fail" if lower > margin or upper < -margin else "underpowered"
        )
    else:
        verdict = "pass" if upper <= margin else "fail" if lower > margin else "underpowered"
    return Paired(
        test="equivalence" if equivalence else "non_inferiority",
        n=n,
        clusters=len(t.sizes),
        harmful=b,
        beneficial=c,
        loss=loss,
        lower=lower,
        upper=upper,
        deff=e,
        method=_method(alpha, e, t),
        margin=margin,
        alpha=alpha,
        power=power,
        verdict=verdict,
        needed=needed,
        supported_margin=supported_margin(n / e, psi, alpha, p),
        unit=unit,
    )


def decide(pairs: Iterable[Pair], margin: float, alpha: float = 0.05, power: float = 0.8, *, unit: str = "cases") -> Paired:
    """Non-inferiority: PASS when the one-sided upper bound on the loss is <= margin, FAIL when the lower bound is > margin.

    ``unit`` names the clusters in the reason (cases, conversations, ...). At margin 0 a PASS needs beneficial flips to
    outweigh harmful ones enough that the upper bound is <= 0; ``needed`` is then infinite.
    """
    return _decide(_tally(pairs), margin, alpha, power, unit=unit)


def equivalence(pairs: Iterable[Pair], margin: float, alpha: float = 0.05, power: float = 0.8, *, unit: str = "cases") -> Paired:
    """Two one-sided tests: PASS when lower >= -margin and upper <= margin, FAIL when the bounds lie wholly outside.

    Margin 0 is not a statistical test (no interval lies within [0, 0]): it asks for identical outcomes, and
    passes iff there is not a single flip either way.
    """
    t = _tally(pairs)
    if margin > 0:
        return _decide(t, margin, alpha, power, equivalence=True, unit=unit)
    loss = (t.harmful - t.beneficial) / t.n if t.n else 0.0
    same = t.harmful == t.beneficial == 0
    return Paired(
        test="exact",
        n=t.n,
        clusters=len(t.sizes),
        harmful=t.harmful,
        beneficial=t.beneficial,
        loss=loss,
        lower=loss,
        upper=loss,
        deff=1.0,
        method="exact equality (margin 0)",
        margin=0.0,
        alpha=alpha,
        power=power,
        verdict="pass" if same else "fail",
        needed=math.inf,
        supported_margin=0.0,
        unit=unit,
    )


@dataclass
class Suites:
    """Per-suite non-inferiority verdicts under a Bonferroni correction."""

    verdict: str  # pass (all pass) | fail (any fails) | underpowered
    alpha: float  # the family-wise alpha asked for
    corrected_alpha: float  # alpha / k, what each suite was judged at
    suites: dict[str, Paired] = field(default_factory=dict)
    unjudged: list[str] = field(default_factory=list)  # suites with pairs but no margin

    def to_dict(self) -> SuitesSummary:
        return SuitesSummary(verdict=self.verdict, alpha=self.alpha, corrected_alpha=self.corrected_alpha,
                             suites={name: p.to_dict() for name, p in self.suites.items()}, unjudged=list(self.unjudged))

    def reason(self) -> str:
        k = len(self.suites)
        head = f"{self.verdict}: {k} suite(s) at Bonferroni alpha {self.alpha:g}/{k} = {self.corrected_alpha:.4g}"
        return "; ".join([head] + [f"{name}: {p.reason()}" for name, p in self.suites.items()])


def by_suite(
    pairs_by_suite: Mapping[str, Sequence[Pair]], margins: Mapping[str, float], alpha: float = 0.05, power: float = 0.8
) -> Suites:
    """``decide`` per suite with a margin, each at alpha / k (Bonferroni over the k suites judged).

    PASS only if every suite passes, FAIL if any fails, else underpowered (also when no suite has a margin).
    A suite with a margin and no pairs is underpowered, never skipped.
    """
    _check_alpha(alpha)
    names = sorted(margins)
    k = len(names)
    corrected = alpha / k if k else alpha
    suites = {name: decide(pairs_by_suite.get(name, ()), margins[name], corrected, power) for name in names}
    verdicts = {p.verdict for p in suites.values()}
    verdict = "fail" if "fail" in verdicts else "pass" if verdicts == {"pass"} else "underpowered"
    return Suites(verdict, alpha, corrected, suites, sorted(set(pairs_by_suite) - set(margins)))
