"""What paired draws certify under sampled decoding.

Both sides draw each token with the same keyed noise (``engines/sampler.py``), so until their answers part they read
the same history: every such step is a coupled step. At a coupled step, given that history, the chance the two drawn
tokens differ is at least the total-variation distance between the two sides' next-token distributions there (under
any coupling, P(tokens differ) >= TV). The walk stops at an answer's first mismatch, so a step late in an answer is
compared only where every earlier one matched: the share of all coupled steps that mismatch bounds the average TV
over the steps compared, weighted toward early positions, and a defect late in answers or in one stage hides in it
(TV 0.3 at every position from 32 on read as at most 0.03 in ``tests/test_statistics_tv.py``).

So the bound a verdict uses is per class of steps: per position class (the thirds of the flag-off answers' token
positions, each turn counted from 0: read from where those answers end, never from where the sides part) and, where
the sampled suites span two stages or more, per stage. A class's bound is Clopper-Pearson's on its mismatches over its
coupled steps at alpha/m, Bonferroni over the m classes reported: an upper bound on the mean, over the steps compared
in that class, of the chance the draws differ there given that every earlier step of the answer matched, and so on the
mean TV there; ``tv_bound`` is the largest class bound, so all hold together at 1 - alpha. The pooled figure stays as
``tv_mean_bound`` (at alpha): a bound on the average over all compared steps, not on any one position. With no
mismatch a bound is 1 - a^(1/n), which holds however the steps depend on each other (the chance of n clean steps is a
product of per-step chances, at most (1 - mean)^n).

Not covered: steps after a parting are never compared (the histories differ; forcing the flag-off token into the
flag-on side would extend the walk past it, which is not done), so a class the walks rarely reach has a wide bound,
and a defect confined to some cases of a stage and position class is averaged with that class's other steps.

On the coupled steps each side also recorded the log-probability its raw and its processed distribution gave the
token drawn. The same raw figure with another processed one means the sampler read other state (a penalty's
history, a filter's order) though the model computed the same: a sampler-state defect, named as one.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, cast

from ...battery.suites import Item
from ...engines import sampler
from ...evidence import Ruling, Run
from ...summaries import Coupling, SamplerChain, TVClass

KEPT = 5  # sampler-state positions kept in the record (the count holds them all)
PROCESSED = 1e-6  # processed log-probabilities further apart than this, from equal raw ones, part
THIRDS = 3  # position classes: the flag-off answers' token positions in thirds


@dataclass
class Coupled:
    """The coupled steps of one evaluation's sampled cases, flag off against on (first runs)."""

    decoding: dict[str, str]  # suite -> its decoding in one line
    answers: int  # sampled answers compared (cases times samples)
    chain: SamplerChain | None = None  # the flag-on engine's sampler: its chain, penalty windows and draw
    steps: int = 0  # generated positions both sides drew from the same history
    mismatches: int = 0  # of those, where they drew different tokens or one stopped (at most one per answer: they part)
    alpha: float = 0.05
    # per-step TV averaged within each class (position class, stage) at most this: the largest class bound, all at
    # 1 - alpha together
    tv_bound: float = 1.0
    sampler_state: int = 0  # coupled steps with equal raw and different processed log-probabilities
    where: list[str] = field(default_factory=list)  # the first KEPT of them
    bound: str = "Clopper-Pearson"  # or "confidence sequence": valid at whatever step a sequential run stopped
    tv_mean_bound: float = 1.0  # the average of per-step TV over all compared steps (early-weighted), at most this
    edges: list[int] = field(default_factory=list)  # the position classes: [0, e1), [e1, e2), [e2, ...)
    classes: list[TVClass] = field(default_factory=list)  # each: class, steps, mismatches, answers, bound
    tally: dict[str, list[int]] = field(default_factory=dict, repr=False)  # class -> [steps, mismatches, answers]

    def upper(self, k: int, n: int, alpha: float | None = None) -> float:
        return (upper_anytime if self.bound == "confidence sequence" else upper)(k, n, self.alpha if alpha is None else alpha)

    def position(self, j: int) -> str:
        """The position class of a turn's ``j``-th generated token (0-based)."""
        lo = max([0] + [e for e in self.edges if e <= j])
        hi = min([e for e in self.edges if e > j], default=None)
        return f"position {lo}-{hi - 1}" if hi is not None else f"position {lo}+"

    def count(self, j: int, stage: str | None, parted: bool) -> None:
        """One coupled step at position ``j`` of an answer of ``stage`` (None: no stage class)."""
        self.steps += 1
        self.mismatches += parted
        for name in (self.position(j), None if stage is None else f"stage {stage}"):
            if name is not None:
                t = self.tally.setdefault(name, [0, 0, 0])
                t[0] += 1
                t[1] += parted

    def finish(self) -> None:
        """Each class's bound at alpha/m (Bonferroni over the m classes), the largest as ``tv_bound``, and the
        pooled ``tv_mean_bound`` at alpha."""
        for name, t in self.tally.items():
            if name.startswith("position "):
                t[2] = self.answers  # any answer may reach any position; a stage's answers are counted as walked
        m = len(self.tally)
        self.classes = [{"class": name, "steps": n, "mismatches": k, "answers": a, "bound": self.upper(k, n, self.alpha / m)}
                        for name, (n, k, a) in self.tally.items()]
        self.tv_mean_bound = self.upper(self.mismatches, self.steps)
        self.tv_bound = max((c["bound"] for c in self.classes), default=self.tv_mean_bound)

    def line(self) -> str:
        m = len(self.classes)
        by = "; ".join(f"{c['class']} {c['bound']:.3g} ({c['mismatches']} of {c['steps']})" for c in self.classes)
        return (f"sampled: {'; '.join(f'{s}: {d}' for s, d in self.decoding.items())}; {self.answers} answers paired "
                f"by seed, {self.steps} coupled steps, {self.mismatches} mismatched: per-step total variation, averaged within "
                f"each position class and stage, at most {self.tv_bound:.3g} ({1 - self.alpha:.0%} {self.bound}); by "
                f"class, each at alpha/{m}: {by}; averaged over all compared steps at most {self.tv_mean_bound:.3g} (early "
                "steps weigh most: a walk reaches a late step only where every earlier one matched, and stops at a parting)")

    def reasons(self) -> list[str]:
        if not self.sampler_state:
            return []
        return [f"sampler_state: at {self.sampler_state} coupled steps both sides computed the same raw log-probability "
                f"and their samplers weighed it differently ({', '.join(self.where)}): the flag-on sampler reads other "
                "state (a penalty's history, a filter), though the model computed the same"]

    def judge(self, verdict: str | None, ignored: list[str], max_tv: float | None = None) -> Ruling:
        """What the draws show: draws that do not follow their keys void the pairing (INCONCLUSIVE); a sampler-state
        defect is a FAIL; a PASS whose bound (the largest class bound) exceeds ``max_tv`` (the policy's) is
        INCONCLUSIVE with the steps it needs; either way the coupling line."""
        if ignored:
            return Ruling("INCONCLUSIVE", ignored, [self.line()])
        if self.sampler_state:
            return Ruling("FAIL", self.reasons(), [self.line()])
        if verdict == "PASS" and max_tv is not None and self.tv_bound > max_tv:
            return Ruling("INCONCLUSIVE", [self.short_of(max_tv)], [self.line()])
        return Ruling(notes=[self.line()])

    def short_of(self, max_tv: float) -> str:
        """``tv_bound:`` why the coupled steps cannot yet show a distance within ``max_tv`` in every class, and what
        would: the class that needs the most."""
        m = max(1, len(self.classes))
        over = [c for c in self.classes if c["bound"] > max_tv]
        if not over:  # no class recorded (nothing walked): the pooled figure is all there is
            over = [{"class": "all compared steps", "steps": self.steps, "mismatches": self.mismatches,
                     "answers": self.answers, "bound": self.tv_bound}]
        worst = max(over, key=lambda c: c["bound"])
        head = (f"tv_bound: {worst['steps']} coupled steps in {worst['class']} ({worst['mismatches']} mismatched) bound "
                f"its mean per-step total variation at {worst['bound']:.3g}, above the policy's max_tv {max_tv:g}"
                + (f" ({len(over)} of {m} classes above it)" if len(over) > 1 else ""))
        a = self.alpha / m
        needs = []
        for c in over:
            rate = c["mismatches"] / c["steps"] if c["steps"] else None
            needed = None if rate is None else steps_needed(rate, max_tv, a, self.bound == "confidence sequence")
            if needed is None:
                why = ("no coupled walk reached it (the sides parted before)" if rate is None else
                       f"the sides part at {rate:.3g} of its coupled steps")
                return (f"{head}; in {c['class']} {why}, so no number of samples brings its bound under it (the "
                        "coupling may part more often than the distributions differ: judge the change by its pass "
                        "rates, or raise max_tv)")
            needs.append((needed / c["steps"], needed, c))
        _, needed, c = max(needs, key=lambda x: x[0])
        more = math.ceil(self.answers * needed / c["steps"]) if self.answers else needed
        return (f"{head}; at its mismatch rate it needs about {needed} coupled steps in {c['class']} (each class at "
                f"alpha/{m}), {more} sampled answers ({more - self.answers} more): raise the suite's samples")

    def to_dict(self) -> Coupling:
        out = asdict(self)
        del out["tally"]
        return cast(Coupling, out)


def couple(items: Iterable[Item], off: Run, on: Run, alpha: float, chain: SamplerChain | None,
           anytime: bool = False) -> Coupled | None:
    """The coupled steps of the sampled cases both sides answered, with each class's bound; None where no suite
    samples. ``anytime``: the run stopped when its data said (sequential), so the bounds must hold at every stop
    (``upper_anytime``)."""
    sampled = [i for i in items if not i.suite.decoding.plain]
    if not sampled:
        return None
    c = Coupled({i.suite.suite: sampler.describe(i.suite.decoding) for i in sampled}, 0, chain, alpha=alpha,
                bound="confidence sequence" if anytime else "Clopper-Pearson")
    both = [(i, off[i.case_id], on[i.case_id]) for i in sampled if i.case_id in off and i.case_id in on
            and "crash" not in off[i.case_id] and "crash" not in on[i.case_id]]
    c.edges = thirds([len(t["tokens"]) for _, a, _ in both for t in a["turns"]])
    c.tally = {c.position(e): [0, 0, 0] for e in [0] + c.edges}  # every position class, in order, walked or not
    staged = len({i.suite.stage for i in sampled}) > 1  # one stage: its class would be the pooled figure
    for item, a, b in both:
        c.answers += 1
        stage = item.suite.stage if staged else None
        if stage is not None:
            c.tally.setdefault(f"stage {stage}", [0, 0, 0])[2] += 1
        for n, (ta, tb) in enumerate(zip(a["turns"], b["turns"]), 1):
            parted = _walk(c, f"{item.case_id} turn {n}", ta, tb, stage)
            if parted:  # the next turn's prompt holds this turn's answer: no longer one history
                break
    c.finish()
    return c


def thirds(lengths: list[int], parts: int = THIRDS) -> list[int]:
    """The edges splitting the token positions of answers of these ``lengths`` (each counted from 0) into ``parts``
    classes holding about as many positions each: the i-th edge is the smallest p with at least i/parts of all the
    positions below it. Edges that would repeat, or leave the last class no position, are dropped."""
    total, longest = sum(lengths), max(lengths, default=0)
    ending = [0] * (longest + 1)  # ending[j]: answers of length j
    for n in lengths:
        ending[n] += 1
    edges: list[int] = []
    below, longer, i = 0, len(lengths), 1  # below: positions under p; longer: answers holding p - 1
    for p in range(1, longest):
        longer -= ending[p - 1]
        below += longer
        while i < parts and below * parts >= total * i:
            if not edges or edges[-1] < p:
                edges.append(p)
            i += 1
    return edges


def ignored(items: Iterable[Item], results: dict[str, list[Run]], alpha: float) -> list[str]:
    """``seeds_ignored:`` for each side whose samples of a case, drawn under different keys, came out identical
    where the declared decoding gives that a chance below ``alpha`` (Bonferroni over the cases): given the first
    sample's tokens s, the other k - 1 draw them all with chance prod_j p(s_j)^(k-1), p the declared decoding's
    probability of each token drawn (the draws' processed weight), so the test holds at alpha whatever s was."""
    cases: dict[str, list[Item]] = {}
    for item in items:
        if item.suite.decoding.samples > 1:
            cases.setdefault(item.case_key, []).append(item)
    out = []
    for config in ("off", "on"):
        run, same = results[config][0], []
        for key, group in cases.items():
            firsts = [_first_turn(run, i) for i in group]
            if any(t is None or not t.get("draws") for t in firsts) or len({tuple(t["tokens"]) for t in firsts}) > 1:
                continue
            chance = math.exp(sum(w[1] for w in firsts[0]["draws"]) * (len(group) - 1))
            if chance < alpha / len(cases):
                same.append((key, len(group), chance))
        if same:
            key, k, chance = same[0]
            out.append(f"seeds_ignored: on the flag-{config} side {len(same)} of {len(cases)} cases drew their samples "
                       f"identical under different keys ({key}: {k} samples, a chance of {chance:.2g} under the declared "
                       "decoding); its draws do not follow their keys, so the sides cannot be paired by seed")
    return out


def _first_turn(run: Run, item: Item) -> Any:
    r = run.get(item.case_id)
    return r["turns"][0] if r and r["turns"] and "crash" not in r else None


def _walk(c: Coupled, where: str, a: Any, b: Any, stage: str | None = None) -> bool:
    """Count one turn's coupled steps into ``c`` (and into its position class and ``stage``'s); whether the two
    answers parted."""
    draws = zip(a.get("draws") or [], b.get("draws") or [])
    for j, (x, y) in enumerate(zip(a["tokens"], b["tokens"])):
        c.count(j, stage, x != y)
        if x != y:
            return True
        pair: Any = next(draws, None)  # what each side's draw weighed: [raw, processed, ...]
        if pair and pair[0][0] == pair[1][0] and abs(pair[0][1] - pair[1][1]) > PROCESSED:
            c.sampler_state += 1
            if len(c.where) < KEPT:
                c.where.append(f"{where} token {j}")
    if len(a["tokens"]) == len(b["tokens"]):
        return False
    # one answer a strict prefix of the other (a dropped EOS, a length cut on one side): from the same history one
    # side stopped and the other drew a token, a coupled step whose draws differ
    c.count(min(len(a["tokens"]), len(b["tokens"])), stage, True)
    return True


def steps_needed(rate: float, limit: float, alpha: float, anytime: bool = False) -> int | None:
    """The fewest coupled steps whose bound at ``alpha`` (Clopper-Pearson's, or the confidence sequence's where
    ``anytime``) falls to ``limit`` at the mismatch ``rate`` seen; None where it never will (or only past 2^40)."""
    if rate >= limit:
        return None

    def within(n: int) -> bool:  # the bound at round(rate * n) of n is at most limit: read at limit, no bisection
        k = round(rate * n)
        if k >= n:
            return False
        if anytime:
            floor = math.log(alpha) + math.lgamma(k + 1) + math.lgamma(n - k + 1) - math.lgamma(n + 2)
            return k * math.log(limit) + (n - k) * math.log1p(-limit) <= floor
        return _cdf(k, n, limit) <= alpha

    n = 1
    while not within(n):
        n *= 2
        if n > 1 << 40:
            return None
    lo, hi = n // 2, n  # the bound falls with n at a fixed rate (up to rounding): bisect the doubling's last step
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if within(mid) else (mid, hi)
    return hi


def upper_anytime(k: int, n: int, alpha: float) -> float:
    """An upper bound on a rate that holds at every ``n`` at once, for a run that stops when its data say (a
    sequential evaluation): the uniform-prior mixture martingale B(k+1, n-k+1) / (p^k (1-p)^(n-k)) reaches 1/alpha
    with chance at most alpha at any time (Ville's inequality), so the bound is the largest p where it has not."""
    if n == 0 or k >= n:
        return 1.0
    floor = math.log(alpha) + math.lgamma(k + 1) + math.lgamma(n - k + 1) - math.lgamma(n + 2)

    def inside(p: float) -> bool:  # p^k (1-p)^(n-k) above alpha times the mixture
        return k * math.log(p) + (n - k) * math.log1p(-p) > floor if p > 0 else k == 0

    lo, hi = k / n, 1.0
    for _ in range(100):  # the likelihood falls as p rises past k/n
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if inside(mid) else (lo, mid)
    return hi


def upper(k: int, n: int, alpha: float) -> float:
    """Clopper-Pearson's one-sided upper bound on a rate after ``k`` events in ``n`` trials (1.0 with no trials)."""
    if n == 0 or k >= n:
        return 1.0
    if k == 0:
        return 1 - math.pow(alpha, 1 / n)
    lo, hi = k / n, 1.0
    for _ in range(100):  # bisection: P(Binomial(n, p) <= k) falls as p rises
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _cdf(k, n, mid) > alpha else (lo, mid)
    return hi


def _cdf(k: int, n: int, p: float) -> float:
    """P(Binomial(n, p) <= k): summed in log space for a few events, else the regularized incomplete beta
    I_{1-p}(n - k, k + 1) by its continued fraction (the sum would cost k terms)."""
    if k < 64:
        lp, lq = math.log(p), math.log1p(-p)
        return sum(math.exp(math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * lp + (n - i) * lq)
                   for i in range(k + 1))
    return _beta(n - k, k + 1, 1 - p)


def _beta(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b), 0 < x < 1, by its continued fraction on the side where it
    converges fast."""
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1) / (a + b + 2):
        return front * _fraction(a, b, x) / a
    return 1 - front * _fraction(b, a, 1 - x) / b


def _fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of I_x(a, b), by the modified Lentz method."""
    tiny = 1e-300

    def nonzero(v: float) -> float:
        return v if abs(v) > tiny else tiny

    c, d = 1.0, 1 / nonzero(1 - (a + b) * x / (a + 1))
    h = d
    for m in range(1, 1_000_000):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1 / nonzero(1 + num * d)
            c = nonzero(1 + num / c)
            h *= d * c
        if abs(d * c - 1) < 1e-15:
            break
    return h
