"""How far a configuration moved the model: the distribution distance between side A (the reference,
flag off) and side B (flag on), teacher-forced, as llama.cpp's ``llama-perplexity --kl-divergence``
reports it.

Teacher-forced: both sides read the same tokens (A's prompt and A's output) in one pass each
(``Session.score``), and at every position of A's output the two next-token distributions are compared.
A change that is not meant to be exact (a quantized KV cache, a LoRA adapter, another runtime) flips few
assertions yet may move the model; this says how far.

The statistics, per position ``i`` with A's log-probabilities ``a`` and B's ``b`` (``tools/perplexity/
perplexity.cpp``: ``log_softmax(..., kl_divergence_result &)`` and ``kl_divergence()``):

- KLD: ``KL(A‖B) = Σ_v p_A(v) (log p_A(v) − log p_B(v))``, in nats; its mean ± standard error, median,
  p90/p99/p99.9, max and min (and p1/p10/p95).
- same top-1: the share of positions where both argmaxes agree (the lowest id on a tie, as greedy
  picks), ± ``sqrt(p (1 − p) / (n − 1))``.
- Δp: ``p_B(t) − p_A(t)`` for the token ``t`` that comes next (A's own output token), with mean ± SE,
  quantiles, and RMS ``sqrt(mean(Δp²))`` ± ``0.5 / RMS · SE(Δp²)``.
- ln(PPL_B / PPL_A): the mean difference of the two sides' negative log-likelihoods of those tokens,
  ± ``sqrt(SE_A² + SE_B² − 2 cov)``.

Mean ± SE is llama.cpp's ``mean_and_uncertainty``: ``mean = Σx/n``, ``SE = sqrt((Σx²/n − mean²) / (n − 1))``;
quantiles interpolate linearly at ``q (n − 1)`` in the sorted values (its ``percentile``; the median
averages the two middle values). Where this differs from llama.cpp, on purpose: (1) llama.cpp stores
A's log-probabilities as 16-bit integers over a 16-nat range (about 2.4e-4 nats a step) and skips
A's tokens with log p ≤ −16 in the sum; here A's rows are used whole, in float32 read as float64.
(2) llama.cpp prints an SE of 0 below 11 positions and no summary below 100; here the same formula
holds for any n ≥ 2 (0 below). (3) The comparison is over the positions of outputs (A's answers), not
the second half of fixed-size windows of a text.

Top-k: where a side reports only its k likeliest tokens (and its own token's), KL is computed over the
tokens whose probabilities both sides report (A's top-k, or the two top-k sets' intersection, and the
next token), with each side's remaining mass lumped in one "other" bucket. Grouping outcomes can only
reduce KL (the log-sum inequality: ``Σ_G p log(p/q) ≥ P_G log(P_G/Q_G)`` for every group G), so the value
is a **lower bound** of the full KL; ``approximation`` says so. Same top-1 and Δp stay exact.

Total variation: ``TV(A, B) = ½ Σ_v |p_A(v) − p_B(v)|`` per position, exact from full rows. A lower bound on KL
bounds no TV from above (Pinsker's ``sqrt(KL / 2)`` needs the true KL), so from top-k rows the TV is bounded
directly: ``½ Σ_shown |p_A − p_B| + ½ (rest_A + rest_B)``, the rest being each side's mass outside the tokens
shown (a token outside them differs by at most its mass on both sides). ``tv_max`` is the largest over positions.

numpy is imported inside the functions (the CLI's start-up never pays for it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Any, Sequence

from ...engines.base import Scored
from ...summaries import Compared as ComparedSummary
from ...summaries import DistanceFigures, Quantiles

APPROXIMATION = "top{k}, other mass lumped: a lower bound"
QUANTILES = {"min": 0.0, "p1": 0.01, "p10": 0.10, "median": 0.5, "p90": 0.90, "p95": 0.95, "p99": 0.99,
             "p999": 0.999, "max": 1.0}
# An "other" bucket's mass below this is rounding (float32 log-probabilities summed): held at it.
_TINY = 1e-7


@dataclass
class Summary:
    """One per-position statistic: mean ± standard error and its quantiles."""

    mean: float
    se: float
    min: float
    p1: float
    p10: float
    median: float
    p90: float
    p95: float
    p99: float
    p999: float
    max: float

    @classmethod
    def of(cls, values: Any) -> Summary:
        import numpy as np

        x = np.asarray(values, dtype=np.float64)
        if len(x) == 0:
            return cls(**dict.fromkeys(("mean", "se", *QUANTILES), 0.0))
        mean, se = mean_and_se(x)
        qs = np.quantile(x, list(QUANTILES.values())) if np.isfinite(x).all() else _quantiles_with_inf(x)
        return cls(mean=mean, se=se, **{k: float(v) for k, v in zip(QUANTILES, qs)})

    def to_dict(self) -> Quantiles:
        return {"mean": self.mean, "se": self.se, "min": self.min, "p1": self.p1, "p10": self.p10,
                "median": self.median, "p90": self.p90, "p95": self.p95, "p99": self.p99, "p999": self.p999,
                "max": self.max}


@dataclass
class Distance:
    """A against B over ``positions`` teacher-forced positions (see the module docstring)."""

    positions: int
    kld: Summary
    same_top1: float
    same_top1_se: float
    delta_p: Summary
    delta_p_rms: float
    delta_p_rms_se: float
    ln_ppl_ratio: float  # ln(PPL_B / PPL_A) over the same tokens
    ln_ppl_ratio_se: float
    approximation: str | None = None  # None: exact; else how KL was bounded (top-k)
    worst: list[list[float]] = field(default_factory=list)  # [position, KL] of the largest KLs, largest first
    tv_max: float | None = None  # the largest per-position TV (top-k: an upper bound on it); None: not read

    def to_dict(self) -> DistanceFigures:
        """The figures, field for field in declaration order (what ``asdict`` gave)."""
        return {"positions": self.positions, "kld": self.kld.to_dict(), "same_top1": self.same_top1,
                "same_top1_se": self.same_top1_se, "delta_p": self.delta_p.to_dict(), "delta_p_rms": self.delta_p_rms,
                "delta_p_rms_se": self.delta_p_rms_se, "ln_ppl_ratio": self.ln_ppl_ratio,
                "ln_ppl_ratio_se": self.ln_ppl_ratio_se, "approximation": self.approximation,
                "worst": [list(w) for w in self.worst], "tv_max": self.tv_max}

    def reason(self) -> str:
        """One line: the KL, same top-1 and Δp figures a reader needs."""
        if not self.positions:
            return "kld: no positions compared"
        k = self.kld
        line = (f"kld: mean {_g(k.mean)} ± {_g(k.se)}, p99 {_g(k.p99)}, max {_g(k.max)} over {self.positions} positions; "
                f"same top-1 {100 * self.same_top1:.1f}% ± {100 * self.same_top1_se:.1f}%; "
                f"Δp RMS {_g(100 * self.delta_p_rms)}%")
        return f"{line} ({self.approximation})" if self.approximation else line


@dataclass
class PerPosition:
    """The per-position values ``Distance`` summarizes (float64 numpy arrays; ``same`` is boolean)."""

    kld: Any
    same: Any
    delta_p: Any
    nll_a: Any
    nll_b: Any
    k: int | None = None  # the smallest top-k that bounded a KL; None: every KL exact
    tv: Any = None  # per-position TV, exact from full rows, from top-k rows an upper bound; None: not read

    def summary(self) -> Distance:
        import numpy as np

        n = len(self.kld)
        same = float(np.mean(self.same)) if n else 0.0
        dp2 = np.asarray(self.delta_p, dtype=np.float64) ** 2
        mse, mse_se = mean_and_se(dp2)
        rms = math.sqrt(mse)
        nll_a, se_a = mean_and_se(self.nll_a)
        nll_b, se_b = mean_and_se(self.nll_b)
        cov = _covariance(self.nll_b, self.nll_a)
        worst: Any = np.argsort(-np.nan_to_num(self.kld, nan=np.inf), kind="stable")[:5]
        return Distance(
            positions=n,
            kld=Summary.of(self.kld),
            same_top1=same,
            same_top1_se=math.sqrt(same * (1 - same) / (n - 1)) if n > 1 else 0.0,
            delta_p=Summary.of(self.delta_p),
            delta_p_rms=rms,
            delta_p_rms_se=0.5 / rms * mse_se if rms > 0 else 0.0,
            ln_ppl_ratio=nll_b - nll_a,
            ln_ppl_ratio_se=math.sqrt(max(0.0, se_a * se_a + se_b * se_b - 2 * cov)),
            approximation=None if self.k is None else APPROXIMATION.format(k=self.k),
            worst=[[int(i), float(self.kld[i])] for i in worst],
            tv_max=float(np.max(self.tv)) if self.tv is not None and len(self.tv) == n and n else None,
        )


def positions(a: Scored | Sequence[Scored], b: Scored | Sequence[Scored]) -> PerPosition:
    """Per-position KL(A‖B), top-1 agreement, Δp and both sides' NLL, pooled over pairs of ``Scored`` (one
    pair per case: A's and B's scores of the same prompt and continuation)."""
    import numpy as np

    pairs = list(zip(_listed(a), _listed(b)))
    if len(_listed(a)) != len(_listed(b)):
        raise ValueError(f"{len(_listed(a))} scores of side A against {len(_listed(b))} of side B")
    parts, ks = [], []
    for i, (sa, sb) in enumerate(pairs):
        if list(sa.tokens) != list(sb.tokens):
            raise ValueError(f"pair {i}: A and B scored different tokens; teacher forcing compares the same positions")
        k = [s.k for s in (sa, sb) if s.k is not None]
        ks.extend(k)
        kld, tv = _full(sa.logprobs, sb.logprobs) if not k else _lumped(sa, sb)
        ta = np.asarray(sa.token_logprobs, dtype=np.float64)
        tb = np.asarray(sb.token_logprobs, dtype=np.float64)
        parts.append((kld, _argmax(sa) == _argmax(sb), np.exp(tb) - np.exp(ta), -ta, -tb, tv))
    cols = [np.concatenate([p[j] for p in parts]) if parts else np.zeros(0) for j in range(6)]
    return PerPosition(kld=cols[0], same=cols[1].astype(bool), delta_p=cols[2], nll_a=cols[3], nll_b=cols[4],
                       k=min(ks) if ks else None, tv=cols[5])


def distance(a: Scored | Sequence[Scored], b: Scored | Sequence[Scored]) -> Distance:
    """A (reference, flag off) against B (flag on): ``positions(a, b).summary()``."""
    return positions(a, b).summary()


@dataclass(frozen=True)
class Bound:
    """A policy's bound on how far B may move the model, judged against the A/A floor (``check``).

    ``max_kld``: the most the KL statistic ``kld_stat`` (mean, median, p90, p99, p999, max) may exceed the
    floor's. ``min_same_top1``: the least same-top-1 share, once the floor's own disagreement is allowed:
    met when ``floor.same_top1 − same_top1 ≤ 1 − min_same_top1``. None: not bounded."""

    max_kld: float | None = None
    min_same_top1: float | None = None
    kld_stat: str = "mean"

    def __post_init__(self) -> None:
        if self.kld_stat not in ("mean", *QUANTILES):
            raise ValueError(f"kld_stat {self.kld_stat!r}: use mean or one of {', '.join(QUANTILES)}")


@dataclass
class Check:
    """Whether a ``Bound`` holds; ``lines`` says what each bound measured, failures first."""

    met: bool
    lines: list[str]

    def reason(self) -> str:
        return "; ".join(self.lines) if self.lines else "no distance bound set"


def check(dist: Distance, floor: Distance | None, bound: Bound) -> Check:
    """Judge ``bound`` on ``dist`` against the A/A floor: a bound is met when the statistic minus the floor's
    is within it (``max_kld``: KL − floor KL ≤ max_kld; ``min_same_top1``: floor share − share ≤ 1 −
    min_same_top1). Without a floor (None) the floor is taken as perfect: KL 0, same top-1 100%."""
    failed: list[str] = []
    passed: list[str] = []
    of = "the A/A floor" if floor is not None else "no A/A floor (taken as 0)"
    if not dist.positions:
        return Check(met=False, lines=["no positions compared: the distance bound cannot be judged"])
    if bound.max_kld is not None:
        stat = bound.kld_stat
        value = getattr(dist.kld, stat)
        base = getattr(floor.kld, stat) if floor is not None else 0.0
        excess = value - base
        line = f"kld {stat} {_g(value)} is {_g(excess)} above {of} ({_g(base)}); bound {_g(bound.max_kld)}"
        (passed if excess <= bound.max_kld else failed).append(line)
    if bound.min_same_top1 is not None:
        base = floor.same_top1 if floor is not None else 1.0
        shortfall = base - dist.same_top1
        line = (f"same top-1 {100 * dist.same_top1:.2f}% is {100 * shortfall:.2f} points below {of} ({100 * base:.2f}%); "
                f"bound {100 * (1 - bound.min_same_top1):.2f} points (min {100 * bound.min_same_top1:.2f}%)")
        (passed if shortfall <= 1 - bound.min_same_top1 else failed).append(line)
    if dist.approximation and bound.max_kld is not None:
        passed.append(f"kld is {dist.approximation}")
    return Check(met=not failed, lines=failed + passed)


def beyond(dist: Distance, floor: Distance | None, bound: Bound, alpha: float) -> list[str]:
    """The bounds ``dist`` exceeds beyond doubt: even the one-sided (1 − alpha) confidence bound taken in the flag's
    favour (mean KL − z·SE, same top-1 + z·SE), against the floor's least favourable bound, is outside the bound.
    Only the mean KL and same top-1 carry an SE; a quantile bound is never judged so. The SE treats positions as
    independent, which tokens of one answer are not: so this reads only distances far outside a bound."""
    if not dist.positions:
        return []
    z, out = NormalDist().inv_cdf(1 - alpha), []
    of = "the A/A floor" if floor is not None else "no A/A floor (taken as 0)"
    if bound.max_kld is not None and bound.kld_stat == "mean":
        base = floor.kld.mean + z * floor.kld.se if floor is not None else 0.0
        low = dist.kld.mean - z * dist.kld.se - base
        if low > bound.max_kld:
            out.append(f"kld mean {_g(dist.kld.mean)} ± {_g(dist.kld.se)}: even its lower {1 - alpha:.0%} bound is "
                       f"{_g(low)} above {of}; bound {_g(bound.max_kld)}")
    if bound.min_same_top1 is not None:
        base = floor.same_top1 - z * floor.same_top1_se if floor is not None else 1.0
        short = base - (dist.same_top1 + z * dist.same_top1_se)
        if short > 1 - bound.min_same_top1:
            out.append(f"same top-1 {100 * dist.same_top1:.2f}% ± {100 * dist.same_top1_se:.2f}%: even its upper "
                       f"{1 - alpha:.0%} bound is {100 * short:.2f} points below {of}; bound {100 * (1 - bound.min_same_top1):.2f} points")
    return out


@dataclass
class Compared:
    """A against B, and A against a repeat of A (the floor: what the engine's own nondeterminism moves)."""

    distance: Distance
    floor: Distance | None
    seconds: float | None = None  # what reading both sides teacher-forced cost (three prefills a turn), when timed
    caveat: str | None = None  # what the engines' distributions leave out (a server's, Engine.score_caveat)

    def within_floor(self, bound: Bound) -> Check:
        """``check(distance, floor, bound)``: a bound is met when the statistic minus the floor's is within it."""
        return check(self.distance, self.floor, bound)

    def beyond(self, bound: Bound, alpha: float) -> list[str]:
        """``beyond(distance, floor, bound, alpha)``: the bounds exceeded beyond doubt."""
        return beyond(self.distance, self.floor, bound, alpha)

    def to_dict(self) -> ComparedSummary:
        out = ComparedSummary(distance=self.distance.to_dict(), floor=self.floor.to_dict() if self.floor else None)
        if self.seconds is not None:
            out["seconds"] = self.seconds
        if self.caveat:
            out["caveat"] = self.caveat
        return out

    def reason(self) -> str:
        floor = self.floor
        tail = (f"; A/A floor: kld mean {_g(floor.kld.mean)}, same top-1 {100 * floor.same_top1:.1f}%"
                if floor is not None else "; no A/A floor")
        return self.distance.reason() + tail + (f"; {self.caveat}" if self.caveat else "")


def compare(a: Scored | Sequence[Scored], b: Scored | Sequence[Scored],
            a_again: Scored | Sequence[Scored] | None = None) -> Compared:
    """B against A, and (given a second run of A on the same tokens) the A/A floor."""
    return Compared(distance=distance(a, b), floor=distance(a, a_again) if a_again is not None else None)


# --- the per-position arithmetic ------------------------------------------------------------------


def _full(la: Any, lb: Any) -> tuple[Any, Any]:
    """KL(A‖B) and TV per row of full log-probability rows, in float64 (a token A gives no mass adds no KL)."""
    import numpy as np

    la, lb = np.asarray(la, dtype=np.float64), np.asarray(lb, dtype=np.float64)
    if la.shape != lb.shape:
        raise ValueError(f"A's rows are {la.shape}, B's {lb.shape}: not the same vocabulary")
    pa = np.exp(la)
    with np.errstate(invalid="ignore"):
        terms = np.where(pa > 0, pa * (la - lb), 0.0)
    return terms.sum(axis=1), 0.5 * np.abs(pa - np.exp(lb)).sum(axis=1)


def _known(s: Scored, i: int) -> dict[int, float] | None:
    """Position i's log-probabilities a top-k side reports (its top-k and its own token); None: full rows."""
    if s.ids is None:
        return None
    out = {int(t): float(v) for t, v in zip(s.ids[i], s.logprobs[i])}
    out.setdefault(int(s.tokens[i]), float(s.token_logprobs[i]))
    return out


def _lumped(sa: Scored, sb: Scored) -> tuple[Any, Any]:
    """KL over the tokens both sides report, each side's remaining mass in one bucket (a lower bound), and an upper
    bound on TV: the shown tokens' differences plus both sides' remaining mass (see the module docstring)."""
    import numpy as np

    out, tv = np.zeros(len(sa.tokens)), np.zeros(len(sa.tokens))
    for i in range(len(sa.tokens)):
        ka, kb = _known(sa, i), _known(sb, i)
        ids = sorted(ka.keys() & kb.keys() if ka is not None and kb is not None else (ka or kb or {}).keys())
        la = np.array([ka[t] for t in ids] if ka is not None else sa.logprobs[i][ids], dtype=np.float64)
        lb = np.array([kb[t] for t in ids] if kb is not None else sb.logprobs[i][ids], dtype=np.float64)
        pa, pb = np.exp(la), np.exp(lb)
        oa, ob = max(1.0 - pa.sum(), _TINY), max(1.0 - pb.sum(), _TINY)
        out[i] = float(np.sum(pa * (la - lb))) + oa * math.log(oa / ob)
        rest = max(1.0 - pa.sum(), 0.0) + max(1.0 - pb.sum(), 0.0)
        tv[i] = min(1.0, 0.5 * float(np.abs(pa - pb).sum() + rest))
    return out, tv


def _argmax(s: Scored) -> Any:
    import numpy as np

    return np.asarray(s.ids[:, 0]) if s.ids is not None else np.argmax(s.logprobs, axis=1)


def mean_and_se(values: Any) -> tuple[float, float]:
    """llama.cpp's ``mean_and_uncertainty``: the mean, and ``sqrt((Σx²/n − mean²) / (n − 1))`` (0 below two values)."""
    import numpy as np

    x = np.asarray(values, dtype=np.float64)
    n = len(x)
    if n == 0:
        return 0.0, 0.0
    mean = float(x.sum() / n)
    var = float((x * x).sum() / n - mean * mean)
    return mean, math.sqrt(var / (n - 1)) if n > 1 and var > 0 else 0.0


def _covariance(a: Any, b: Any) -> float:
    """llama.cpp's ``covariance`` of two means: ``(Σab/n − mean_a·mean_b) / (n − 1)``."""
    import numpy as np

    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    n = len(x)
    if n < 2:
        return 0.0
    return float(((x * y).sum() / n - (x.sum() / n) * (y.sum() / n)) / (n - 1))


def _quantiles_with_inf(x: Any) -> list[float]:
    """Quantiles of values that include infinities (a B that gives A's token no mass): by rank."""
    import numpy as np

    v = np.sort(x)
    return [float(v[min(len(v) - 1, int(math.floor(q * (len(v) - 1) + 0.5)))]) for q in QUANTILES.values()]


def _listed(x: Scored | Sequence[Scored]) -> list[Scored]:
    return [x] if isinstance(x, Scored) else list(x)


def _g(x: float) -> str:
    """Two significant digits, as a reason reads (0.0012, 0.02, 3.1e-05)."""
    return f"{x:.2g}"
