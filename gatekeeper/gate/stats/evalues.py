"""The guard's test statistics: e-values against a limit on a mismatch rate, valid however often they are looked at.

``log_evalue``: one sample of Bernoulli trials (answers parted or not), against H0 "the rate is at most ``limit``":
a mixture likelihood ratio with alternatives uniform on ``[limit, 1]``, a nonnegative supermartingale under H0, so by
Ville's inequality it reaches ``1/alpha`` with chance at most ``alpha`` over any number of looks. ``log_evalue_paired``:
requests compared twice (A/B and A/A), against H0 "p_AB <= p_AA + limit", the average over bets of betting
supermartingales (exact at limit 0, a midpoint grid of ``GRID`` bets above it). ``to_detect`` and
``to_detect_paired``: the comparisons each needs to breach at a given rate, the power analysis a watch is sized with.
The rule that looks at them after every batch, and what a breach does, is ``gate/guard.py``.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np


@lru_cache(maxsize=1 << 16)  # pure; simulations and restarts ask for the same counts again and again
def log_evalue(k: int, n: int, limit: float) -> float:
    """log of the mixture statistic after ``k`` mismatches in ``n`` comparisons, against H0: rate <= ``limit``.

    E = (1/(1-p0)) * integral over p in [p0, 1] of (p/p0)^k ((1-p)/(1-p0))^(n-k) dp, and the integral of
    p^k (1-p)^(n-k) over [p0, 1] is B(k+1, n-k+1) P(Binomial(n+1, p0) <= k)."""
    if n == 0:
        return 0.0
    if limit <= 0:
        return math.inf if k else -math.log(n + 1)  # H0 is "never": one mismatch refutes it
    log_beta = math.lgamma(k + 1) + math.lgamma(n - k + 1) - math.lgamma(n + 2)
    lp, lq = math.log(limit), math.log1p(-limit)
    terms = [math.lgamma(n + 2) - math.lgamma(i + 1) - math.lgamma(n + 2 - i) + i * lp + (n + 1 - i) * lq
             for i in range(k + 1)]
    top = max(terms)
    log_tail = top + math.log(sum(math.exp(t - top) for t in terms))
    return log_beta + log_tail - lq - k * lp - (n - k) * lq


GRID = 512  # bets of the paired test's mixture with a limit above 0 (a midpoint grid: each an exact supermartingale)


def log_evalue_paired(ab_only: int, aa_only: int, paired: int, limit: float) -> float:
    """log of the baseline-aware statistic after ``paired`` requests compared twice (A/B and A/A), of which
    ``ab_only`` parted A/B only and ``aa_only`` A/A only, against H0: p_AB <= p_AA + ``limit``.

    The average over bets lam, uniform on [0, 1/(1+limit)], of prod (1 + lam (Z_i - limit)), Z = A/B parted - A/A
    parted: each Z = 1 gives 1 + lam (1 - limit), each Z = -1 gives 1 - lam (1 + limit), each concordant request
    1 - lam limit. With limit 0 that average is exactly ``log_evalue(ab_only, ab_only + aa_only, 1/2)`` (substitute
    p = (1 + lam)/2), which is used; otherwise the average over a midpoint grid of ``GRID`` bets."""
    if limit <= 0:
        return log_evalue(ab_only, ab_only + aa_only, 0.5)
    import numpy as np

    up, down, same = _bets(limit)
    logs = ab_only * up + aa_only * down + (paired - ab_only - aa_only) * same
    peak = float(logs.max())
    return peak + math.log(float(np.exp(logs - peak).mean()))


@lru_cache(maxsize=64)
def _bets(limit: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """log(1 + lam (z - limit)) for z = 1, -1 and 0, on the midpoint grid of bets lam in [0, 1/(1+limit)]."""
    import numpy as np

    lam = (np.arange(GRID) + 0.5) / GRID / (1 + limit)
    return np.log1p(lam * (1 - limit)), np.log1p(-lam * (1 + limit)), np.log1p(-lam * limit)


def to_detect_paired(rate: float, base: float, limit: float, alpha: float, cap: int = 1_000_000) -> int | None:
    """Requests compared twice (A/B and A/A) the baseline-aware test needs to breach when the flag-on side parts from
    the flag-off side at ``rate`` and the flag-off side from itself at ``base``, the two partings independent (so
    p(A/B only) = rate (1 - base), p(A/A only) = base (1 - rate)); over ``aa_rate``, the shadowed requests."""
    if rate <= base + limit:
        return None
    threshold = math.log(1 / alpha)
    ab, aa = rate * (1 - base), base * (1 - rate)

    def breached(n: int) -> bool:
        b, c = math.floor(ab * n), math.floor(aa * n)
        return log_evalue_paired(b, c, n, limit) >= threshold

    n = 1
    while n <= cap:
        if breached(n):
            lo, hi = n // 2, n
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if breached(mid) else (mid, hi)
            return hi
        n *= 2
    return None


def to_detect(rate: float, limit: float, alpha: float, cap: int = 1_000_000) -> int | None:
    """Comparisons the test needs to breach when mismatches come at exactly ``rate`` (k = rate * n): the power
    analysis a test or an operator sizes a watch with. None where it never breaches within ``cap``."""
    if rate <= limit:
        return None
    threshold = math.log(1 / alpha)
    n = 1
    while n <= cap:
        if log_evalue(math.floor(rate * n), n, limit) >= threshold:
            # bisect back down between n/2 and n: the statistic grows with n at a fixed rate
            lo, hi = n // 2, n
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if log_evalue(math.floor(rate * mid), mid, limit) >= threshold else (mid, hi)
            return hi
        n *= 2
    return None
