"""The ``torch`` adapter: a transformers causal LM from a local directory, greedy by hand."""

from __future__ import annotations

import copy
import inspect
from time import perf_counter
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
import transformers
from safetensors.torch import load as load_bytes
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionCacheLayerMixin

from ..errors import GatekeeperError
from ..identity import directory_digest
from ..setup.models import quiet_loading, resolve_model
from .greedy import GreedyEngine, pick
from .hf_tokenizer import ChatTokenizer, load_tokenizer


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
               "draft_tokens": "tokens the draft proposes per step (default 4)"}

    @classmethod
    def check(cls, profile) -> None:
        super().check(profile)
        opts = profile.options
        if "draft_tokens" in opts and not (isinstance(opts["draft_tokens"], int) and opts["draft_tokens"] > 0):
            raise GatekeeperError(f"{profile.where}: field 'options.draft_tokens': must be a positive integer")
        for key in ("attn_implementation", "draft_model"):
            if key in opts and not (isinstance(opts[key], str) and opts[key]):
                raise GatekeeperError(f"{profile.where}: field 'options.{key}': must be a non-empty string")

    def _load(self) -> None:
        self.device = _device(self.profile.device)
        self.dtype = _dtype(self.profile.dtype, self.device)
        self.device_name = self.device.type
        self.dtype_name = str(self.dtype).removeprefix("torch.")
        opts = self.profile.options
        self.model = self._from_pretrained(self.model_dir)
        if self.adapter_dir is not None:
            self.model = _merge_lora(self.model, self.adapter_dir)
        self.tok = ChatTokenizer(load_tokenizer(self.model_dir), self.model_dir)
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

    def _from_pretrained(self, path: Path) -> Any:
        kwargs = {"attn_implementation": self.profile.options["attn_implementation"]} \
            if "attn_implementation" in self.profile.options else {}
        try:
            with quiet_loading():
                model = AutoModelForCausalLM.from_pretrained(str(path), dtype=self.dtype, local_files_only=True, **kwargs)
        except (ValueError, ImportError) as e:
            if not kwargs:
                raise
            raise GatekeeperError(f"{self.profile.where}: field 'options.attn_implementation': transformers refused "
                                  f"{kwargs['attn_implementation']!r} ({str(e).splitlines()[0]}); use eager or sdpa") from None
        return model.to(self.device).eval()

    def _new_state(self, model: Any = None) -> DynamicCache:
        return DynamicCache(config=(model or self.model).config)

    def _logits(self, model: Any, state: DynamicCache, tokens: Sequence[int], keep: int) -> torch.Tensor:
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)
        with torch.inference_mode():
            out = model(input_ids=ids, use_cache=True, logits_to_keep=keep, **{self._cache_arg: state})
            return out.logits[0].float().cpu()

    def _forward(self, state: DynamicCache, tokens: Sequence[int]) -> np.ndarray:
        return self._logits(self.model, state, tokens, 1)[-1].numpy()

    def _decode(self, prompt, state, logits, max_tokens, stop, margins, until=None):
        if self.draft is None:
            return super()._decode(prompt, state, logits, max_tokens, stop, margins, until)
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

    def _identity_extra(self) -> dict[str, Any]:
        opts = self.profile.options
        extra: dict[str, Any] = {}
        if "attn_implementation" in opts:
            extra["attn_implementation"] = opts["attn_implementation"]
        if self.draft_dir is not None:
            extra["draft"] = {"model_digest": directory_digest(self.draft_dir), "tokens": self.draft_tokens}
        return extra

    def _libraries(self) -> dict[str, str]:
        libs = {"torch": torch.__version__, "transformers": transformers.__version__}
        if self.adapter_dir is not None:
            import peft

            libs["peft"] = peft.__version__
        return libs

    def close(self) -> None:
        super().close()
        self.model = self.draft = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


class TorchKV:
    """``StateOps`` for a transformers ``DynamicCache``.

    A fork's layers point at slices of the stored tensors; ``DynamicLayer.update`` concatenates
    into new tensors rather than writing in place, so the stored entry stays as it was without
    copying it.

    ``save`` writes every layer's state: attention keys and values (with a sliding window's
    position count and an indexer's keys), and a linear-attention layer's conv and recurrent
    states with whether it has seen tokens. ``load`` fills a cache built from the config with them,
    so a loaded hybrid snapshot serves like the one computed.
    """

    def __init__(self, config: Any, device: torch.device):
        self.config, self.device = config, device

    def length(self, state: DynamicCache) -> int:
        return state.get_seq_length()

    def nbytes(self, state: DynamicCache) -> int:
        return sum(t.untyped_storage().nbytes() for layer in state.layers for t in _tensors(layer))

    def trimmable(self, state: DynamicCache) -> bool:
        # Plain attention layers only: sliding windows and recurrent layers cannot be cut back.
        return all(type(layer) is DynamicLayer for layer in state.layers)

    def fork(self, state: DynamicCache, n: int) -> DynamicCache:
        if not self.trimmable(state):
            # A snapshot: linear-attention layers overwrite their conv and recurrent states in
            # place (``copy_``), so only a full copy stays as it was.
            if n != self.length(state):
                raise ValueError("a state with non-attention layers can only be reused whole")
            return copy.deepcopy(state)
        fork = DynamicCache(config=self.config)
        with torch.inference_mode():
            for src, dst in zip(state.layers, fork.layers):
                if not src.is_initialized:
                    continue
                keys, values = src.keys[..., :n, :], src.values[..., :n, :]
                dst.lazy_initialization(keys, values)
                dst.keys, dst.values = keys, values
        return fork

    def perturb(self, state: DynamicCache, size: float, seed: int) -> DynamicCache:
        g = torch.Generator().manual_seed(seed)
        out = self.fork(state, self.length(state))  # its tensors are views of the stored entry's: replace, never write
        for layer in out.layers:
            if layer.is_initialized:
                layer.keys, layer.values = (_noisy(t, size, g) for t in (layer.keys, layer.values))
        return out

    def drop(self, state: DynamicCache, start: int, stop: int) -> DynamicCache:
        out = self.fork(state, self.length(state))
        for layer in out.layers:
            if layer.is_initialized:
                layer.keys, layer.values = (torch.cat([t[..., :start, :], t[..., stop:, :]], dim=-2)
                                            for t in (layer.keys, layer.values))
        return out

    def save(self, state: DynamicCache, path: Path) -> None:
        tensors: dict[str, torch.Tensor] = {}
        for i, layer in enumerate(state.layers):
            for name, value in vars(layer).items():  # a layer kind this does not know is refused, not half saved
                if name not in _SAVED and (isinstance(value, torch.Tensor) or isinstance(value, dict)
                                           and any(isinstance(v, torch.Tensor) for v in value.values())):
                    raise ValueError(f"cannot save a {type(layer).__name__} cache layer: its {name!r} is not handled")
            if getattr(layer, "record_past", False):
                raise ValueError(f"cannot save a {type(layer).__name__} cache layer that records its past")
            if getattr(layer, "is_initialized", False) and layer.keys is not None:
                tensors[f"{i}.keys"], tensors[f"{i}.values"] = layer.keys.contiguous(), layer.values.contiguous()
                if isinstance(layer, DynamicSlidingWindowLayer):
                    tensors[f"{i}.cumulative_length"] = torch.tensor(layer.cumulative_length)
            for name in ("indexer_keys", "indexer_position_ids"):
                if getattr(layer, name, None) is not None:
                    tensors[f"{i}.{name}"] = getattr(layer, name).contiguous()
            if isinstance(layer, LinearAttentionCacheLayerMixin):
                for j in range(layer.number_of_states):
                    for kind in ("conv_states", "recurrent_states"):
                        if getattr(layer, f"is_{kind}_initialized")[j]:
                            tensors[f"{i}.{kind}.{j}"] = getattr(layer, kind)[j].contiguous()
                tensors[f"{i}.has_previous_state"] = torch.tensor(
                    [layer.has_previous_state[j] for j in range(layer.number_of_states)])
        save_file(tensors, str(path))

    def load(self, path: Path) -> DynamicCache:
        # From bytes, not ``load_file``: its CPU tensors map the file, so an edit made after the
        # result layer checked it would reach the state.
        tensors = {k: t.to(self.device) for k, t in load_bytes(path.read_bytes()).items()}
        state = DynamicCache(config=self.config)
        for i, layer in enumerate(state.layers):
            if f"{i}.keys" in tensors:
                keys, values = tensors[f"{i}.keys"], tensors[f"{i}.values"]
                layer.lazy_initialization(keys, values)
                layer.keys, layer.values = keys, values
                if isinstance(layer, DynamicSlidingWindowLayer):
                    layer.cumulative_length = int(tensors[f"{i}.cumulative_length"])
            if f"{i}.indexer_keys" in tensors:
                layer.lazy_initialization_indexer(tensors[f"{i}.indexer_keys"])
                layer.indexer_keys = tensors[f"{i}.indexer_keys"]
            if f"{i}.indexer_position_ids" in tensors:
                layer.indexer_position_ids = tensors[f"{i}.indexer_position_ids"]
            if isinstance(layer, LinearAttentionCacheLayerMixin):
                previous = tensors[f"{i}.has_previous_state"].tolist()
                for j in range(layer.number_of_states):
                    for kind in ("conv_states", "recurrent_states"):
                        if (t := tensors.get(f"{i}.{kind}.{j}")) is not None:
                            getattr(layer, kind)[j] = t
                            getattr(layer, f"is_{kind}_initialized")[j] = True
                            layer.device, layer.dtype = t.device, t.dtype
                    if layer.is_conv_states_initialized[j]:
                        layer.conv_kernel_size[j] = layer.conv_states[j].shape[-1]
                    layer.has_previous_state[j] = bool(previous[j])
        return state


# Layer fields ``TorchKV.save`` writes (or that the config rebuilds: a sliding window's size).
_SAVED = frozenset({"keys", "values", "indexer_keys", "indexer_position_ids", "conv_states", "recurrent_states",
                    "_sliding_window_tensor"})


def _noisy(t: torch.Tensor, size: float, g: torch.Generator) -> torch.Tensor:
    noise = torch.randn(t.shape, generator=g, dtype=torch.float32).to(t.device)
    return (t.float() * (1 + size * noise)).to(t.dtype)


def _tensors(layer: Any) -> list[torch.Tensor]:
    """Every tensor a cache layer holds: attention keys/values, linear-attention conv/recurrent states."""
    out = [getattr(layer, "keys", None), getattr(layer, "values", None)]
    for states in ("conv_states", "recurrent_states"):
        out.extend((getattr(layer, states, None) or {}).values())
    return [t for t in out if isinstance(t, torch.Tensor)]


def _device(name: str) -> torch.device:
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


def _dtype(name: str, device: torch.device) -> torch.dtype:
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
