"""What paired draws certify under sampled decoding.

Both sides draw each token with the same keyed noise (``engines/sampler.py``), so until their answers part they read
the same history: every such step is a coupled step, and the share of coupled steps where the drawn tokens differ
bounds the per-token total-variation distance between the two sides' next-token distributions from above (under
any coupling, P(tokens differ) >= TV). The bound is Clopper-Pearson's at ``alpha`` over the coupled steps as
trials; with no mismatch it is 1 - alpha^(1/n), which holds however the steps depend on each other (the chance of n
clean steps is a product of per-step chances, at most (1 - mean)^n).

On the coupled steps each side also recorded the log-probability its raw and its processed distribution gave the
token drawn. The same raw figure with another processed one means the sampler read other state (a penalty's
history, a filter's order) though the model computed the same: a sampler-state defect, named as one.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable

from ..battery.suites import Item
from ..engines import sampler
from ..evidence import Run

KEPT = 5  # sampler-state positions kept in the record (the count holds them all)
PROCESSED = 1e-6  # processed log-probabilities further apart than this, from equal raw ones, part


@dataclass
class Coupled:
    """The coupled steps of one evaluation's sampled cases, flag off against on (first runs)."""

    decoding: dict[str, str]  # suite -> its decoding in one line
    answers: int  # sampled answers compared (cases times samples)
    chain: dict[str, Any] | None = None  # the flag-on engine's sampler: its chain, penalty windows and draw
    steps: int = 0  # generated positions both sides drew from the same history
    mismatches: int = 0  # of those, where they drew different tokens or one stopped (at most one per answer: they part)
    alpha: float = 0.05
    tv_bound: float = 1.0  # per-token TV distance, at most this, at confidence 1 - alpha
    sampler_state: int = 0  # coupled steps with equal raw and different processed log-probabilities
    where: list[str] = field(default_factory=list)  # the first KEPT of them
    bound: str = "Clopper-Pearson"  # or "confidence sequence": valid at whatever step a sequential run stopped

    def upper(self, k: int, n: int) -> float:
        return (upper_anytime if self.bound == "confidence sequence" else upper)(k, n, self.alpha)

    def line(self) -> str:
        return (f"sampled: {'; '.join(f'{s}: {d}' for s, d in self.decoding.items())}; {self.answers} answers paired "
                f"by seed, {self.steps} coupled steps, {self.mismatches} mismatched: per-token total variation at most "
                f"{self.tv_bound:.3g} ({1 - self.alpha:.0%} {self.bound})")

    def reasons(self) -> list[str]:
        if not self.sampler_state:
            return []
        return [f"sampler_state: at {self.sampler_state} coupled steps both sides computed the same raw log-probability "
                f"and their samplers weighed it differently ({', '.join(self.where)}): the flag-on sampler reads other "
                "state (a penalty's history, a filter), though the model computed the same"]

    def judge(self, verdict: str, reasons: list[str], ignored: list[str],
              max_tv: float | None = None) -> tuple[str, list[str]]:
        """The verdict with what the draws show: draws that do not follow their keys void the pairing
        (INCONCLUSIVE); a sampler-state defect is a FAIL; a PASS whose bound exceeds ``max_tv`` (the policy's) is
        INCONCLUSIVE with the steps it needs; either way the coupling line."""
        if ignored:
            return "INCONCLUSIVE", ignored + reasons + [self.line()]
        if self.sampler_state:
            return "FAIL", self.reasons() + reasons + [self.line()]
        if verdict == "PASS" and max_tv is not None and self.tv_bound > max_tv:
            return "INCONCLUSIVE", [self.short_of(max_tv)] + reasons + [self.line()]
        return verdict, reasons + [self.line()]

    def short_of(self, max_tv: float) -> str:
        """``tv_bound:`` why the coupled steps cannot yet show a distance within ``max_tv``, and what would."""
        head = (f"tv_bound: {self.steps} coupled steps ({self.mismatches} mismatched) bound the per-token total variation "
                f"at {self.tv_bound:.3g}, above the policy's max_tv {max_tv:g}")
        rate = self.mismatches / self.steps if self.steps else 0.0
        needed = steps_needed(rate, max_tv, self.alpha, self.upper)
        if needed is None:
            return (f"{head}; the sides part at {rate:.3g} of their coupled steps, so no number of samples brings the "
                    "bound under it (the coupling may part more often than the distributions differ: judge the change "
                    "by its pass rates, or raise max_tv)")
        per = self.steps / self.answers if self.answers else 1.0
        return (f"{head}; at this mismatch rate it needs about {needed} coupled steps, {math.ceil(needed / per)} sampled "
                f"answers ({math.ceil(needed / per) - self.answers} more): raise the suite's samples")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def couple(items: Iterable[Item], off: Run, on: Run, alpha: float, chain: dict[str, Any] | None,
           anytime: bool = False) -> Coupled | None:
    """The coupled steps of the sampled cases both sides answered; None where no suite samples. ``anytime``: the run
    stopped when its data said (sequential), so the bound must hold at every stop (``upper_anytime``)."""
    sampled = [i for i in items if not i.suite.decoding.plain]
    if not sampled:
        return None
    c = Coupled({i.suite.suite: sampler.describe(i.suite.decoding) for i in sampled}, 0, chain, alpha=alpha,
                bound="confidence sequence" if anytime else "Clopper-Pearson")
    for item in sampled:
        a, b = off.get(item.case_id), on.get(item.case_id)
        if a is None or b is None or "crash" in a or "crash" in b:
            continue
        c.answers += 1
        for n, (ta, tb) in enumerate(zip(a["turns"], b["turns"]), 1):
            parted = _walk(c, f"{item.case_id} turn {n}", ta, tb)
            if parted:  # the next turn's prompt holds this turn's answer: no longer one history
                break
    c.tv_bound = c.upper(c.mismatches, c.steps)
    return c


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


def _walk(c: Coupled, where: str, a: Any, b: Any) -> bool:
    """Count one turn's coupled steps into ``c``; whether the two answers parted."""
    draws = zip(a.get("draws") or [], b.get("draws") or [])
    for j, (x, y) in enumerate(zip(a["tokens"], b["tokens"])):
        c.steps += 1
        if x != y:
            c.mismatches += 1
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
    c.steps += 1
    c.mismatches += 1
    return True


def steps_needed(rate: float, limit: float, alpha: float,
                 bound: Callable[[int, int], float] | None = None) -> int | None:
    """The fewest coupled steps whose bound (Clopper-Pearson's unless ``bound`` is given) falls to ``limit`` at the
    mismatch ``rate`` seen; None where it never will."""
    bound = bound or (lambda k, n: upper(k, n, alpha))
    if rate >= limit:
        return None
    n = 1
    while bound(round(rate * n), n) > limit:
        n *= 2
        if n > 1 << 40:
            return None
    lo, hi = n // 2, n  # the bound falls with n at a fixed rate (up to rounding): bisect the doubling's last step
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if bound(round(rate * mid), mid) <= limit else (mid, hi)
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
        return 1 - alpha ** (1 / n)
    lo, hi = k / n, 1.0
    for _ in range(100):  # bisection: P(Binomial(n, p) <= k) falls as p rises
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _cdf(k, n, mid) > alpha else (lo, mid)
    return hi


def _cdf(k: int, n: int, p: float) -> float:
    """P(Binomial(n, p) <= k), summed in log space."""
    lp, lq = math.log(p), math.log1p(-p)
    return sum(math.exp(math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * lp + (n - i) * lq)
               for i in range(k + 1))
