"""The greedy loop every in-process adapter shares: prefix-cache reuse, timed prefill and decode,
stop handling, top-2 logits, telemetry. An adapter supplies loading, a fresh state and one forward;
``GreedySession`` holds everything that belongs to one configuration.
"""

from __future__ import annotations

from abc import abstractmethod
from pathlib import Path
from time import perf_counter
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping, Sequence

from .. import __version__
from ..cache import PrefixCache, StateOps, snapshots
from ..cache.results import ResultLayer
from ..errors import GatekeeperError
from ..evidence import Top2
from ..identity import Memo, digest, directory_digest, file_digest
from ..setup.models import resolve_model
from ..workspace import EngineProfile
from . import faults
from .base import Engine, Generation, Scored, Session, Until, accelerators, attention_limits, checked_request, top2_rows
from .hf_tokenizer import ChatTokenizer
from .prefill import segments, splits
from .sampler import Draw, Sampler, transform

if TYPE_CHECKING:  # numpy is imported where logits are read: checking a profile or its identity never needs it
    import numpy as np


class GreedySession(Session):
    """One configuration on a ``GreedyEngine`` (see its docstring for the plans): its prefix cache or snapshots, pins, result layer."""

    def __init__(self, model: GreedyEngine, *, cache: bool = False, results: Path | None = None):
        super().__init__(model, cache=cache, results=results)
        self.model: GreedyEngine = model
        self.ops = model.state_ops
        self.profile = model.profile
        self.hybrid = model.hybrid
        self.prefix_cache = PrefixCache(self.ops, max_entries=self.profile.cache.max_entries,
                                        max_bytes=self.profile.cache.max_bytes)
        self.snapshots = snapshots.SnapshotStore(self.prefix_cache, snapshots.parse(self.profile.snapshots))
        self._pins: list[tuple[int, ...]] = []
        # where pinned states are saved and loaded (cache on only: a cold session reuses nothing)
        self.results = ResultLayer(results, model.identity()) if results is not None and cache else None

    # --- generation -----------------------------------------------------------------------------
    def generate(
        self, prompt: Sequence[int], *, max_tokens: int, stop: Sequence[str] = (), top2: bool = False,
        until: Until | None = None, sampling: Draw | None = None,
    ) -> Generation:
        prompt = checked_request(prompt, max_tokens)
        if self.cache:
            self._build_pins()

        start = perf_counter()
        state, cached = self._begin(prompt)
        cuts = self._cuts(prompt)
        # Hybrid states are kept as snapshots during the prefill instead (the end is one of them).
        chain_at = cuts[-1] if self.cache and cuts and not self.hybrid else None
        logits, kept = self._prefill(state, prompt, cached, keep=chain_at)
        prefill_end = perf_counter()
        margins: list[list[list[float]]] | None = [] if top2 else None
        chooser = Chooser(prompt, margins, sampling, self.model.draws_with(sampling) if sampling else None)
        tokens, first = self.model._decode(prompt, state, logits, max_tokens, stop, margins, until, chooser)
        end = perf_counter()

        if self.cache and not self.hybrid:
            self._store(prompt, tokens, state, kept)

        g = Generation(
            tokens=tokens,
            text=self.model.final_text(tokens, stop),
            prompt_tokens=len(prompt),
            cached_tokens=cached,
            prefill_s=prefill_end - start,
            decode_s=end - prefill_end,
            ttft_s=first - start,
            top2=margins,
            draws=chooser.draws,
        )
        self.stats.add(g)
        return g

    def score(self, prompt: Sequence[int], continuation: Sequence[int], top_k: int | None = None) -> Scored:
        """Teacher forcing, through generate's own path: the prompt starts from what this session's cache
        serves (``_begin``: nothing with the cache off) and is prefilled in the plan's passes (``_prefill``),
        so row 0 is the distribution generate's first step picks from; then ``continuation[:-1]`` runs in
        one more pass (``_forward_all``) where generate would feed its tokens back one at a time. Nothing is
        stored for chaining (pins are built as generate builds them; a hybrid prefill takes its snapshots)."""
        import numpy as np

        prompt = checked_request(prompt, 1)
        cont = [int(t) for t in continuation]
        if self.cache:
            self._build_pins()
        state, cached = self._begin(prompt)
        first, _ = self._prefill(state, prompt, cached)
        rows = [first[None, :]]
        if len(cont) > 1:
            rows.append(self.model._forward_all(state, cont[:-1]))
        logits = np.concatenate(rows)[: len(cont)]
        return Scored.from_logits(logits, cont, top_k, cached_tokens=cached)

    def split(self, prompt: Sequence[int], at: int) -> tuple[list[Top2], list[Top2]]:
        whole = self.model._forward_all(self.model._new_state(), list(prompt))[at:]
        state = self.model._new_state()
        self.model._forward(state, list(prompt[:at]))
        return top2_rows(whole), top2_rows(self.model._forward_all(state, list(prompt[at:])))

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
        if self.cache:
            # Keep at least the last prompt token to compute: its logits start the decoding.
            find = self.snapshots.restore if self.hybrid else self.prefix_cache.lookup
            hit = find(prompt, limit=len(prompt) - 1, at=self._cuts(prompt))
            if hit is not None:
                return hit.state, hit.length
        return self.model._new_state(), 0

    def _prefill(self, state: Any, prompt: Sequence[int], start: int, keep: int | None = None) -> tuple[np.ndarray, Any]:
        """Compute prompt[start:] on top of ``state`` in the plan's passes: the last position's
        logits, and a private copy of the state as it stood at position ``keep`` (None if not asked)."""
        logits: np.ndarray | None = None
        kept = None
        if keep == start:
            kept = self.ops.fork(state, keep)
        cuts, layout = self._cuts(prompt) or [], None
        if self.hybrid and self.cache:
            layout = self._layout(prompt)
            cuts = layout.passes(cache=True)  # a snapshot needs a pass to end where it is taken
        for a, b in segments(cuts, start, len(prompt)):
            logits = self.model._forward(state, prompt[a:b])
            if b == keep:
                # Taken now, not after decoding: a state that cannot be cut back (recurrent or
                # sliding-window layers) is copied whole here.
                kept = self.ops.fork(state, keep)
            if layout is not None and b in layout.snaps:
                self.snapshots.take(prompt[:b], state, pinned=layout.snaps[b], edges=layout.edges(b))
        assert logits is not None  # start < len(prompt): at least one pass ran
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

    # --- the prefix cache -----------------------------------------------------------------------
    def pin(self, prefix: Sequence[int]) -> None:
        """Register a stage boundary (with the cache off too: it is a cut of the aligned plan);
        with the cache on, also compute its state once and keep it."""
        key = tuple(int(t) for t in prefix)
        if key and key not in self._pins:
            self._pins.append(key)
            if self.profile.prefill == "aligned":
                self.prefix_cache.drop_covering(key)
        if self.cache:
            self._build_pins()

    def _build_pins(self) -> None:
        """Compute each registered prefix once (reusing what is stored) and keep it pinned; with a
        result layer, load it from there when its key matches, and save what was computed.

        Hybrid models keep a pin as the boundary's snapshot, which the ``boundaries`` policy takes
        pinned (other policies take none there). Without a result layer it is lazy: the first
        prefill that passes the boundary takes it, so nothing is prefilled outside a request. With
        one it is loaded, or prefilled now in the plan's passes and saved, so the next start loads
        it. Either way it is stored with the edges a prompt's own prefill would record (the plan
        cuts a prompt equal to a boundary like one that extends it), so later prompts restore it.
        """
        if self.hybrid and self.results is None:
            return
        for key in sorted(self._pins, key=len):  # shorter first: a longer one reuses it
            if self.hybrid and not self._layout(key).snaps.get(len(key)):
                continue  # the policy keeps no snapshot at boundaries
            entry = self.prefix_cache.get(key)
            if entry is not None:
                self.prefix_cache.pin(entry)
                continue
            cuts = self._cuts(key)
            edges = None if cuts is None else [*cuts, len(key)]
            state, why = self.results.load(key, edges, self.ops.load) if self.results else (None, "missing")
            if state is not None and self.ops.length(state) != len(key):
                state, why = None, "tampered"
            if state is None:
                state, cached = self._begin(list(key))
                self._prefill(state, key, cached)  # hybrid: takes the boundary's snapshot on the way
                if self.results is not None:
                    self.results.save(key, edges, state, self.ops.save)
            self.pin_sources[key] = {"loaded": "loaded", "tampered": "recomputed"}.get(why, "computed")
            # (A snapshot the prefill took is already held: this returns it.)
            self.prefix_cache.store(key, state, pinned=True, edges=edges)

    def held(self) -> tuple[int | None, int | None]:
        return len(self.prefix_cache), self.prefix_cache.nbytes

    def snapshot_stats(self) -> dict[str, Any] | None:
        return self.snapshots.stats.to_dict() if self.hybrid else None

    def close(self) -> None:
        self.prefix_cache.clear()


class FaultSession(GreedySession):
    """A session whose cache hits are broken on purpose (``faults.py``): calibration only.

    Faults act on attention states (a hybrid model's snapshots are not covered)."""

    def __init__(self, model: "GreedyEngine", *, cache: bool = True, fault: faults.Fault, results: Path | None = None):
        super().__init__(model, cache=cache, results=results)
        if model.hybrid:
            raise GatekeeperError(f"{model.profile.where}: calibration plants faults in attention states; "
                                  "this model has recurrent layers (snapshots), which it does not cover")
        self.fault = fault
        self._other: tuple[list[int], Any] | None = None  # the last other_prefix state: a stage's cases share it

    def _begin(self, prompt: list[int]) -> tuple[Any, int]:
        state, cached = super()._begin(prompt)
        if cached < 2:
            return state, cached
        f = self.fault
        if f.kind == "noise":
            state = self.ops.perturb(state, f.size, faults.seed(f, prompt[:cached]))
        elif f.kind == "shift":  # one position short, padded with the token before it
            state = self.ops.fork(state, cached - 1)
            self.model._forward(state, [prompt[cached - 2]])
        elif f.kind == "drop":  # a block of restored positions lost
            start = cached // 2
            state = self.ops.drop(state, start, min(cached - 1, start + faults.BLOCK))
        elif f.kind == "other_prefix":
            other = faults.other_prefix(prompt, cached)
            if self._other is None or self._other[0] != other:  # computed once per prefix, a copy per case
                self._other = (other, self.model._new_state())
                self.model._forward(self._other[1], other)
            state = self.ops.fork(self._other[1], cached)
        return state, cached

    def _store(self, prompt: list[int], tokens: list[int], state: Any, kept: Any) -> None:
        if self.fault.kind != "drop":  # a state with a hole is shorter than its tokens: nothing to key it by
            super()._store(prompt, tokens, state, kept)


class GreedyEngine(Engine):
    """Base of the built-in in-process adapters: a model with one forward; ``GreedySession`` runs it.

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
    by the first prefill that passes it, so nothing is prefilled outside a request; with a result
    layer they are loaded (or computed and saved) up front, as attention states are.
    """

    session_class = GreedySession
    fault_session_class: ClassVar[Callable[..., Session] | None] = FaultSession
    faults = frozenset(faults.KINDS)
    persists = True
    early_stop = True
    samples = True
    options: ClassVar[Mapping[str, str] | None] = {}

    # set by ``_locate`` (None: the simulator, which has no files)
    model_dir: Path | None
    adapter_dir: Path | None
    # set by ``_load``
    tok: ChatTokenizer
    state_ops: StateOps
    dtype_name: str
    device_name: str

    def __init__(self, profile: EngineProfile, *, workspace_root: Path | None = None):
        super().__init__(profile, workspace_root=workspace_root)
        self._locate(workspace_root)
        self._load()
        # A fresh state tells whether this model's state can be cut back (attention only) or not.
        self.hybrid = not self.state_ops.trimmable(self._new_state())
        self._identity: dict[str, Any] | None = None
        if self.model_dir is not None and self.model_dir.is_dir():
            self.window, self.context = attention_limits(self.model_dir)

    # --- what an adapter implements -------------------------------------------------------------
    def _locate(self, workspace_root: Path | None) -> None:
        self.model_dir, self.adapter_dir = self._folders(self.profile, workspace_root)
        self.weights = self.model_dir

    @classmethod
    def _folders(cls, profile: EngineProfile, workspace_root: Path | None) -> tuple[Path, Path | None]:
        """The model (and LoRA) directories the profile names."""
        adapter = _local_dir(profile.adapter_path, workspace_root) if profile.adapter_path else None
        return resolve_model(profile.model, workspace_root), adapter

    @abstractmethod
    def _load(self) -> None:
        """Load model and tokenizer; set ``tok``, ``state_ops``, ``dtype_name``, ``device_name``."""

    def draws_with(self, sampling: Draw) -> Sampler:
        """The sampler one sampled turn draws with: gatekeeper's own, keyed by the draw (an adapter may offer its
        library's own, the one a pipeline built on it runs)."""
        return sampling.sampler()

    @abstractmethod
    def _new_state(self) -> Any:
        """An empty model state (KV cache) for one sequence."""

    @abstractmethod
    def _forward(self, state: Any, tokens: Sequence[int]) -> np.ndarray:
        """Run ``tokens`` on top of ``state`` (extending it); the last position's logits as float32."""

    def _forward_all(self, state: Any, tokens: Sequence[int]) -> np.ndarray:
        """Run ``tokens`` on top of ``state``; the logits at every position (``[len(tokens), vocab]``, float32).
        By default one forward per token (the decode path); adapters that can do it in one pass override it."""
        import numpy as np

        return np.stack([self._forward(state, [t]) for t in tokens])

    @classmethod
    @abstractmethod
    def _libraries(cls, profile: EngineProfile) -> dict[str, str]:
        """Versions of the libraries that run the model (``base.versions``: no import)."""

    def _decode(self, prompt: list[int], state: Any, logits: np.ndarray, max_tokens: int,
                stop: Sequence[str], margins: list | None, until: Until | None = None,
                chooser: "Chooser | None" = None) -> tuple[list[int], float]:
        """Decoding from the prompt's last logits (greedy, or ``chooser``'s draws): the tokens, and when the first
        was picked."""
        choose = chooser or Chooser(prompt, margins, None)
        tokens = [choose(logits, [])]
        first = perf_counter()
        while not self._done(tokens, max_tokens, stop, margins, until):
            logits = self._forward(state, tokens[-1:])
            tokens.append(choose(logits, tokens))
        return tokens, first

    def _done(self, tokens: list[int], max_tokens: int, stop: Sequence[str], margins: list | None = None,
              until: Until | None = None) -> bool:
        return (tokens[-1] in self.eos_ids or len(tokens) >= max_tokens or self.stopped(tokens, stop)
                or (until is not None and until(tokens, margins)))

    # --- text <-> tokens ------------------------------------------------------------------------
    def render(self, messages: Sequence[dict[str, str]]) -> str:
        return self.tok.render(messages)

    def tokenize(self, text: str) -> list[int]:
        return self.tok.tokenize(text)

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self.tok.detokenize(tokens)

    @property
    def eos_ids(self) -> frozenset[int]:  # type: ignore[override]  # read-only here: always the tokenizer's
        return self.tok.eos_ids

    # --- identity -------------------------------------------------------------------------------
    def identity(self) -> dict[str, Any]:
        if self._identity is None:
            assert self.model_dir is not None  # only the simulator has none, and it has its own identity()
            learned = {"dtype": self.dtype_name, "device": self.device_name, "hybrid": self.hybrid}
            key = self._learned_key(self.profile, self.model_dir)
            if _LEARNED.get(key) != learned:
                _LEARNED.put(key, learned)
            self._identity = self._identity_from(self.profile, self.workspace_root, learned, (self.model_dir, self.adapter_dir))
        return dict(self._identity)

    @classmethod
    def identity_of(cls, profile: EngineProfile, *, workspace_root: Path | None = None) -> dict[str, Any] | None:
        """From the files' digests, the profile and the libraries' versions, plus what only a load can
        tell (dtype and device as the framework resolves them here, whether the state can be cut back),
        remembered from the last load of this model configuration on this machine; None before one."""
        folders = cls._folders(profile, workspace_root)
        learned = _LEARNED.get(cls._learned_key(profile, folders[0]))
        return None if learned is None else cls._identity_from(profile, workspace_root, learned, folders)

    @classmethod
    def _learned_key(cls, profile: EngineProfile, model_dir: Path) -> str:
        """Everything a load's dtype, device and hybrid-ness depend on: the adapter, the profile's
        choices, the model's architecture (config.json), the libraries and the machine's accelerators."""
        return digest({"adapter": f"{cls.__module__}:{cls.__qualname__}", "device": profile.device, "dtype": profile.dtype,
                       "config": file_digest(model_dir / "config.json"), "libraries": cls._libraries(profile),
                       "machine": accelerators()})

    @classmethod
    def _identity_from(cls, profile: EngineProfile, workspace_root: Path | None, learned: dict[str, Any],
                       folders: tuple[Path, Path | None]) -> dict[str, Any]:
        """The identity, loaded or not: the one function both ``identity`` and ``identity_of`` use. ``folders``:
        the model and LoRA directories (a loaded engine's own: an adapter may locate them otherwise)."""
        model_dir, adapter_dir = folders
        out = {
            "engine": cls.name,
            "engine_version": __version__,
            "libraries": cls._libraries(profile),
            "model_digest": directory_digest(model_dir),
            "adapter_digest": directory_digest(adapter_dir) if adapter_dir else None,
            "dtype": learned["dtype"],
            "device": learned["device"],
            "prefill": profile.prefill,
            **cls._identity_extra(profile, workspace_root),
        }
        if profile.prefill == "aligned":
            out["chunk"] = profile.chunk
        if learned["hybrid"]:  # the policy places pass edges (and interval ones are cold-plan cuts)
            out["snapshots"] = snapshots.parse(profile.snapshots).spec
        return out

    @classmethod
    def _identity_extra(cls, profile: EngineProfile, workspace_root: Path | None) -> dict[str, Any]:
        """What an adapter's options add to the identity (nothing by default)."""
        return {}


# What loads taught, by ``GreedyEngine._learned_key``.
_LEARNED = Memo("learned.json", keep=256)


class Chooser:
    """How one call picks each next token: greedy (``pick``), or a sampled draw (``sampling``) whose weights go to
    ``draws`` (``Sampler.pick``); either way the raw top two go to ``margins`` when asked."""

    def __init__(self, prompt: Sequence[int], margins: list | None, sampling: Draw | None,
                 sampler: Sampler | None = None):
        self.prompt, self.margins, self.sampling = prompt, margins, sampling
        self.sampler = sampler or (None if sampling is None else sampling.sampler())
        self.draws: list[list[float]] | None = None if sampling is None else []

    def __call__(self, logits: np.ndarray, answer: Sequence[int]) -> int:
        best = pick(logits, self.margins)
        if self.sampling is None or self.sampler is None or self.draws is None:
            return best
        token, weights, lp = self.sampler.pick(logits, self.prompt, answer)
        d, key = self.sampling.decoding, self.sampling.key
        if d.sampled:  # the draw against the declared decoding (gate/stats/pit.py): its own row, unless another sampler drew
            # its own row where it processes as declared (an engine's sampler reads its chain through ``processed``)
            declared = (lp if type(self.sampler).processed is Sampler.processed else
                        Sampler(d, key, self.sampler.spec).processed(logits, self.prompt, answer))
            weights.append(transform(declared, token, key, len(answer)))
        self.draws.append(weights)
        return token


def pick(logits: np.ndarray, margins: list | None) -> int:
    """Argmax (lowest id on a tie, the same rule for every adapter); optionally record the top two."""
    import numpy as np

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
