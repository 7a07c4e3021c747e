"""The ``mlx`` adapter: mlx-lm's model and KV cache objects, driven by the shared greedy loop.

Metal on Apple Silicon; elsewhere mlx's CPU backend (correct but slow: tests use tiny models).
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any, Sequence

import mlx.core as mx
import mlx_lm
import numpy as np
from mlx_lm.models.cache import KVCache, load_prompt_cache, make_prompt_cache, save_prompt_cache

from ..errors import GatekeeperError
from ..summaries import SamplerChain
from .base import Referenced, versions
from .greedy import GreedyEngine
from .hf_tokenizer import ChatTokenizer
from .sampler import Sampler, log_softmax


class MLXEngine(GreedyEngine):
    name = "mlx"
    options = {"sampler": "gatekeeper (default: keyed draws) or mlx_lm: mlx-lm's own make_sampler and logits "
                          "processors, reseeded from the draw's key each turn, as a pipeline on mlx-lm samples"}

    def _load(self) -> None:
        self.device = _device(self.profile.device)
        on_cpu = self.device == mx.cpu
        self.device_name = "cpu" if on_cpu else ("metal" if sys.platform == "darwin" else "gpu")
        self.dtype_name = self.profile.dtype if self.profile.dtype != "auto" else ("float32" if on_cpu else "bfloat16")
        model, wrapper = self._read_weights(self.dtype_name)
        self.model, self._reference = model, None
        # The wrapped Hugging Face tokenizer: the same text handling as the torch adapter.
        assert self.model_dir is not None  # set by _locate
        self.tok = ChatTokenizer(wrapper._tokenizer, self.model_dir)
        self.state_ops = MLXKV()

    def _new_state(self) -> list[Any]:
        return make_prompt_cache(self.model)

    def _forward(self, state: list[Any], tokens: Sequence[int]) -> np.ndarray:
        with mx.stream(self.device):
            logits = self.model(mx.array([list(tokens)]), cache=state)[0, -1].astype(mx.float32)
            # Evaluate the cache too, or its lazy graph would grow across decode steps.
            mx.eval(logits, [c.state for c in state])
        return np.array(logits)

    def _forward_all(self, state: list[Any], tokens: Sequence[int]) -> np.ndarray:
        """One pass over ``tokens``, keeping every position's logits (teacher-forced scoring)."""
        with mx.stream(self.device):
            logits = self.model(mx.array([list(tokens)]), cache=state)[0].astype(mx.float32)
            mx.eval(logits, [c.state for c in state])
        return np.array(logits)

    def reference(self, sequence, steps, asked, batch=1, own=False):
        """One pass over ``sequence`` with no cache object (mlx-lm's models take ``cache=None``), in float32: the
        engine's own model where it runs in float32, else a float32 copy (``own``: the engine's model as it runs)."""
        model = self.model if own else self._reference_model()
        with mx.stream(self.device):
            logits = model(mx.array([list(sequence)] * batch))[-1, -steps - 1:-1].astype(mx.float32)
            mx.eval(logits)
        return Referenced.of(np.array(logits), asked, "float32" if not own else self.dtype_name, str(self.model_dir))

    def _reference_model(self) -> Any:
        if self.dtype_name == "float32":
            return self.model
        if self._reference is None:
            self._reference, _ = self._read_weights("float32")
        return self._reference

    def _read_weights(self, dtype: str) -> tuple[Any, Any]:
        """mlx-lm's model (adapter fused in by its loader) in ``dtype``, and its tokenizer wrapper."""
        adapter = str(self.adapter_dir) if self.adapter_dir is not None else None
        assert self.model_dir is not None  # set by _locate
        model_type = json.loads((self.model_dir / "config.json").read_text()).get("model_type")
        # passed only when there is one: some releases (0.28.3) take ``model_config=None`` and then update a dict with it
        override = {"model_config": {"model_type": _MLX_TYPES[model_type]}} if model_type in _MLX_TYPES else {}
        # mlx_lm annotates load() as a Union of its 2- and 3-item returns (no overload on return_config)
        model, wrapper = mlx_lm.load(str(self.model_dir), adapter_path=adapter, **override)  # type: ignore[misc,arg-type]
        model.set_dtype(getattr(mx, dtype))
        mx.eval(model.parameters())
        return model, wrapper

    @classmethod
    def sampler_chain(cls, profile) -> SamplerChain | None:
        return MlxLmSampler.SPEC if profile.options.get("sampler") == "mlx_lm" else super().sampler_chain(profile)

    def unsampled(self, decoding) -> str | None:
        if self.profile.options.get("sampler") == "mlx_lm" and (decoding.presence_penalty or decoding.frequency_penalty):
            return "mlx-lm's sampler counts presence and frequency penalties over the prompt too, not the answer as declared"
        return super().unsampled(decoding)

    def draws_with(self, sampling):
        if self.profile.options.get("sampler") == "mlx_lm":
            return MlxLmSampler(sampling.decoding, sampling.key)
        return super().draws_with(sampling)

    @classmethod
    def _libraries(cls, profile) -> dict[str, str]:
        return versions("mlx", "mlx_lm")

    def close(self) -> None:
        super().close()
        self.model = self._reference = None


class MlxLmSampler(Sampler):
    """mlx-lm's own sampler (``make_logits_processors`` then ``make_sampler``, as its ``generate`` runs them), with
    mlx's generator reseeded from the draw's key at each turn's first step: both sides consume the same random
    stream, so they pair where their logits agree, and the draws are read against the declared decoding through
    mlx-lm's documented chain (``SPEC``), whatever the installed release actually does."""

    # mlx_lm.sample_utils (0.26.4 to 0.32): the penalty over every token seen, then top-p, min-p and top-k on the
    # log-probabilities, then the temperature (the same chain mlx_lm.server runs, engines/served/dialects.py)
    SPEC: SamplerChain = {"sampler": "mlx_lm", "chain": ["penalties", "top_p", "min_p", "top_k", "temperature"],
            "window": {"repetition_penalty": "prompt+answer"}, "draw": "mlx's generator, reseeded from the key each turn"}

    def __init__(self, decoding, key):
        from mlx_lm.sample_utils import make_logits_processors, make_sampler

        super().__init__(decoding, key, self.SPEC)
        d = decoding
        self.draw = make_sampler(temp=d.temperature, top_p=d.top_p, min_p=d.min_p, top_k=d.top_k)
        # every token seen: a context window wider than any sequence
        self.processors = make_logits_processors(repetition_penalty=d.repetition_penalty or None,
                                                 repetition_context_size=1 << 30)

    def pick(self, logits, prompt, answer):
        if not answer:
            mx.random.seed((self.key[0] ^ self.key[1]) & 0xFFFFFFFF)
        x = mx.array(np.asarray(logits, dtype=np.float32))[None]
        seen = mx.array([*prompt, *answer])
        for process in self.processors:
            x = process(seen, x)
        token = int(self.draw(x - mx.logsumexp(x, axis=-1, keepdims=True)).item())
        lp = self.processed(logits, prompt, answer)  # the declared row, through mlx-lm's documented chain
        raw = log_softmax(np.asarray(logits, dtype=np.float64))
        # a token the declared decoding gives no chance weighs its raw figure (its transform says it: -1)
        weighed = float(lp[token]) if np.isfinite(lp[token]) else float(raw[token])
        return token, [float(raw[token]), weighed, float(np.max(lp))], lp


# transformers saves the text-only Qwen3.5 models under a ``*_text`` model type; mlx-lm reads the
# same weights and config under the family's name.
_MLX_TYPES = {"qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe"}


class MLXKV:
    """``StateOps`` for mlx-lm's per-layer cache list.

    ``KVCache`` writes new positions into spare capacity in place, so a fork gets slices cut to
    exactly ``n`` positions: its first update then has no room and concatenates into new arrays,
    leaving the stored entry untouched without copying it.
    """

    def length(self, state: list[Any]) -> int:
        # Recurrent layers (``ArraysCache``) report no size; the attention layers carry the length. mlx-lm before
        # 0.24 has no ``size()``: its caches count positions in ``offset``.
        return max((c.size() if hasattr(c, "size") else getattr(c, "offset", 0) for c in state), default=0)

    def nbytes(self, state: list[Any]) -> int:
        # whole buffers, spare capacity included (mlx-lm before 0.24 has no ``nbytes``: its keys and values)
        return sum(c.nbytes if hasattr(c, "nbytes") else sum(getattr(c, k).nbytes for k in ("keys", "values")
                                                             if getattr(c, k, None) is not None) for c in state)

    def trimmable(self, state: list[Any]) -> bool:
        return all(type(c) is KVCache for c in state)

    def fork(self, state: list[Any], n: int) -> list[Any]:
        if not self.trimmable(state):
            if n != self.length(state):
                raise ValueError("a state with non-attention layers can only be reused whole")
            return copy.deepcopy(state)  # a snapshot: recurrent layers are replaced step by step
        out = []
        for c in state:
            f = KVCache()
            if c.keys is not None:
                f.keys, f.values, f.offset = c.keys[..., :n, :], c.values[..., :n, :], n
            out.append(f)
        return out

    def perturb(self, state: list[Any], size: float, seed: int) -> list[Any]:
        out = self.fork(state, self.length(state))
        for i, c in enumerate(out):
            if c.keys is not None:
                c.keys, c.values = (
                    (t.astype(mx.float32) * (1 + size * mx.random.normal(t.shape, key=mx.random.key(seed * 997 + 2 * i + j))))
                    .astype(t.dtype) for j, t in enumerate((c.keys, c.values)))
        return out

    def drop(self, state: list[Any], start: int, stop: int) -> list[Any]:
        out = self.fork(state, self.length(state))
        for c in out:
            if c.keys is not None:
                c.keys, c.values = (mx.concatenate([t[..., :start, :], t[..., stop:, :]], axis=2) for t in (c.keys, c.values))
                c.offset = c.keys.shape[2]
        return out

    def save(self, state: list[Any], path: Path) -> None:
        # Every layer's ``state``: a ``KVCache``'s keys, values and offset, an ``ArraysCache``'s
        # conv and recurrent arrays; ``load_prompt_cache`` rebuilds each class from it.
        save_prompt_cache(str(path), state)

    def load(self, path: Path) -> list[Any]:
        state = load_prompt_cache(str(path))
        # ``mx.load`` is lazy: read the file now, while it is the one the result layer checked.
        mx.eval([c.state for c in state])
        return state


def _device(name: str) -> Any:
    if name == "cpu":
        return mx.cpu
    if name == "auto":
        return mx.gpu if mx.is_available(mx.gpu) else mx.cpu
    # mps and cuda both mean mlx's GPU backend (Metal, or CUDA builds of mlx).
    if not mx.is_available(mx.gpu):
        raise GatekeeperError(f"device: {name}, but mlx has no GPU backend here; use device: auto or cpu")
    return mx.gpu
