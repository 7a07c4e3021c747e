"""The simulator: the greedy loop and snapshot store of the real adapters over token counts, no model.

Its state is a token count; a forward adds the tokens it was given and counts them as computed.
Everything else (the profile's prefill plan and chunk, the snapshot policy and erase rule, pins,
cache limits, lookups) is the same code the torch and mlx adapters run, so its counts are theirs
for the same trace, and a trace of many thousands of long prompts replays in seconds. Each call
generates one token. Bytes are modelled as ``fixed + per_token * length`` per snapshot (zero
unless given, e.g. measured on the real model).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from .. import __version__
from ..workspace import EngineProfile
from .greedy import GreedyEngine


@dataclass
class Count:
    """A simulated state: how many tokens it holds."""

    n: int = 0


class CountOps:
    """``StateOps`` for ``Count``: never trimmable, like a recurrent state."""

    def __init__(self, fixed: int = 0, per_token: int = 0):
        self.fixed, self.per_token = fixed, per_token

    def length(self, state: Count) -> int:
        return state.n

    def nbytes(self, state: Count) -> int:
        return self.fixed + self.per_token * state.n

    def trimmable(self, state: Count) -> bool:
        return False

    def fork(self, state: Count, n: int) -> Count:
        if n != state.n:
            raise ValueError("a simulated recurrent state can only be reused whole")
        return Count(n)

    def save(self, state: Count, path: Path) -> None:
        raise ValueError("simulated states are not saved")

    def load(self, path: Path) -> Count:
        raise ValueError("simulated states are not saved")

    def perturb(self, state: Count, size: float, seed: int) -> Count:
        raise ValueError("the simulator plants no faults")

    def drop(self, state: Count, start: int, stop: int) -> Count:
        raise ValueError("the simulator plants no faults")


class _NoText:
    """The tokenizer seam: the simulator works on token ids only."""

    eos_ids = frozenset({0})  # the simulated logits always pick id 0: one token per call

    def render(self, messages: Any) -> str:
        raise ValueError("the simulator has no tokenizer; give it token ids")

    def tokenize(self, text: str) -> list[int]:
        raise ValueError("the simulator has no tokenizer; give it token ids")

    def detokenize(self, tokens: Sequence[int]) -> str:
        return ""


class SimEngine(GreedyEngine):
    name = "sim"

    persists = False
    fault_session_class = None  # nothing to perturb in a token count
    faults = frozenset()

    def __init__(self, profile: EngineProfile, *, state_bytes: tuple[int, int] = (0, 0)):
        self._state_bytes = state_bytes
        self.computed = 0  # prompt and decode tokens run through the (absent) model
        super().__init__(profile)

    def _locate(self, workspace_root: Path | None) -> None:
        self.model_dir = self.adapter_dir = None

    def _load(self) -> None:
        self.tok = _NoText()  # type: ignore[assignment]
        self.state_ops = CountOps(*self._state_bytes)
        self.dtype_name, self.device_name = "none", "none"

    def _new_state(self) -> Count:
        return Count()

    def _forward(self, state: Count, tokens: Sequence[int]) -> np.ndarray:
        state.n += len(tokens)
        self.computed += len(tokens)
        return np.zeros(1, dtype=np.float32)

    @classmethod
    def _libraries(cls, profile: EngineProfile) -> dict[str, str]:
        return {}

    def identity(self) -> dict[str, Any]:
        return {"engine": self.name, "engine_version": __version__, "prefill": self.profile.prefill,
                "chunk": self.profile.chunk, "snapshots": self.profile.snapshots}
