"""Each arm's draws against the declared decoding, on that arm alone.

Pairing by seed compares the two sides; it cannot see a sampler both share that ignores a penalty, applies the
temperature twice or filters in another order. So each step of a sampled answer also records the randomized
probability-integral transform of its token under the declared decoding, computed from the logits the arm itself
produced (``sampler.transform``). Over the steps of draws that follow the declared decoding these values are independent
and uniform on [0, 1); a Kolmogorov-Smirnov test per side says whether they are, and a token the declared decoding
gives no chance is a defect on sight. A side whose draws do not follow it: the flag-on side alone, FAIL; the
flag-off side, the pipeline's base is broken (``base_defect:``, never PASS).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

from ..battery.suites import Item
from ..evidence import Run

KEPT = 5  # impossible draws kept in the record per side (the count holds them all)


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

    def departs(self, alpha: float) -> bool:
        return self.impossible > 0 or self.p < alpha

    def line(self, config: str) -> str:
        if self.impossible:
            return (f"the flag-{config} side drew {self.impossible} tokens the declared decoding gives no chance "
                    f"({', '.join(self.where)})")
        return (f"the flag-{config} side's {self.steps} draws do not follow the declared decoding (their probability "
                f"transforms are not uniform: Kolmogorov-Smirnov D {self.statistic:.3g}, p {self.p:.2g})")


def read(items: Iterable[Item], results: dict[str, list[Run]], reread: dict[str, Any] | None = None) -> dict[str, Side] | None:
    """Each side's transforms over its first run's sampled answers, and those ``reread`` from the reference arm's
    rows where a side gave none (``independent.Reread``); None where no answer carries them."""
    sides = {}
    for config in ("off", "on"):
        run, values, side = results[config][0], [], Side()
        if extra := (reread or {}).get(config):
            values += extra.values
            side.impossible, side.where = len(extra.impossible), extra.impossible[:KEPT]
            side.reread, side.undecided = len(extra.values) + len(extra.impossible), extra.undecided
        for item in items:
            r = run.get(item.case_id)
            if not item.suite.decoding.sampled or r is None:
                continue
            for n, turn in enumerate(r["turns"], 1):
                for j, draw in enumerate(turn.get("draws") or []):
                    if len(draw) < 4:  # a server's weight of the draw alone, with no transform
                        continue
                    if draw[3] < 0:
                        side.impossible += 1
                        if len(side.where) < KEPT:
                            side.where.append(f"{item.case_id} turn {n} token {j}")
                    else:
                        values.append(draw[3])
        if not values and not side.impossible:
            return None
        side.steps = len(values) + side.impossible
        side.statistic, side.p = ks_uniform(values)
        sides[config] = side
    return sides


def judge(sides: dict[str, Side], alpha: float, verdict: str, reasons: list[str]) -> tuple[str, list[str]]:
    """The verdict with what each side's draws show (each side tested at alpha / 2)."""
    off, on = (sides[c].departs(alpha / 2) for c in ("off", "on"))
    if off:
        both = " and " + sides["on"].line("on") if on else ""
        return "INCONCLUSIVE", [f"base_defect: {sides['off'].line('off')}{both}: the pipeline's sampler is broken "
                                "before the flag, so the flag's verdict is void"] + reasons
    if on:
        return "FAIL", [f"sampler_mismatch: {sides['on'].line('on')}, while the flag-off side's do"] + reasons
    return verdict, reasons


def to_dict(sides: dict[str, Side]) -> dict[str, Any]:
    return {config: asdict(side) for config, side in sides.items()}


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
