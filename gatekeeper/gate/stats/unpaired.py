"""Sampled draws that do not follow their keys: the sides compared by their distributions, not token by token.

Pairing by seed needs an engine whose draws are a function of their key. Where the flag-off side's repeats under the
same keys part (a server that takes no per-request seed, or drops it), its samples are fresh draws each time, so
the two sides' answers are independent and a token-by-token comparison shows nothing. The evaluation says so
(``unpaired:``) and compares what the draws come from instead:

- each side's draws against the declared decoding (``gate/stats/pit.py``): each samples the declared decoding of the
  logits it computed;
- the teacher-forced distance between the sides (``gate/stats/distance.py``): both compute the same logits on the same
  histories.

Together they say the two sides sample one distribution at the positions read; from full rows, by Pinsker's
inequality, the per-token total variation between their raw next-token distributions is at most sqrt(KL / 2) there.
From top-k rows (a served engine) the KL is lumped, a lower bound, on which Pinsker bounds nothing: the total variation
is bounded directly instead (``distance.Distance.tv_max``). An exact change PASSes only with both read, the distance
within the A/A floor plus the policy's ``max_kld`` (else ``EXACT_KLD``), judged on its largest KL; from top-k rows also
with the total variation bound within the sqrt(limit / 2) an exact KL within that limit would give. A change that is
not exact keeps its pass-rate gate: the sides' outcomes of a case are independent draws, which the paired bound allows
(with less power than paired draws).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ...evidence import Ruling
from ...summaries import UnpairedSummary
from . import distance

EXACT_KLD = 1e-4  # nats: an exact change's largest teacher-forced KL above the A/A floor, where the policy sets none


@dataclass
class Unpaired:
    """The sampled cases whose flag-off repeats parted under the same keys, and what compared the sides instead."""

    parted: int  # sampled cases whose flag-off repeats gave other tokens under the same keys
    repeated: int  # sampled cases repeated flag off
    first: str  # the first of them
    positions: int = 0  # teacher-forced positions the sides were compared at
    kld_max: float | None = None  # the largest KL(off||on) among them (from top-k rows: a lower bound)
    tv_max: float | None = None  # an upper bound on the per-token total variation there; None: none shown
    tv_from: str | None = None  # how: "Pinsker" (from full rows' exact KL) or "top-k" (shown differences plus the rest)

    def line(self) -> str:
        head = (f"unpaired: the flag-off side's draws do not follow their keys ({self.parted} of {self.repeated} "
                f"sampled cases gave other tokens on a repeat under the same keys, the first {self.first}: the engine "
                "takes no per-request seed or drops it), so the sides are compared by their distributions, not token "
                "by token")
        if self.kld_max is None:
            return head
        tail = "with each side's draws read against the declared decoding"
        if self.tv_from == "Pinsker":
            return (f"{head}: at {self.positions} teacher-forced positions KL(off||on) at most {self.kld_max:.3g}, the "
                    f"per-token total variation at most {self.tv_max:.3g} (Pinsker), {tail}")
        tv = ("no upper bound on the per-token total variation read" if self.tv_max is None else
              f"the per-token total variation at most {self.tv_max:.3g} (the top-k tokens' differences plus both sides' "
              "mass outside them)")
        return (f"{head}: at {self.positions} teacher-forced positions KL(off||on) at least {self.kld_max:.3g} (top-k "
                f"rows, the rest lumped: a lower bound), {tv}, {tail}")

    def judge(self, exact: bool, moved: distance.Compared | str | None, declared: bool, max_kld: float | None) -> Ruling:
        """The ruling once the tokens cannot be compared: an exact change needs the distance within its floor and
        both sides' draws read (``declared``), else a PASS is INCONCLUSIVE; a change that is not exact keeps its gate."""
        lumped = False
        if isinstance(moved, distance.Compared) and moved.distance.positions:
            d = moved.distance
            self.positions, self.kld_max, lumped = d.positions, max(0.0, d.kld.max), d.approximation is not None
            # Pinsker needs the true KL; from a lumped one (a lower bound) it would bound nothing
            self.tv_max, self.tv_from = (d.tv_max, "top-k") if lumped else (math.sqrt(self.kld_max / 2), "Pinsker")
        if not exact:
            return Ruling(notes=[self.line()])
        missing = ("the teacher-forced distance " + (f"cannot be read ({moved})" if isinstance(moved, str) else
                                                     "is off in the policy" if moved is None else "read no position")
                   if self.kld_max is None else
                   None if declared else "the draws cannot be read against the declared decoding")
        if missing:
            return Ruling("INCONCLUSIVE", [f"{self.line()}; {missing}, so that they sample one distribution cannot be "
                                           "shown"], over=("PASS",))
        assert isinstance(moved, distance.Compared)
        limit = max_kld or EXACT_KLD
        check = moved.within_floor(distance.Bound(max_kld=limit, kld_stat="max"))
        if not check.met:
            return Ruling("FAIL", [f"distance: {line}" for line in check.lines], [self.line()])
        # a lumped KL within the limit is a lower bound within it, which shows nothing: the TV bound must show what
        # an exact KL within the limit would (Pinsker: sqrt(limit / 2))
        if lumped and (self.tv_max is None or self.tv_max > math.sqrt(limit / 2)):
            shown = ("no upper bound on the total variation was read" if self.tv_max is None else
                     f"the total variation bound {self.tv_max:.3g} is above the {math.sqrt(limit / 2):.3g} an exact KL "
                     f"within {limit:g} would show")
            line = (f"{self.line()}; the KL read from top-k rows is a lower bound and {shown}, so that they sample one "
                    "distribution cannot be shown")
            return Ruling("INCONCLUSIVE", [line], over=("PASS",))
        return Ruling(notes=[self.line()])

    def to_dict(self) -> UnpairedSummary:
        return UnpairedSummary(parted=self.parted, repeated=self.repeated, first=self.first, positions=self.positions,
                               kld_max=self.kld_max, tv_max=self.tv_max, tv_from=self.tv_from)
