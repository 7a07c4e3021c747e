"""The ``torch`` adapter: a transformers causal LM from a local directory, greedy by hand.

torch and transformers are imported once a model is loaded, not with this module: checking a profile
or computing its identity (``identity_of``) never pays for them. The model state lives in ``torch_kv``."""

from __future__ import annotations

import inspect
from pathlib import Path
from time import perf_counter
from typing import TYPE_CHECKING, Any, Sequence

from ..errors import GatekeeperError
from ..identity import directory_digest
from ..setup.models import quiet_loading, resolve_model
from . import reader
from .base import versions
from .greedy import GreedyEngine, pick
from .hf_tokenizer import ChatTokenizer, load_tokenizer

# the cache implementations ``generate`` may run with (torch_generate.py, imported once a model is loaded)
IMPLEMENTATIONS = ("dynamic", "static", "sliding_window", "hybrid", "quantized")
MAX_CACHE_LEN = 2048

if TYPE_CHECKING:  # numpy is imported where logits are read: checking a profile or its identity never needs it
    import numpy as np


class TorchEngine(GreedyEngine):
    """A transformers causal LM. ``options``: ``attn_implementation`` (transformers' attention
    kernel: eager, sdpa, ...), and ``draft_model`` (a local model directory with the same
    vocabulary) for assisted greedy decoding: the draft proposes ``draft_tokens`` tokens, the
    model checks them in one forward pass and keeps the longest run it agrees with, plus its own
    next token. In exact arithmetic that is plain greedy decoding; in floating point the checking
    pass has another shape, which is what a gate on it measures."""

    name = "torch"
    options = {"attn_implementation": "transformers' attention kernel (eager, sdpa, flash_attention_2, ...)",
               "draft_model": "a local model directory (or 'default') that drafts tokens for assisted greedy decoding",
               "draft_tokens": "tokens the draft proposes per step (default 4)",
               "cache_implementation": "decode with transformers' own generate on this cache class (dynamic, static, "
                                       "sliding_window, hybrid, quantized), the prefix reused through it",
               "max_cache_len": f"the tokens one cache of cache_implementation holds (default {MAX_CACHE_LEN})"}

    def __init__(self, profile, *, workspace_root: Path | None = None):
        self._reference: Any = None  # the cache-free reference model, loaded when first read (``reference``)
        super().__init__(profile, workspace_root=workspace_root)
        if self.generation:  # a cache object reused whole through the prefix cache, never through snapshots
            from .torch_generate import GenerateSession

            self.hybrid = False
            self.session_class = GenerateSession  # type: ignore[misc]  # this model's sessions

    def check_fault(self, fault) -> None:
        if self.generation:
            raise GatekeeperError(f"{self.profile.where}: field 'options.cache_implementation': calibration plants its "
                                  "faults in gatekeeper's own cache, not in transformers' generate path; calibrate a "
                                  "profile without cache_implementation")
        super().check_fault(fault)

    @property
    def generation(self) -> str | None:
        """The cache implementation ``generate`` runs with; None: gatekeeper's own greedy loop."""
        return self.profile.options.get("cache_implementation")

    @property
    def max_cache_len(self) -> int:
        return int(self.profile.options.get("max_cache_len", MAX_CACHE_LEN))

    @classmethod
    def check(cls, profile) -> None:
        super().check(profile)
        opts = profile.options
        if "draft_tokens" in opts and not (isinstance(opts["draft_tokens"], int) and opts["draft_tokens"] > 0):
            raise GatekeeperError(f"{profile.where}: field 'options.draft_tokens': must be a positive integer")
        for key in ("attn_implementation", "draft_model"):
            if key in opts and not (isinstance(opts[key], str) and opts[key]):
                raise GatekeeperError(f"{profile.where}: field 'options.{key}': must be a non-empty string")
        impl = opts.get("cache_implementation")
        if impl is not None and impl not in IMPLEMENTATIONS:
            raise GatekeeperError(f"{profile.where}: field 'options.cache_implementation': {impl!r} is none of "
                                  f"{', '.join(IMPLEMENTATIONS)}")
        if "max_cache_len" in opts and not (impl and isinstance(opts["max_cache_len"], int) and opts["max_cache_len"] > 0):
            raise GatekeeperError(f"{profile.where}: field 'options.max_cache_len': a positive integer, with "
                                  "cache_implementation")
        if impl and profile.prefill != "monolithic":
            raise GatekeeperError(f"{profile.where}: field 'prefill': generate prefills a prompt in one pass, so the "
                                  "flag-off side cannot be cut at stage boundaries; set prefill: monolithic")
        if impl and impl != "dynamic" and opts.get("draft_model"):
            raise GatekeeperError(f"{profile.where}: field 'options.draft_model': transformers' assisted generate takes "
                                  "a dynamic cache only; set cache_implementation: dynamic")

    def _load(self) -> None:
        self.device = _device(self.profile.device)
        self.dtype = _dtype(self.profile.dtype, self.device)
        self.device_name = self.device.type
        self.dtype_name = str(self.dtype).removeprefix("torch.")
        opts = self.profile.options
        assert self.model_dir is not None  # set by _locate
        self.model = self._from_pretrained(self.model_dir)
        if self.adapter_dir is not None:
            self.model = _merge_lora(self.model, self.adapter_dir)
        self.tok = ChatTokenizer(load_tokenizer(self.model_dir), self.model_dir)
        if self.generation:  # the cache API of any release from 4.51 on: nothing of torch_kv's (5.x) is imported
            from .torch_generate import WholeState

            self.state_ops = WholeState()
        else:
            from .torch_kv import TorchKV

            self.state_ops = TorchKV(self.model.config, self.device)
        # transformers renamed ``past_key_values`` to ``cache``; accept either release.
        params = inspect.signature(self.model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self.draft, self.draft_dir = None, None
        if opts.get("draft_model"):
            self.draft_dir = resolve_model(opts["draft_model"], self.workspace_root)
            self.draft = self._from_pretrained(self.draft_dir)
            if self.draft.config.vocab_size != self.model.config.vocab_size:
                raise GatekeeperError(
                    f"{self.profile.where}: field 'options.draft_model': {self.draft_dir} has a vocabulary of "
                    f"{self.draft.config.vocab_size} tokens, the model {self.model.config.vocab_size}; a draft must share "
                    "the model's tokenizer")
        self.draft_tokens = int(opts.get("draft_tokens", 4))
        # assisted decoding and transformers' generate path are greedy here: a sampled suite is refused before it runs
        self.samples = self.draft is None and not self.generation

    def _from_pretrained(self, path: Path) -> Any:
        from transformers import AutoModelForCausalLM

        kwargs = {"attn_implementation": self.profile.options["attn_implementation"]} \
            if "attn_implementation" in self.profile.options else {}
        try:
            with quiet_loading():
                model = AutoModelForCausalLM.from_pretrained(str(path), **{reader.dtype_arg(): self.dtype}, local_files_only=True,
                                                             **kwargs)
        except (ValueError, ImportError) as e:
            if not kwargs:
                raise
            raise GatekeeperError(f"{self.profile.where}: field 'options.attn_implementation': transformers refused "
                                  f"{kwargs['attn_implementation']!r} ({str(e).splitlines()[0]}); use eager or sdpa") from None
        return model.to(self.device).eval()

    def _new_state(self, model: Any = None) -> Any:
        if self.generation:
            from .torch_generate import make_cache

            return make_cache(self.model, self.generation, self.max_cache_len)
        from transformers import DynamicCache

        return DynamicCache(config=(model or self.model).config)

    def _logits(self, model: Any, state: Any, tokens: Sequence[int], keep: int) -> Any:
        import torch

        ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)
        where: dict[str, Any] = {}
        if self.generation:  # a static cache of transformers 4.5x counts its filled slots by their values: say where
            seen = self.state_ops.length(state)
            where["cache_position"] = torch.arange(seen, seen + len(tokens), device=self.device)
        with torch.inference_mode():
            out = model(input_ids=ids, use_cache=True, logits_to_keep=keep, **{self._cache_arg: state}, **where)
        if self.generation:
            state.gatekeeper_seen = seen + len(tokens)  # read by WholeState.length, kept by its deep copies
        return out.logits[0].float().cpu()

    def _forward(self, state: Any, tokens: Sequence[int]) -> np.ndarray:
        return self._logits(self.model, state, tokens, 1)[-1].numpy()

    def _forward_all(self, state: Any, tokens: Sequence[int]) -> np.ndarray:
        """One pass over ``tokens``, keeping every position's logits (teacher-forced scoring)."""
        return self._logits(self.model, state, tokens, len(tokens)).numpy()

    def _decode(self, prompt, state, logits, max_tokens, stop, margins, until=None, chooser=None):
        import numpy as np

        if self.draft is None:
            return super()._decode(prompt, state, logits, max_tokens, stop, margins, until, chooser)
        if self.hybrid:
            raise GatekeeperError(f"{self.profile.where}: field 'options.draft_model': assisted decoding needs a state "
                                  "that can be cut back; this model has recurrent layers")
        tokens = [pick(logits, margins)]
        first = perf_counter()
        drafted = self._new_state(self.draft)
        while not self._done(tokens, max_tokens, stop, margins, until):
            # The draft catches up on what it has not seen, then proposes k tokens greedily.
            seq = [*prompt, *tokens]
            k = min(self.draft_tokens, max_tokens - len(tokens))
            d = self._logits(self.draft, drafted, seq[drafted.get_seq_length():], 1)[-1].numpy()
            proposals = []
            for j in range(k):
                proposals.append(int(np.argmax(d)))
                if j < k - 1:
                    d = self._logits(self.draft, drafted, proposals[-1:], 1)[-1].numpy()
            # One checking pass: the model's logits after the last token and after each proposal.
            checked = self._logits(self.model, state, [tokens[-1], *proposals], k + 1).numpy()
            for i in range(k + 1):
                tokens.append(pick(checked[i], margins))
                if i == k or tokens[-1] != proposals[i] or self._done(tokens, max_tokens, stop, margins, until):
                    break
            # Keep only what holds: every token but the last is in the model's state.
            keep = len(prompt) + len(tokens) - 1
            state.crop(keep - state.get_seq_length())
            if drafted.get_seq_length() > keep:
                drafted.crop(keep - drafted.get_seq_length())
        return tokens, first

    def reference(self, sequence, steps, asked, batch=1, own=False):
        if self._reference is None and not own:  # the same weights (and adapter) loaded once more
            assert self.model_dir is not None  # set by _locate
            self._reference = reader.load(self.model_dir, self.device, adapt=(
                None if self.adapter_dir is None else lambda model: _merge_lora(model, self.adapter_dir)))
        return reader.read(self.model if own else self._reference, sequence, steps, asked, batch, str(self.model_dir))

    def reference_key(self):
        # the weights (and adapter) loaded once more, whatever this engine's dtype, cache or decoding
        return ("transformers", str(self.model_dir), str(self.adapter_dir), str(self.device))

    def stepped(self, sequence, steps, asked):
        if self.generation or not self.recurrent:  # attention over cached keys: a one-pass read computes the same
            return None
        return reader.stepped(self.model, sequence, steps, asked, self._new_state(), self._cache_arg, str(self.model_dir))

    @property
    def recurrent(self) -> bool:
        """Whether the model has recurrent (linear-attention) layers, whose decode runs a recurrence where a one-pass
        read runs a chunked scan."""
        from .torch_kv import _linear

        return any(_linear(layer) for layer in getattr(self._new_state(), "layers", []))

    @classmethod
    def _identity_extra(cls, profile, workspace_root: Path | None) -> dict[str, Any]:
        opts = profile.options
        extra: dict[str, Any] = {}
        if "attn_implementation" in opts:
            extra["attn_implementation"] = opts["attn_implementation"]
        if opts.get("cache_implementation"):
            extra["generate"] = {"cache_implementation": opts["cache_implementation"],
                                 "max_cache_len": int(opts.get("max_cache_len", MAX_CACHE_LEN))}
        if opts.get("draft_model"):
            draft = resolve_model(opts["draft_model"], workspace_root)
            # transformers' assisted generate keeps its own schedule unless draft_tokens is given (None)
            tokens = opts.get("draft_tokens") if opts.get("cache_implementation") else int(opts.get("draft_tokens", 4))
            extra["draft"] = {"model_digest": directory_digest(draft), "tokens": tokens}
        return extra

    @classmethod
    def _libraries(cls, profile) -> dict[str, str]:
        return versions("torch", "transformers", *(["peft"] if profile.adapter_path else []))

    def close(self) -> None:
        super().close()
        self.model = self.draft = self._reference = None
        if self.device.type == "cuda":
            import torch

            torch.cuda.empty_cache()


def _device(name: str) -> Any:
    import torch

    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise GatekeeperError("device: cuda, but torch sees no CUDA device here; use device: auto or cpu")
    if name == "mps" and not torch.backends.mps.is_available():
        raise GatekeeperError("device: mps, but torch sees no MPS device here; use device: auto or cpu")
    return torch.device(name)


def _dtype(name: str, device: Any) -> Any:
    import torch

    # auto: bfloat16 where it is the fast path (CUDA); float32 elsewhere, where bf16 is slow or patchy.
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def _merge_lora(model: Any, adapter_dir: Any) -> Any:
    try:
        from peft import PeftModel
    except ImportError:
        raise GatekeeperError("adapter_path needs the peft package; install it with: pip install peft") from None
    # Merged into the weights, so the forward (and its cache argument) is the plain model's.
    return PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
