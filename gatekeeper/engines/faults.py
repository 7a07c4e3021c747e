"""Planted faults for calibration: what a broken prefix cache would do to a restored state.

A fault is a session option (``model.session(cache=True, fault=...)``) that selects the adapter's
fault session, a subclass of its normal one; the normal session has no branch a real run could
take by accident, and a real evaluation's identity never names a fault. Kinds, each applied to every
cache hit:

- ``noise:S``: the restored state perturbed by relative Gaussian noise of size S (seeded); S = 0 is
  an exact copy, which must flag nothing;
- ``shift``: the restore one position short, padded with the token before it (right length, last
  position wrong);
- ``drop``: one block of restored positions dropped (a cache block or snapshot lost);
- ``other_prefix``: a state computed from a different prefix of the same length (one token changed).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Sequence

from ..summaries import FaultSpec

KINDS = ("noise", "shift", "drop", "other_prefix")
NOISE = (0.0, 1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1)
BLOCK = 16  # positions a ``drop`` fault loses (a cache block, as servers page them)


@dataclass(frozen=True)
class Fault:
    kind: str
    size: float = 1.0
    seed: int = 0

    @property
    def spec(self) -> str:
        return f"noise:{self.size:g}" if self.kind == "noise" else self.kind

    def to_dict(self) -> FaultSpec:
        return {"kind": self.kind, "size": self.size, "seed": self.seed, "spec": self.spec}


def graded(only: Sequence[Fault] = ()) -> list[Fault]:
    """Every fault a calibration plants, smallest first; with ``only``, those, after the unfaulted run (noise 0,
    which always runs first: the drift every other run is judged against)."""
    if only:
        return [Fault("noise", 0.0), *dict.fromkeys(f for f in only if f != Fault("noise", 0.0))]
    return [*(Fault("noise", s) for s in NOISE), Fault("shift"), Fault("drop"), Fault("other_prefix")]


def parse(spec: str) -> Fault:
    """``shift``, ``drop``, ``other_prefix`` or ``noise:S`` (as ``Fault.spec`` writes them)."""
    kind, _, size = spec.strip().partition(":")
    if kind not in KINDS or (kind == "noise") != bool(size):
        raise ValueError(f"{spec!r}: a fault is one of shift, drop, other_prefix or noise:SIZE (e.g. noise:1e-3)")
    try:
        return Fault(kind, float(size)) if size else Fault(kind)
    except ValueError:
        raise ValueError(f"{spec!r}: the noise size must be a number, e.g. noise:1e-3") from None


def seed(fault: Fault, restored: Sequence[int]) -> int:
    """The noise draw for a hit on ``restored``: fixed by the fault and the tokens, so a case sees the same
    noise whatever ran before it (a calibration that stops cases early plants what a full one does)."""
    return fault.seed + zlib.crc32(b"".join(int(t).to_bytes(4, "little") for t in restored))


def other_prefix(prompt: list[int], n: int) -> list[int]:
    """The first ``n`` prompt tokens with the middle one replaced by its right-hand neighbour (or,
    where that is the same token, the next id): a different prefix of the same length."""
    tokens = list(prompt[:n])
    i = n // 2
    tokens[i] = prompt[i + 1] if prompt[i + 1] != tokens[i] else tokens[i] + 1
    return tokens
