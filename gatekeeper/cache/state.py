"""What the prefix cache needs to know about an engine's model state, and nothing more.

Each engine supplies one ``StateOps``; the cache never looks inside a state. Attention KV can be
cut back to any shorter length ("trimmable"); recurrent layers cannot, so a state holding them is
reusable only at the exact length it was stored at: such engines keep snapshots at chosen positions
(``snapshots.py``), and ``fork(state, length(state))`` is then a full private copy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol


class StateOps(Protocol):
    def length(self, state: Any) -> int:
        """Tokens the state covers."""

    def nbytes(self, state: Any) -> int:
        """Memory the state holds on to."""

    def trimmable(self, state: Any) -> bool:
        """Whether ``fork(state, n)`` works for every ``n`` below ``length(state)``."""

    def fork(self, state: Any, n: int) -> Any:
        """A private working state equal to the first ``n`` positions of ``state``.

        Running the model on the fork must never change ``state``: share what the model only
        reads, copy what it writes in place.
        """

    def save(self, state: Any, path: Path) -> None:
        """Write the state to a ``.safetensors`` file (the result layer)."""

    def load(self, path: Path) -> Any:
        """A state read back from ``save``'s file, ready to serve like a freshly computed one."""

    def perturb(self, state: Any, size: float, seed: int) -> Any:
        """A private copy of an attention state with relative Gaussian noise of ``size`` (seeded):
        calibration's planted fault. ``size`` 0 gives an exact copy."""

    def drop(self, state: Any, start: int, stop: int) -> Any:
        """A private copy of an attention state without positions [start, stop): a lost block."""
