"""The torch adapter's model state: ``StateOps`` for a transformers ``DynamicCache`` (imported only
once a torch model is loaded, so naming the adapter or computing its identity never imports torch)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as load_bytes
from safetensors.torch import save_file
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

Linear: Any = None  # transformers >= 5.5: linear-attention (recurrent) layers live in the shared cache; before, none
try:
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    Linear = LinearAttentionCacheLayerMixin
except ImportError:
    pass

STATES = ("conv_states", "recurrent_states")


class TorchKV:
    """``StateOps`` for a transformers ``DynamicCache``.

    A fork's layers point at slices of the stored tensors; ``DynamicLayer.update`` concatenates
    into new tensors rather than writing in place, so the stored entry stays as it was without
    copying it.

    ``save`` writes every layer's state: attention keys and values (with a sliding window's
    position count and an indexer's keys), and a linear-attention layer's conv and recurrent
    states with whether it has seen tokens. ``load`` fills a cache built from the config with them,
    so a loaded hybrid snapshot serves like the one computed.

    A linear-attention layer holds one state of each kind (transformers 5.5 to 5.15: a tensor and a flag) or
    several (5.16 on: dicts by index); ``_held`` and ``_put`` read and write both layouts.
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
            for src, dst in zip(_layers(state), _layers(fork)):
                if not src.is_initialized:
                    continue
                keys, values = src.keys[..., :n, :], src.values[..., :n, :]
                dst.lazy_initialization(keys, values)
                dst.keys, dst.values = keys, values
        return fork

    def perturb(self, state: DynamicCache, size: float, seed: int) -> DynamicCache:
        g = torch.Generator().manual_seed(seed)
        out = self.fork(state, self.length(state))  # its tensors are views of the stored entry's: replace, never write
        for layer in _layers(out):
            if layer.is_initialized:
                layer.keys, layer.values = (_noisy(t, size, g) for t in (layer.keys, layer.values))
        return out

    def drop(self, state: DynamicCache, start: int, stop: int) -> DynamicCache:
        out = self.fork(state, self.length(state))
        for layer in _layers(out):
            if layer.is_initialized:
                layer.keys, layer.values = (torch.cat([t[..., :start, :], t[..., stop:, :]], dim=-2)
                                            for t in (layer.keys, layer.values))
        return out

    def save(self, state: DynamicCache, path: Path) -> None:
        tensors: dict[str, torch.Tensor] = {}
        for i, layer in enumerate(_layers(state)):
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
            if _linear(layer):
                for kind in STATES:
                    for j, t in _held(layer, kind).items():
                        tensors[f"{i}.{kind}.{j}"] = t.contiguous()
                previous = layer.has_previous_state
                tensors[f"{i}.has_previous_state"] = torch.tensor(
                    [previous[j] for j in range(layer.number_of_states)] if isinstance(previous, dict) else [previous])
                if isinstance(count := getattr(layer, "cumulative_length_linear", None), torch.Tensor):
                    tensors[f"{i}.cumulative_length_linear"] = count.clone()  # its token count (transformers >= 5.25)
        save_file(tensors, str(path))

    def load(self, path: Path) -> DynamicCache:
        # From bytes, not ``load_file``: its CPU tensors map the file, so an edit made after the
        # result layer checked it would reach the state.
        tensors = {k: t.to(self.device) for k, t in load_bytes(path.read_bytes()).items()}
        state = DynamicCache(config=self.config)
        for i, layer in enumerate(_layers(state)):
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
            if _linear(layer):
                previous = tensors[f"{i}.has_previous_state"].tolist()
                for j in range(len(previous)):
                    for kind in STATES:
                        if (t := tensors.get(f"{i}.{kind}.{j}")) is not None:
                            _put(layer, kind, j, t)
                    _put(layer, "has_previous_state", j, bool(previous[j]))
                if (count := tensors.get(f"{i}.cumulative_length_linear")) is not None:
                    layer.cumulative_length_linear = count
        return state


# Layer fields ``TorchKV.save`` writes (or that the config rebuilds: a sliding window's size).
_SAVED = frozenset({"keys", "values", "indexer_keys", "indexer_position_ids", "conv_states", "recurrent_states",
                    "_sliding_window_tensor", "cumulative_length_linear"})


def _noisy(t: torch.Tensor, size: float, g: torch.Generator) -> torch.Tensor:
    noise = torch.randn(t.shape, generator=g, dtype=torch.float32).to(t.device)
    return (t.float() * (1 + size * noise)).to(t.dtype)


def _layers(state: DynamicCache) -> list[Any]:
    """The cache's layers, of whichever kinds (attention, sliding window, indexed, linear attention): this
    module handles each by what it holds, as ``_tensors`` does."""
    return state.layers


def _tensors(layer: Any) -> list[torch.Tensor]:
    """Every tensor a cache layer holds: attention keys/values, linear-attention conv/recurrent states."""
    out = [getattr(layer, "keys", None), getattr(layer, "values", None)]
    for kind in STATES:
        out.extend(_held(layer, kind).values())
    return [t for t in out if isinstance(t, torch.Tensor)]


def _linear(layer: Any) -> bool:
    return Linear is not None and isinstance(layer, Linear)


def _held(layer: Any, kind: str) -> dict[int, torch.Tensor]:
    """A linear-attention layer's initialised states of one kind by index, in either layout; {} for other layers."""
    states, ready = getattr(layer, kind, None), getattr(layer, f"is_{kind}_initialized", False)
    if isinstance(states, dict) and isinstance(ready, dict):
        return {j: t for j, t in states.items() if ready[j] and isinstance(t, torch.Tensor)}
    return {0: states} if bool(ready) and isinstance(states, torch.Tensor) else {}


def _put(layer: Any, kind: str, j: int, value: Any) -> None:
    """Set state ``j`` of ``kind`` (or ``has_previous_state``) as the layer's layout holds it, with what the layer
    derives from a conv state (its kernel size) and from any state (device and dtype)."""
    if isinstance(getattr(layer, kind), dict):
        getattr(layer, kind)[j] = value
    elif j == 0:
        setattr(layer, kind, value)
    else:
        raise ValueError(f"a {type(layer).__name__} cache layer holds one state of each kind, not {j + 1}")
    if kind == "has_previous_state":
        return
    ready = getattr(layer, f"is_{kind}_initialized")
    if isinstance(ready, dict):
        ready[j] = True
    else:
        setattr(layer, f"is_{kind}_initialized", True)
    layer.device, layer.dtype = value.device, value.dtype
    if kind == "conv_states":
        size = getattr(layer, "conv_kernel_size", None)
        if isinstance(size, dict):
            size[j] = value.shape[-1]
        else:
            layer.conv_kernel_size = value.shape[-1]
