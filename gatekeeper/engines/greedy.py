"""The greedy loop every built-in adapter shares: prefix-cache reuse, timed prefill and decode,
stop handling, top-2 logits, telemetry. An adapter supplies loading, a fresh state and one forward.
"""

from __future__ import annotations

from abc import abstractmethod
from pathlib import Path
from time import perf_counter
from typing import Any, Sequence

import numpy as np

from .. import __version__
from ..cache import PrefixCache, StateOps, snapshots
from ..cache.results import ResultLayer
from ..errors import GatekeeperError
from ..identity import directory_digest
from ..models import resolve_model
from ..workspace import EngineProfile
from .base import Engine, Generation, checked_request
from .hf_tokenizer import ChatTokenizer
from .plan import segments, splits


class GreedyEngine(Engine):
    """Base of the built-in adapters.

    Prefill plans (``profile.prefill``): ``monolithic`` computes what the cache did not serve in one
    pass, and a hit reuses the whole common prefix. ``aligned`` cuts every prefill, cache on or off,
    where ``plan.splits`` says (registered boundaries, ``chunk`` steps after each); states are
    stored with the cuts that computed them, and a hit lands only on a cut of the query up to which
    those agree. Chaining under ``aligned``: after generating, the state's positions past the
    prompt's last cut were computed in passes a cold run of a longer transcript would not make (the
    prompt's partial last chunk, then one decode step at a time), so what is stored is the state as
    it stood at that last cut; the next turn recomputes this prompt's tail and the reply, in the
    passes of its own cold run.

    Stop rules: generation ends at an EOS id (kept in ``tokens``, left out of ``text``), or once the
    decoded text contains a stop string: ``tokens`` keeps every token up to and including the one
    that completed it, and ``text`` is cut just before the stop string. Token ids are what the gate
    compares, so they record what the model actually produced.

    Hybrid models (a state that cannot be cut back: recurrent or linear-attention layers) reuse a
    prefix only through snapshots (``cache/snapshots.py``): the profile's ``snapshots`` policy
    places them, each prefill is cut where one is taken, and a hit restores the deepest one on the
    prompt and computes the rest. Their pins are lazy: a stage boundary's snapshot is taken, pinned,
    by the first prefill that passes it, so nothing is prefilled outside a request.
    """

    # set by ``_load``
    tok: ChatTokenizer
    state_ops: StateOps
    dtype_name: str
    device_name: str

    def __init__(self, profile: EngineProfile, *, cache: bool = False, workspace_root: Path | None = None):
        super().__init__(profile, cache=cache)
        self._locate(workspace_root)
        self._load()
        self.prefix_cache = PrefixCache(
            self.state_ops, max_entries=profile.cache.max_entries, max_bytes=profile.cache.max_bytes
        )
        # A fresh state tells whether this model's state can be cut back (attention only) or not.
        self.hybrid = not self.state_ops.trimmable(self._new_state())
        self.snapshots = snapshots.SnapshotStore(self.prefix_cache, snapshots.parse(profile.snapshots))
        self._pins: list[tuple[int, ...]] = []
        self._identity: dict[str, Any] | None = None
        self.results: ResultLayer | None = None  # where pinned states are saved and loaded, if anywhere
        self.pin_sources: dict[tuple[int, ...], str] = {}  # pinned prefix -> computed | loaded | recomputed

    # --- what an adapter implements -------------------------------------------------------------
    def _locate(self, workspace_root: Path | None) -> None:
        """Find the model (and LoRA) directories the profile names."""
        self.model_dir = resolve_model(self.profile.model, workspace_root)
        self.adapter_dir = _local_dir(self.profile.adapter_path, workspace_root) if self.profile.adapter_path else None

    @abstractmethod
    def _load(self) -> None:
        """Load model and tokenizer; set ``tok``, ``state_ops``, ``dtype_name``, ``device_name``."""

    @abstractmethod
    def _new_state(self) -> Any:
        """An empty model state (KV cache) for one sequence."""

    @abstractmethod
    def _forward(self, state: Any, tokens: Sequence[int]) -> np.ndarray:
        """Run ``tokens`` on top of ``state`` (extending it); the last position's logits as float32."""

    @abstractmethod
    def _libraries(self) -> dict[str, str]: ...

    # --- text <-> tokens ------------------------------------------------------------------------
    def render(self, messages: Sequence[dict[str, str]]) -> str:
        return self.tok.render(messages)

    def tokenize(self, text: str) -> list[int]:
        return self.tok.tokenize(text)

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self.tok.detokenize(tokens)

    # --- generation -----------------------------------------------------------------------------
    def generate(
        self, prompt: Sequence[int], *, max_tokens: int, stop: Sequence[str] = (), top2: bool = False
    ) -> Generation:
        prompt = checked_request(prompt, max_tokens)
        if self.cache_enabled:
            self._build_pins()

        start = perf_counter()
        state, cached = self._begin(prompt)
        cuts = self._cuts(prompt)
        # Hybrid states are kept as snapshots during the prefill instead (the end is one of them).
        chain_at = cuts[-1] if self.cache_enabled and cuts and not self.hybrid else None
        logits, kept = self._prefill(state, prompt, cached, keep=chain_at)
        prefill_end = perf_counter()

        tokens: list[int] = []
        margins: list[list[list[float]]] | None = [] if top2 else None
        first = prefill_end
        while True:
            tokens.append(pick(logits, margins))
            if len(tokens) == 1:
                first = perf_counter()
            if tokens[-1] in self.eos_ids or len(tokens) >= max_tokens or self.stopped(tokens, stop):
                break
            logits = self._forward(state, tokens[-1:])
        end = perf_counter()

        if self.cache_enabled and not self.hybrid:
            self._store(prompt, tokens, state, kept)

        g = Generation(
            tokens=tokens,
            text=self.final_text(tokens, stop),
            prompt_tokens=len(prompt),
            cached_tokens=cached,
            prefill_s=prefill_end - start,
            decode_s=end - prefill_end,
            ttft_s=first - start,
            top2=margins,
        )
        self.stats.add(g)
        return g

    def _cuts(self, prompt: Sequence[int]) -> list[int] | None:
        """Where this prompt's prefill is cut; None under the monolithic plan (one pass, hit anywhere)."""
        if self.hybrid:
            return self._layout(prompt).cuts
        if self.profile.prefill != "aligned":
            return None
        return splits(prompt, self._pins, self.profile.chunk)

    def _layout(self, prompt: Sequence[int]) -> snapshots.Layout:
        """A hybrid prompt's cuts and snapshot positions (the policy's, from the prompt alone)."""
        aligned = splits(prompt, self._pins, self.profile.chunk) if self.profile.prefill == "aligned" else None
        head = tuple(prompt)
        bounds = [len(b) for b in self._pins if head[: len(b)] == b]
        return snapshots.layout(self.snapshots.policy, prompt, bounds, chunk=self.profile.chunk, aligned_cuts=aligned)

    def _begin(self, prompt: list[int]) -> tuple[Any, int]:
        """A working state and how many prompt tokens it already holds."""
        if self.cache_enabled:
            # Keep at least the last prompt token to compute: its logits start the decoding.
            find = self.snapshots.restore if self.hybrid else self.prefix_cache.lookup
            hit = find(prompt, limit=len(prompt) - 1, at=self._cuts(prompt))
            if hit is not None:
                return hit.state, hit.length
        return self._new_state(), 0

    def _prefill(self, state: Any, prompt: Sequence[int], start: int, keep: int | None = None) -> tuple[np.ndarray, Any]:
        """Compute prompt[start:] on top of ``state`` in the plan's passes: the last position's
        logits, and a private copy of the state as it stood at position ``keep`` (None if not asked)."""
        logits, kept = None, None
        if keep == start:
            kept = self.state_ops.fork(state, keep)
        cuts, layout = self._cuts(prompt) or [], None
        if self.hybrid and self.cache_enabled:
            layout = self._layout(prompt)
            cuts = layout.passes(cache=True)  # a snapshot needs a pass to end where it is taken
        for a, b in segments(cuts, start, len(prompt)):
            logits = self._forward(state, prompt[a:b])
            if b == keep:
                # Taken now, not after decoding: a state that cannot be cut back (recurrent or
                # sliding-window layers) is copied whole here.
                kept = self.state_ops.fork(state, keep)
            if layout is not None and b in layout.snaps:
                self.snapshots.take(prompt[:b], state, pinned=layout.snaps[b], edges=layout.edges(b))
        return logits, kept

    def _store(self, prompt: list[int], tokens: list[int], state: Any, kept: Any) -> None:
        """Chaining: keep a state for the next turn of a transcript that extends this one."""
        cuts = self._cuts(prompt)
        if cuts is None:
            # The state covers prompt + every generated token but the last (never fed back).
            self.prefix_cache.store(prompt + tokens[:-1], state)
        elif kept is not None:
            # Exact only up to the prompt's last cut (see the class docstring).
            self.prefix_cache.store(prompt[: cuts[-1]], kept, edges=cuts)

    @property
    def eos_ids(self) -> frozenset[int]:
        return self.tok.eos_ids

    # --- the prefix cache -----------------------------------------------------------------------
    def pin(self, prefix: Sequence[int]) -> None:
        """Register a stage boundary (with the cache off too: it is a cut of the aligned plan);
        with the cache on, also compute its state once and keep it."""
        key = tuple(int(t) for t in prefix)
        if key and key not in self._pins:
            self._pins.append(key)
            if self.profile.prefill == "aligned":
                self.prefix_cache.drop_covering(key)
        if self.cache_enabled:
            self._build_pins()

    def _build_pins(self) -> None:
        """Compute each registered prefix once (reusing what is stored) and keep it pinned."""
        if self.hybrid:
            return  # lazy: a boundary's snapshot is taken by the first prefill that passes it
        for key in sorted(self._pins, key=len):  # shorter first: a longer one reuses it
            entry = self.prefix_cache.get(key)
            if entry is not None:
                entry.pinned = True
                continue
            cuts = self._cuts(key)
            edges = None if cuts is None else [*cuts, len(key)]
            state, why = self.results.load(key, edges, self.state_ops.load) if self.results else (None, "missing")
            if state is not None and self.state_ops.length(state) != len(key):
                state, why = None, "tampered"
            if state is None:
                state, cached = self._begin(list(key))
                self._prefill(state, key, cached)
                if self.results is not None and self.state_ops.trimmable(state):
                    self.results.save(key, edges, state, self.state_ops.save)
            self.pin_sources[key] = {"loaded": "loaded", "tampered": "recomputed"}.get(why, "computed")
            self.prefix_cache.store(key, state, pinned=True, edges=edges)

    def persist(self, root: Path) -> None:
        """Load pinned prefix states from the result layer under ``root``, and save new ones there."""
        self.results = ResultLayer(root, self.identity())

    def reset_cache(self) -> None:
        self.prefix_cache.reset()

    def unpin(self) -> None:
        self._pins.clear()
        self.prefix_cache.clear()

    # --- identity -------------------------------------------------------------------------------
    def identity(self) -> dict[str, Any]:
        if self._identity is None:
            self._identity = {
                "engine": self.name,
                "engine_version": __version__,
                "libraries": self._libraries(),
                "model_digest": directory_digest(self.model_dir),
                "adapter_digest": directory_digest(self.adapter_dir) if self.adapter_dir else None,
                "dtype": self.dtype_name,
                "device": self.device_name,
                "prefill": self.profile.prefill,
            }
            if self.profile.prefill == "aligned":
                self._identity["chunk"] = self.profile.chunk
            if self.hybrid:  # the policy places pass edges (and interval ones are cold-plan cuts)
                self._identity["snapshots"] = self.snapshots.policy.spec
        return dict(self._identity)

    def close(self) -> None:
        self.prefix_cache.clear()


def pick(logits: np.ndarray, margins: list | None) -> int:
    """Argmax (lowest id on a tie, the same rule for every adapter); optionally record the top two."""
    best = int(np.argmax(logits))
    if margins is not None:
        rest = logits.copy()
        rest[best] = -np.inf
        second = int(np.argmax(rest))
        margins.append([[best, float(logits[best])], [second, float(logits[second])]])
    return best


def _local_dir(spec: str, workspace_root: Path | None) -> Path:
    path = Path(spec).expanduser()
    if not path.is_absolute() and workspace_root is not None:
        path = workspace_root / path
    if not path.is_dir():
        raise GatekeeperError(f"adapter_path {path}: not a directory; point it at a LoRA adapter directory")
    return path
