"""The ``torch`` adapter: a transformers causal LM from a local directory, greedy by hand."""

from __future__ import annotations

import copy
import inspect
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.cache_utils import DynamicLayer
from transformers.utils import logging as hf_logging

from ..errors import GatekeeperError
from .greedy import GreedyEngine
from .hf_tokenizer import ChatTokenizer, load_tokenizer


class TorchEngine(GreedyEngine):
    name = "torch"

    def _load(self) -> None:
        self.device = _device(self.profile.device)
        self.dtype = _dtype(self.profile.dtype, self.device)
        self.device_name = self.device.type
        self.dtype_name = str(self.dtype).removeprefix("torch.")
        with _no_progress_bars():
            model = AutoModelForCausalLM.from_pretrained(str(self.model_dir), dtype=self.dtype, local_files_only=True)
        if self.adapter_dir is not None:
            model = _merge_lora(model, self.adapter_dir)
        self.model = model.to(self.device).eval()
        self.tok = ChatTokenizer(load_tokenizer(self.model_dir), self.model_dir)
        self.state_ops = TorchKV(self.model.config, self.device)
        # transformers renamed ``past_key_values`` to ``cache``; accept either release.
        params = inspect.signature(self.model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"

    def _new_state(self) -> DynamicCache:
        return DynamicCache(config=self.model.config)

    def _forward(self, state: DynamicCache, tokens: Sequence[int]) -> np.ndarray:
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)
        with torch.inference_mode():
            out = self.model(input_ids=ids, use_cache=True, logits_to_keep=1, **{self._cache_arg: state})
            return out.logits[0, -1].float().cpu().numpy()

    def _libraries(self) -> dict[str, str]:
        libs = {"torch": torch.__version__, "transformers": transformers.__version__}
        if self.adapter_dir is not None:
            import peft

            libs["peft"] = peft.__version__
        return libs

    def close(self) -> None:
        super().close()
        self.model = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


class TorchKV:
    """``StateOps`` for a transformers ``DynamicCache``.

    A fork's layers point at slices of the stored tensors; ``DynamicLayer.update`` concatenates
    into new tensors rather than writing in place, so the stored entry stays as it was without
    copying it.
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

    def save(self, state: DynamicCache, path: Path) -> None:
        if not self.trimmable(state):
            raise ValueError("only attention KV states can be saved")
        tensors = {}
        for i, layer in enumerate(state.layers):
            if layer.is_initialized:
                tensors[f"{i}.keys"], tensors[f"{i}.values"] = layer.keys.contiguous(), layer.values.contiguous()
        save_file(tensors, str(path))

    def load(self, path: Path) -> DynamicCache:
        tensors = load_file(str(path), device=str(self.device))
        state = DynamicCache(config=self.config)
        for i, layer in enumerate(state.layers):
            if f"{i}.keys" in tensors:
                keys, values = tensors[f"{i}.keys"], tensors[f"{i}.values"]
                layer.lazy_initialization(keys, values)
                layer.keys, layer.values = keys, values
        return state


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


@contextmanager
def _no_progress_bars():
    """Loading prints a weights bar on stderr; keep the CLI's output (and --json mode) clean."""
    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()
