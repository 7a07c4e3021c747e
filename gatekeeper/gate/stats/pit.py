"""Each arm's draws against the declared decoding, on that arm alone.

Pairing by seed compares the two sides; it cannot see a sampler both share that ignores a penalty, applies the
temperature twice or filters in another order. So each step of a sampled answer also records the randomized
probability-integral transform of its token under the declared decoding, computed from the logits the arm itself
produced (``sampler.transform``). Over the steps of draws that follow the declared decoding these values are independent
and uniform on [0, 1). Per side, two tests say whether they are: Kolmogorov-Smirnov against the uniform distribution
(uniformity: a sharper or flatter sampler), and the serial correlation of consecutive steps' values within a turn
(independence: a sampler whose steps reuse each other's randomness, which leaves each step's value uniform); a token
the declared decoding gives no chance is a defect on sight. A side whose draws do not follow it: the flag-on side
alone, FAIL; the flag-off side, the pipeline's base is broken (``base_defect:``, never PASS).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Sequence, cast

from ...battery.suites import Item
from ...evidence import Ruling, Run
from ...summaries import PitSide

KEPT = 5  # impossible draws kept in the record per side (the count holds them all)
SERIAL_SHARE = 0.1  # of a side's alpha, the serial test's: it is there for gross defects (a reused stream)
NORMAL = 100  # consecutive pairs from which the serial test reads its p-value from the normal distribution
SIMULATED = 9999  # below that, null statistics simulated


@dataclass
class Side:
    """One side's draws under the declared decoding."""

    steps: int = 0  # draws transformed
    statistic: float = 0.0  # Kolmogorov-Smirnov D against the uniform distribution
    p: float = 1.0  # its p-value
    impossible: int = 0  # draws of a token the declared decoding gives no chance
    where: list[str] = field(default_factory=list)  # the first KEPT of them
    reread: int = 0  # of the steps, those transformed from the reference's rows (the side gave none of its own)
    undecided: int = 0  # draws the reference read too near the declared support's edge to tell
    pairs: int = 0  # consecutive steps of one turn both transformed (the side's own records)
    serial: float = 0.0  # the lag-1 serial correlation of their transforms about 1/2 (``serial``)
    serial_p: float = 1.0  # its two-sided p-value

    def departs(self, alpha: float) -> bool:
        """Whether the draws depart at ``alpha``: an impossible draw, or either test at its share of it (Bonferroni:
        the serial test a tenth, whose power against a reused stream needs no more; uniformity the rest)."""
        return self.impossible > 0 or self.p < alpha * (1 - SERIAL_SHARE) or self.serial_p < alpha * SERIAL_SHARE

    def line(self, config: str, alpha: float) -> str:
        if self.impossible:
            return (f"the flag-{config} side drew {self.impossible} tokens the declared decoding gives no chance "
                    f"({', '.join(self.where)})")
        why = ([f"their probability transforms are not uniform: Kolmogorov-Smirnov D {self.statistic:.3g}, p "
                f"{self.p:.2g}"] if self.p < alpha * (1 - SERIAL_SHARE) else [])
        why += ([f"consecutive steps' transforms are not independent uniforms: lag-1 serial correlation about 1/2 "
                 f"{self.serial:.3g} over {self.pairs} pairs, p {self.serial_p:.2g}"] if self.serial_p < alpha * SERIAL_SHARE else [])
        return f"the flag-{config} side's {self.steps} draws do not follow the declared decoding ({'; '.join(why)})"


def read(items: Iterable[Item], results: dict[str, list[Run]], reread: dict[str, Any] | None = None) -> dict[str, Side] | None:
    """Each side's transforms over its first run's sampled answers, and those ``reread`` from the reference arm's
    rows where a side gave none (``independent.Reread``); None where no answer carries them."""
    sides = {}
    for config in ("off", "on"):
        run, values, side = results[config][0], [], Side()
        chains: list[list[float]] = []  # runs of consecutive transformed steps within a turn
        if extra := (reread or {}).get(config):
            values += extra.values
            side.impossible, side.where = len(extra.impossible), extra.impossible[:KEPT]
            side.reread, side.undecided = len(extra.values) + len(extra.impossible), extra.undecided
        for item in items:
            r = run.get(item.case_id)
            if not item.suite.decoding.sampled or r is None:
                continue
            for n, turn in enumerate(r["turns"], 1):
                chains.append([])
                for j, draw in enumerate(turn.get("draws") or []):
                    if len(draw) < 4:  # a server's weight of the draw alone, with no transform
                        chains.append([])
                        continue
                    if draw[3] < 0:
                        side.impossible += 1
                        if len(side.where) < KEPT:
                            side.where.append(f"{item.case_id} turn {n} token {j}")
                        chains.append([])
                    else:
                        values.append(draw[3])
                        chains[-1].append(draw[3])
        if not values and not side.impossible:
            return None
        side.steps = len(values) + side.impossible
        side.statistic, side.p = ks_uniform(values)
        side.pairs, side.serial, side.serial_p = serial(chains)  # the reread values carry no turn: left out
        sides[config] = side
    return sides


def judge(sides: dict[str, Side], alpha: float) -> Ruling:
    """What each side's draws show (each side tested at alpha / 2, shared by its two tests)."""
    off, on = (sides[c].departs(alpha / 2) for c in ("off", "on"))
    if off:
        both = " and " + sides["on"].line("on", alpha / 2) if on else ""
        return Ruling("INCONCLUSIVE", [f"base_defect: {sides['off'].line('off', alpha / 2)}{both}: the pipeline's sampler "
                                       "is broken before the flag, so the flag's verdict is void"])
    if on:
        return Ruling("FAIL", [f"sampler_mismatch: {sides['on'].line('on', alpha / 2)}, while the flag-off side's do"])
    return Ruling()


def to_dict(sides: dict[str, Side]) -> dict[str, PitSide]:
    return {config: cast(PitSide, asdict(side)) for config, side in sides.items()}


def ks_uniform(values: list[float]) -> tuple[float, float]:
    """Kolmogorov-Smirnov's D of ``values`` against the uniform distribution on [0, 1), and its p-value (the
    asymptotic distribution with Stephens' small-sample correction)."""
    n = len(values)
    if n == 0:
        return 0.0, 1.0
    xs = sorted(values)
    d = max(max((i + 1) / n - x, x - i / n) for i, x in enumerate(xs))
    lam = (math.sqrt(n) + 0.12 + 0.11 / math.sqrt(n)) * d
    p = 2 * sum((-1) ** (k - 1) * math.exp(-2 * k * k * lam * lam) for k in range(1, 101))
    return d, min(1.0, max(0.0, p))


def serial(chains: Iterable[Sequence[float]]) -> tuple[int, float, float]:
    """The m pairs of consecutive values within each of ``chains`` (a turn's consecutive transformed steps), their
    lag-1 serial correlation about the uniform's mean, r = 12 sum (u - 1/2)(u' - 1/2) / m, and its two-sided p-value.
    Under draws that follow the declared decoding each step's transform is uniform whatever came before it, so the
    products have mean 0 and variance 1/144 and are uncorrelated with each other: r sqrt(m) is asymptotically
    standard normal (the martingale central limit theorem). The p-value is read there from ``NORMAL`` pairs on and,
    below, from ``SIMULATED`` seeded simulations of uniform chains of the same lengths (at 10 pairs in one chain the
    normal reading is not conservative: the test at 0.0125 would reject 0.0175 of the time). A sampler whose steps
    reuse each other's randomness correlates consecutive values (a sharper or flatter one, which moves their mean
    off 1/2, raises r too, as the Kolmogorov-Smirnov test sees better)."""
    import numpy as np

    groups: dict[int, list[Sequence[float]]] = {}
    for chain in chains:
        if len(chain) > 1:
            groups.setdefault(len(chain), []).append(chain)
    if not groups:
        return 0, 0.0, 1.0
    shapes = [(len(g), length) for length, g in groups.items()]
    m = sum(count * (length - 1) for count, length in shapes)
    total = float(_products([np.asarray(g, dtype=np.float64)[None] for g in groups.values()])[0])
    r = 12 * total / m
    if m >= NORMAL:
        return m, r, min(1.0, math.erfc(abs(r) * math.sqrt(m) / math.sqrt(2)))
    rng = np.random.default_rng(0)
    sims = _products([rng.random((SIMULATED, *shape)) for shape in shapes])
    return m, r, float((1 + np.count_nonzero(np.abs(sims) >= abs(total) * (1 - 1e-9))) / (SIMULATED + 1))


def _products(arrays: list[Any]) -> Any:
    """Per row of ``arrays`` (each rows x chains x length): the sum of (u - 1/2)(u' - 1/2) over consecutive pairs."""
    return sum(((a[..., :-1] - 0.5) * (a[..., 1:] - 0.5)).sum(axis=(1, 2)) for a in arrays)
