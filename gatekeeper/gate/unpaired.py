"""Sampled draws that do not follow their keys: the sides compared by their distributions, not token by token.

Pairing by seed needs an engine whose draws are a function of their key. Where the flag-off side's repeats under the
same keys part (a server that takes no per-request seed, or drops it), its samples are fresh draws each time, so
the two sides' answers are independent and a token-by-token comparison shows nothing. The evaluation says so
(``unpaired:``) and compares what the draws come from instead:

- each side's draws against the declared decoding (``gate/pit.py``): each samples the declared decoding of the
  logits it computed;
- the teacher-forced distance between the sides (``gate/distance.py``): both compute the same logits on the same
  histories.

Together they say the two sides sample one distribution at the positions read; by Pinsker's inequality the
per-token total variation between their raw next-token distributions is at most sqrt(KL / 2) there. An exact change
PASSes only with both read, the distance within the A/A floor plus the policy's ``max_kld`` (else ``EXACT_KLD``),
judged on its largest KL. A change that is not exact keeps its pass-rate gate: the sides' outcomes of a case are
independent draws, which the paired bound allows (with less power than paired draws).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from . import distance

EXACT_KLD = 1e-4  # nats: an exact change's largest teacher-forced KL above the A/A floor, where the policy sets none


@dataclass
class Unpaired:
    """The sampled cases whose flag-off repeats parted under the same keys, and what compared the sides instead."""

    parted: int  # sampled cases whose flag-off repeats gave other tokens under the same keys
    repeated: int  # sampled cases repeated flag off
    first: str  # the first of them
    positions: int = 0  # teacher-forced positions the sides were compared at
    kld_max: float | None = None  # the largest KL(off||on) among them
    tv_max: float | None = None  # Pinsker's bound on the per-token total variation there

    def line(self) -> str:
        head = (f"unpaired: the flag-off side's draws do not follow their keys ({self.parted} of {self.repeated} "
                f"sampled cases gave other tokens on a repeat under the same keys, the first {self.first}: the engine "
                "takes no per-request seed or drops it), so the sides are compared by their distributions, not token "
                "by token")
        if self.kld_max is None:
            return head
        return (f"{head}: at {self.positions} teacher-forced positions KL(off||on) at most {self.kld_max:.3g}, the "
                f"per-token total variation at most {self.tv_max:.3g} (Pinsker), with each side's draws read against "
                "the declared decoding")

    def judge(self, verdict: str, reasons: list[str], exact: bool, moved: distance.Compared | str | None,
              declared: bool, max_kld: float | None) -> tuple[str, list[str]]:
        """The verdict once the tokens cannot be compared: an exact change needs the distance within its floor and
        both sides' draws read (``declared``); a change that is not exact keeps its gate."""
        if isinstance(moved, distance.Compared) and moved.distance.positions:
            self.positions, self.kld_max = moved.distance.positions, max(0.0, moved.distance.kld.max)
            self.tv_max = math.sqrt(self.kld_max / 2)
        if not exact:
            return verdict, reasons + [self.line()]
        missing = ("the teacher-forced distance " + (f"cannot be read ({moved})" if isinstance(moved, str) else
                                                     "is off in the policy" if moved is None else "read no position")
                   if self.kld_max is None else
                   None if declared else "the draws cannot be read against the declared decoding")
        if missing:
            line = f"{self.line()}; {missing}, so that they sample one distribution cannot be shown"
            return ("INCONCLUSIVE", [line, *reasons]) if verdict == "PASS" else (verdict, [*reasons, line])
        assert isinstance(moved, distance.Compared)
        check = moved.within_floor(distance.Bound(max_kld=max_kld or EXACT_KLD, kld_stat="max"))
        if not check.met:
            return "FAIL", [f"distance: {line}" for line in check.lines] + reasons + [self.line()]
        return verdict, reasons + [self.line()]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
