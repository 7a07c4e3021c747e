"""The engine contract: a loaded **model** (weights, tokenizer, forward, identity) and the
**sessions** it opens, one per configuration (cache on or off, registered stage boundaries, the
prefix cache or snapshots, the result layer, figures).

What callers need to know about an engine is declared here, with safe defaults, so the gate, the
runtime, ``measure`` and ``replay`` never probe an adapter's internals.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import asdict, dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, ClassVar, ContextManager, Hashable, Iterator, Mapping, Sequence, cast

from ..errors import GatekeeperError
from ..evidence import Generated, Top2
from ..summaries import SamplerChain
from ..workspace import Decoding, EngineProfile
from .faults import Fault
from .sampler import Draw

# The per-call figures an engine may report; ``Engine.observes`` says which it really measures.
FIGURES = ("prompt_tokens", "cached_tokens", "prefill_s", "decode_s")
# Asked after each generated token with the tokens so far and their top-2 logits (None unless asked for).
Until = Callable[[list[int], "list | None"], bool]


@dataclass
class Generation:
    """One greedy call: what came out, and what it cost."""

    tokens: list[int]
    text: str
    prompt_tokens: int
    cached_tokens: int | None  # prompt tokens whose state came from the prefix cache; None: not reported
    prefill_s: float
    decode_s: float
    ttft_s: float
    # per generated step, [[best_id, best_logit], [second_id, second_logit]]; None unless asked
    top2: list[list[list[float]]] | None = None
    replica: str | None = None  # the server that answered, where a side has several
    # sampled decoding: per generated step, what the draw weighed (``sampler.Sampler.pick``); None: greedy
    draws: list[list[float]] | None = None

    def to_dict(self) -> Generated:
        d = asdict(self)
        for optional in ("replica", "draws"):  # left out where unset: greedy records read as before
            if d[optional] is None:
                del d[optional]
        return cast(Generated, d)


@dataclass
class Scored:
    """Teacher-forced next-token log-probabilities (``Session.score``): row ``i`` is the distribution
    after ``prompt + continuation[:i]``, so it scores ``continuation[i]``.

    ``kind`` ``"full"``: ``logprobs`` holds every row whole (float32, ``[len(continuation), vocab]``) and
    ``ids`` is None. ``kind`` ``f"top{k}"``: ``ids`` (int64, ``[n, k]``) and ``logprobs`` (float32,
    ``[n, k]``) are the k likeliest tokens at each position, best first (the lowest id first on a tie, as
    greedy picks). ``token_logprobs`` (float32, ``[n]``): the log-probability of the continuation's own
    token at each position, in both kinds. ``cached_tokens``: prompt tokens the session's prefix cache
    served (None: not reported). numpy arrays, typed ``Any`` so this module never imports numpy.
    """

    tokens: list[int]  # the continuation scored
    kind: str  # "full" or f"top{k}"
    logprobs: Any
    token_logprobs: Any
    ids: Any = None
    cached_tokens: int | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def k(self) -> int | None:
        """The top-k size; None for full rows."""
        return None if self.ids is None else int(self.ids.shape[1])

    @classmethod
    def from_logits(cls, logits: Any, continuation: Sequence[int], top_k: int | None = None,
                    cached_tokens: int | None = None) -> "Scored":
        """From raw logits ``[len(continuation), vocab]`` (any float dtype): log-softmax in float64, kept as float32."""
        import numpy as np

        x = np.asarray(logits, dtype=np.float64)
        if x.ndim != 2 or x.shape[0] != len(continuation):
            raise ValueError(f"logits of shape {x.shape} for a continuation of {len(continuation)} tokens")
        return cls.from_logprobs(log_softmax(x).astype(np.float32), continuation, top_k, cached_tokens)

    @classmethod
    def from_logprobs(cls, logprobs: Any, continuation: Sequence[int], top_k: int | None = None,
                      cached_tokens: int | None = None) -> "Scored":
        """From full log-probability rows; with ``top_k``, only the k likeliest per position are kept."""
        import numpy as np

        lp = np.asarray(logprobs, dtype=np.float32)
        tokens = [int(t) for t in continuation]
        own = lp[np.arange(len(tokens)), tokens] if tokens else np.zeros(0, dtype=np.float32)
        full = cls(tokens=tokens, kind="full", logprobs=lp, token_logprobs=own, cached_tokens=cached_tokens)
        return full if top_k is None else full.top(top_k)

    def top(self, k: int) -> "Scored":
        """The top-k form of full rows (or of a larger top-k)."""
        import numpy as np

        if k < 1:
            raise ValueError(f"top_k is {k}; it must be at least 1")
        if self.ids is None:
            lp = self.logprobs
            k = min(k, lp.shape[1])
            ids = np.empty((len(lp), k), dtype=np.int64)
            for i, row in enumerate(lp):
                # the k largest, best first, the lowest id first among equals (a stable sort of ascending ids)
                cut = row[np.argpartition(-row, k - 1)[k - 1]]
                ids[i] = (near := np.flatnonzero(row >= cut))[np.argsort(-row[near], kind="stable")][:k]
            vals = np.take_along_axis(lp, ids, axis=1)
        else:
            if k > self.ids.shape[1]:
                raise ValueError(f"top{k} from top{self.ids.shape[1]} rows")
            ids, vals = self.ids[:, :k], self.logprobs[:, :k]
        return Scored(tokens=list(self.tokens), kind=f"top{k}", logprobs=vals.astype(np.float32), token_logprobs=self.token_logprobs,
                      ids=ids, cached_tokens=self.cached_tokens)


def log_softmax(logits: Any) -> Any:
    """Each row of ``logits`` as log-probabilities, in float64."""
    import numpy as np

    x = np.asarray(logits, dtype=np.float64)
    top = x.max(axis=-1, keepdims=True)
    return x - top - np.log(np.exp(x - top).sum(axis=-1, keepdims=True))


def top2_rows(logits: Any) -> list[Top2]:
    """Each row's two largest logits as ``[[id, logit], [id, logit]]`` (the lowest id first on a tie, as greedy picks):
    all that a comparison of choices reads, and small enough to cross a worker."""
    import numpy as np

    order = np.argsort(-logits, axis=-1, kind="stable")[:, :2]
    return [[[int(i), float(row[i])] for i in ix] for row, ix in zip(logits, order)]


@dataclass
class Referenced:
    """A cache-free read of one sequence (``Engine.reference``): at each of its last ``steps`` next-token positions,
    the reference's two likeliest tokens and the log-probability it gives each token asked about."""

    top2: list[Top2]  # per position: [[best_id, logprob], [second_id, logprob]]
    asked: list[list[float]]  # per position: the log-probability of each asked id, in the order asked
    dtype: str  # what it computed in (float64 where the model is small enough), or which server read it
    at: list[int] | None = None  # the positions read, among the last ``steps`` (None: all of them)
    gaps: bool = True  # whether an arm's top-2 gap may be judged against this read's (else only clear flips count)

    @classmethod
    def of(cls, logits: Any, asked: Sequence[Sequence[int]], dtype: str, where: str, **kw: Any) -> "Referenced":
        """From a read's logits, one row per position read (``asked`` aligned with them); a row that is not finite
        stops the read, naming ``where`` it came from."""
        import numpy as np

        rows = log_softmax(logits)
        if not np.isfinite(rows).all():
            bad = int(np.nonzero(~np.isfinite(rows).all(-1))[0][0])
            raise GatekeeperError(f"the reference read of {where} gave non-finite logits at position {bad + 1} of "
                                  f"{len(rows)} read")
        return cls(top2_rows(rows), [[float(row[int(t)]) for t in want] for row, want in zip(rows, asked)], dtype, **kw)


@dataclass
class EngineStats:
    """Running totals over a session's life."""

    calls: int = 0
    prompt_tokens: int = 0
    cached_tokens: int | None = 0  # None once a call did not report it
    prefill_s: float = 0.0
    decode_s: float = 0.0

    def add(self, g: Generation) -> None:
        self.calls += 1
        self.prompt_tokens += g.prompt_tokens
        self.cached_tokens = plus(self.cached_tokens, g.cached_tokens)
        self.prefill_s += g.prefill_s
        self.decode_s += g.decode_s


def plus(a: int | None, b: int | None) -> int | None:
    """A running total that stays unknown once one part of it is."""
    return None if a is None or b is None else a + b


# What the requests made now are part of (``stage``, ``stream``): for whoever watches the traffic, never
# an input to the model. A context variable, so each thread (each case the gate runs) keeps its own.
_labels: ContextVar[Mapping[str, str]] = ContextVar("gatekeeper_request_labels", default=MappingProxyType({}))


@contextmanager
def labelled(**labels: str | None) -> Iterator[None]:
    """Requests made inside the block carry these labels (None: not that one, whatever is in force around
    it); a served engine sends them as headers (``X-Gatekeeper-Stage``, ``X-Gatekeeper-Stream``), which
    ``gatekeeper proxy`` records."""
    merged = {**_labels.get(), **labels}
    token = _labels.set({k: str(v) for k, v in merged.items() if v is not None})
    try:
        yield
    finally:
        _labels.reset(token)


def request_labels() -> dict[str, str]:
    """The labels in force (``labelled``)."""
    return dict(_labels.get())


def versions(*distributions: str) -> dict[str, str]:
    """Installed versions by distribution name, as the package metadata says (no import needed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return {name: version(name) for name in distributions}
    except PackageNotFoundError as e:
        raise GatekeeperError(f"the {e.name} package is not installed; install it: pip install {e.name}") from None


# Variables that hide accelerators from a framework (CUDA, ROCm, oneAPI, Metal's MLX).
_HIDING = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "ZE_AFFINITY_MASK", "MLX_DEVICE")


def accelerators() -> dict[str, Any]:
    """What decides which accelerator an in-process framework finds here: the platform, the device
    nodes GPU drivers make, and the variables that hide devices. What loading learns on this machine
    is remembered under it, so a GPU that comes or goes is learned afresh."""
    import os
    import platform

    try:
        nodes = sorted(n for n in os.listdir("/dev") if n.startswith(("nvidia", "kfd", "dri", "accel")))
    except OSError:
        nodes = []
    return {"system": platform.system(), "machine": platform.machine(), "devices": nodes,
            "env": {k: os.environ[k] for k in _HIDING if k in os.environ}}


def checked_request(prompt: Sequence[int], max_tokens: int) -> list[int]:
    """The prompt as plain ints, once it is known that there is something to generate."""
    if not prompt:
        raise GatekeeperError("empty prompt: there is nothing to generate from")
    if max_tokens < 1:
        raise GatekeeperError(f"max_tokens is {max_tokens}; it must be at least 1")
    return [int(t) for t in prompt]


class Session(ABC):
    """One configuration's run on a loaded model.

    ``cache=False``: every call starts from a fresh state. ``cache=True``: the session's prefix
    cache serves whatever prefix it holds. ``results``: the result layer's folder, where pinned
    prefix states are loaded from and saved to (engines that declare ``persists``). Sessions of
    one model share nothing but the model.
    """

    def __init__(self, model: "Engine", *, cache: bool = False, results: Path | None = None):
        self.model = model
        self.cache = cache
        self.stats = EngineStats()
        # pinned prefix -> where its state came from: computed | loaded | recomputed
        self.pin_sources: dict[tuple[int, ...], str] = {}

    @abstractmethod
    def generate(
        self, prompt: Sequence[int], *, max_tokens: int, stop: Sequence[str] = (), top2: bool = False,
        until: Until | None = None, sampling: Draw | None = None,
    ) -> Generation:
        """Greedy decoding of up to ``max_tokens`` tokens; stops at EOS or a stop string, and, on engines
        that declare ``early_stop``, as soon as ``until(tokens, top2)`` is true (others decode on).
        ``sampling`` (engines that declare ``samples``): the turn's declared decoding and its key instead of
        greedy; the answer's ``draws`` say what each drawn token weighed."""

    def score(self, prompt: Sequence[int], continuation: Sequence[int], top_k: int | None = None) -> Scored | None:
        """Teacher forcing: this configuration reads ``prompt + continuation`` without decoding, and gives the
        next-token log-probabilities at each position of ``continuation`` (``Scored``: full rows, or with
        ``top_k`` the k likeliest per position and the continuation's own token). The session's
        configuration applies as in ``generate``: its prefix cache serves the prompt's prefix, its prefill
        plan cuts the prompt. None (the default): this engine cannot observe them (a server's, ...)."""
        return None

    def split(self, prompt: Sequence[int], at: int) -> tuple[list[Top2], list[Top2]] | None:
        """The top-2 logits after each of ``prompt[at:]`` computed in one prefill pass from an empty state, and with
        the prefill cut at ``at`` (``prompt[:at]``, then the rest on top: what reusing a cached ``prompt[:at]`` runs),
        a row per position (``top2_rows``). None (the default): this engine's passes are not its caller's to choose
        (a server's)."""
        return None

    def pin(self, prefix: Sequence[int]) -> None:
        """Register a stage's static prefix: a boundary of the prefill plan whether the cache is on
        or off (call it in both), and with the cache on a state computed once and never evicted."""

    def held(self) -> tuple[int | None, int | None]:
        """States this session holds and their bytes; None where the cache lives elsewhere (a server)."""
        return None, None

    def snapshot_stats(self) -> dict[str, Any] | None:
        """Snapshots taken, restored and erased (hybrid models); None where there are none."""
        return None

    def close(self) -> None:
        """Drop every state this session holds."""

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Engine(ABC):
    """A loaded model behind a chat template and a tokenizer; ``session()`` runs it.

    Subclasses set ``session_class`` and may override the declarations below.
    """

    name: ClassVar[str] = "engine"
    session_class: ClassVar[type[Session]]
    concurrency: int = 1  # calls a session may have in flight at once (the gate runs that many cases)
    hybrid: bool = False  # a state that cannot be cut back: prefixes are reused through snapshots
    persists: bool = False  # pinned prefix states can be saved to and loaded from the result layer
    observes: ClassVar[frozenset[str]] = frozenset(FIGURES)  # the figures its calls really measure
    granularity: int = 1  # the prefix cache reuses whole multiples of this many tokens (a server's KV block)
    window: int | None = None  # the model's sliding attention window in tokens, where it has one (cache probes)
    context: int | None = None  # the most tokens (prompt and answer) one call may hold; None: not known
    notices: Sequence[str] = ()  # what its answers showed that the figures cannot (telemetry_suspect:, not_observable:)
    # profile ``options`` the adapter understands (name -> what it does); None: any (a plugin's own)
    options: ClassVar[Mapping[str, str] | None] = None
    # calibration: the session class that plants faults (its constructor also takes ``fault``), and the
    # fault kinds it knows (none: cannot)
    fault_session_class: ClassVar[Callable[..., Session] | None] = None
    faults: ClassVar[frozenset[str]] = frozenset()
    samples: bool = False  # generate() takes a ``sampling`` draw (declared decoding, paired keys)
    early_stop: ClassVar[bool] = False  # generate() honours ``until`` (calibration stops a flagged case there)
    weights: Path | None = None  # the local weights it loads (a file or a model folder); None: a server's
    dialect_name: str | None = None  # served engines: the kind of server (vllm, llamacpp, mlx, ...)
    score_caveat: str | None = None  # what its teacher-forced distributions leave out, where it gives them

    def __init__(self, profile: EngineProfile, *, workspace_root: Path | None = None):
        self.profile = profile
        self.workspace_root = workspace_root

    @classmethod
    def check(cls, profile: EngineProfile) -> None:
        """Refuse, before anything is loaded, a profile this adapter cannot honour."""
        if cls.options is None:
            return
        unknown = sorted(set(profile.options) - set(cls.options))
        if unknown:
            accepts = "; ".join(f"{k} ({v})" for k, v in cls.options.items()) or "no options"
            raise GatekeeperError(f"{profile.where}: field 'options.{unknown[0]}': the {cls.name} adapter does not "
                                  f"understand it; it accepts: {accepts}")

    def session(self, *, cache: bool = False, results: Path | None = None, fault: Fault | None = None) -> Session:
        """A fresh session: nothing cached, nothing registered. ``fault``: a planted fault
        (calibration only), which selects the adapter's fault session."""
        if fault is None:
            return self.session_class(self, cache=cache, results=results if self.persists else None)
        self.check_fault(fault)
        assert self.fault_session_class is not None  # check_fault refuses an adapter without one
        return self.fault_session_class(self, cache=cache, fault=fault, results=results if self.persists else None)

    def background(self, cache: bool, prompts: Sequence[tuple[list[int], int, Decoding | None]],
                   workers: int) -> ContextManager[Any]:
        """Background traffic kept in flight on the deployment a ``session(cache=...)`` talks to, while
        the ``with`` block runs: ``workers`` requests at a time, drawn in turn from ``prompts`` (token ids,
        max tokens, and a sampled decoding they draw with no seed, or None: greedy). Only served engines batch other
        people's requests with the battery's."""
        raise GatekeeperError(f"the {self.name} adapter runs the model in this process, one request at a time: a load "
                              "(policy 'load', evaluate --load) needs a served engine (adapter http)")

    def unscored(self) -> str | None:
        """Why its sessions give no teacher-forced distributions (``Session.score``); None: they give them."""
        return None if self.session_class.score is not Session.score else f"the {self.name} adapter gives none"

    def reference(self, sequence: Sequence[int], steps: int, asked: Sequence[Sequence[int]],
                  batch: int = 1, own: bool = False) -> Referenced | None:
        """``sequence`` read in ONE forward pass with no cache object at all (eager attention, float32 or float64),
        at the positions that predict its last ``steps`` tokens (``asked``: ids per position); ``batch`` copies
        of it side by side, the last one read (a floor: the same read under another batch shape); ``own``: read
        by the model as this engine runs it (its dtype and kernels), still with no cache: what precision alone
        moves. None: this adapter has no such read (``unreferenced`` says why)."""
        return None

    def reference_key(self) -> Hashable:
        """What ``reference`` reads with: engines with equal keys give the same cache-free read of a sequence, so the
        reference arm reads an answer both arms gave once. Default: this engine alone."""
        return id(self)

    def stepped(self, sequence: Sequence[int], steps: int, asked: Sequence[Sequence[int]]) -> Referenced | None:
        """The engine's own model (its dtype and kernels) reading the last ``steps`` tokens of ``sequence`` as its decode
        does, one token at a time on a fresh cache of its library's default kind (nothing reused, none of the
        pipeline's cache handling), where that decode runs another algorithm than a one-pass read (recurrent layers: a
        recurrence against a chunked scan): what the reference arm's floor is calibrated on. None where a one-pass read
        (``reference(own=True)``) computes what a decode step does, or the adapter has no such read."""
        return None

    @classmethod
    def sampler_chain(cls, profile: EngineProfile) -> SamplerChain | None:
        """The sampler a sampled suite runs through, as the identity records it (its chain order and what each penalty
        counts); None where this adapter decodes greedy only. In process it is gatekeeper's own (``sampler.chain``)."""
        from .sampler import chain

        return chain() if cls.samples else None

    def unsampled(self, decoding: Decoding) -> str | None:
        """Why this engine cannot run a sampled ``decoding`` as declared; None: it can."""
        return None if self.samples else "decodes greedy only as configured"

    def sampler(self) -> SamplerChain | None:
        """The sampler this loaded engine runs a sampled suite through, as its record names it."""
        return type(self).sampler_chain(self.profile)

    def unreferenced(self) -> str | None:
        """Why this engine gives no cache-free reference read (``reference``); None: it gives one."""
        return None if type(self).reference is not Engine.reference else f"the {self.name} adapter has none yet"

    def check_fault(self, fault: Fault) -> None:
        """Exit 2 unless this adapter can plant ``fault`` (before any model time is spent on it)."""
        if self.fault_session_class is None or fault.kind not in self.faults:
            raise GatekeeperError(f"the {self.name} adapter cannot plant a {fault.kind!r} fault "
                                  f"({'it plants: ' + ', '.join(sorted(self.faults)) if self.faults else 'its cache is not in this process'}); "
                                  "planting faults needs an in-process engine: torch, mlx or llamacpp")

    # --- text <-> tokens ------------------------------------------------------------------------
    @abstractmethod
    def render(self, messages: Sequence[dict[str, str]]) -> str:
        """The chat template applied to ``messages``, ending with the assistant's turn opening."""

    @abstractmethod
    def tokenize(self, text: str) -> list[int]:
        """Token ids of already-rendered text (no special tokens added)."""

    @abstractmethod
    def detokenize(self, tokens: Sequence[int]) -> str: ...

    # --- stop rules, for adapters that decode token by token --------------------------------------
    eos_ids: frozenset[int] = frozenset()

    def stopped(self, tokens: list[int], stop: Sequence[str]) -> bool:
        """Whether the decoded text now contains a stop string."""
        if not stop:
            return False
        text = self.detokenize(tokens)
        return any(s and s in text for s in stop)

    def final_text(self, tokens: list[int], stop: Sequence[str]) -> str:
        """The answer's text: an ending EOS left out (its id stays in ``tokens``), cut before a stop string."""
        body = tokens[:-1] if tokens and tokens[-1] in self.eos_ids else tokens
        text = self.detokenize(body)
        cuts = [text.find(s) for s in stop if s and s in text]
        return text[: min(cuts)] if cuts else text

    @abstractmethod
    def identity(self) -> dict[str, Any]:
        """What makes the outputs what they are: engine name/version, library versions,
        weight/tokenizer digest, adapter digest, dtype, device, prefill plan."""

    @classmethod
    def identity_of(cls, profile: EngineProfile, *, workspace_root: Path | None = None) -> dict[str, Any] | None:
        """The identity a model loaded from ``profile`` would report, byte for byte, found without loading
        its weights; None where this adapter cannot tell without loading (the default: callers then load it)."""
        return None

    def close(self) -> None:
        """Release the model."""

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def attention_limits(folder: Path) -> tuple[int | None, int | None]:
    """A Hugging Face model folder's sliding attention window and context length (config.json), None where
    it has none or does not say (Qwen2-style configs name a window they do not use)."""
    import json

    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None, None
    config = {**config, **(config.get("text_config") or {})}
    window = config.get("sliding_window") or config.get("attention_chunk_size")
    if config.get("use_sliding_window") is False:
        window = None
    context = config.get("max_position_embeddings")
    return (int(window) if isinstance(window, int) and window > 0 else None,
            int(context) if isinstance(context, int) and context > 0 else None)
