"""A flag rolled out by steps (the policy's ``rollout:``): which requests the flag-on side serves, the step in force,
and when the guard may raise it.

A request's share is drawn from its key (a header the caller sets, else its conversation) by a hash of the flag and the
key, so one key is on one side for as long as the step holds, a raised step only adds keys (a key served the flag-on
side at 10% is served it at 50%), and two flags split traffic independently. A flip to on starts at the first step;
each raise is a record in the guard's next ledger batch, signed by the service key (``raised``); a rollback is the
guard's flip to off, as without a rollout. The proxy, the Runtime and the OFREP server read the same step.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any, Iterable

from ...identity import canonical_json
from ...shadows import ShadowBatch


def bucket(flag: str, key: str) -> float:
    """Where ``key`` falls for ``flag``, uniform on [0, 1): the flag-on side serves it while this is below the share."""
    return int.from_bytes(hashlib.sha256(f"{flag}\0{key}".encode()).digest()[:8], "big") / 2.0**64


def serves_on(flag: str, key: str, share: float) -> bool:
    return share >= 1 or bucket(flag, key) < share


def step_of(batches: Iterable[ShadowBatch]) -> int:
    """The step in force after a watch's batches (0: the first)."""
    return max((raised.get("step", 0) for b in batches if (raised := (b.get("summary") or {}).get("raised"))), default=0)


def message(flag: str, flip_id: int, step: int, share: float, batches: list[int]) -> bytes:
    """What a raise's signature covers: the flag, the flip it rolls out, the new step and share, and its evidence."""
    return canonical_json({"flag": flag, "flip_id": flip_id, "step": step, "share": share, "batches": batches})


def due(rollout: Any, step: int, compared: int, since: float, now: float | None = None) -> bool:
    """Whether the guard may raise ``step`` now: a step above it, ``compared`` comparisons at it, ``hold_s`` held."""
    now = time.monotonic() if now is None else now
    return (step + 1 < len(rollout.steps) and compared >= rollout.min_comparisons_per_step
            and now - since >= rollout.hold_s)
