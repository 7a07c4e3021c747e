"""The torch adapter on transformers' own ``generate`` with the cache class a pipeline uses
(``options.cache_implementation``), instead of gatekeeper's own greedy loop over a ``DynamicCache``.

The flag-off side calls ``generate`` on the whole prompt with a fresh cache of that implementation; the flag-on side
computes each stage's static prefix once into such a cache (one forward, as transformers' prompt-reuse recipe does),
and hands ``generate`` a deep copy of it with the whole prompt, so ``generate`` prefills only the rest and decodes on
top of the reused prefix. Both sides use one cache size (``max_cache_len``), so reuse is the only difference.

Written against the cache API of every transformers release from 4.51 on (constructors are asked what they take),
so the same path runs in an environment made for an older release (``python:``). Imported once a model is loaded.
"""

from __future__ import annotations

import copy
import inspect
from time import perf_counter
from typing import Any, Sequence

import torch

from ..errors import EngineCrash, GatekeeperError, described, internal
from .base import Generation, Until, checked_request
from .greedy import GreedySession, pick

# the cache implementations, and the transformers class that holds each (5.x folds the static kinds into StaticCache)
CLASSES = {"dynamic": "DynamicCache", "static": "StaticCache", "sliding_window": "SlidingWindowCache",
           "hybrid": "HybridCache", "quantized": "QuantizedCache"}


def make_cache(model: Any, implementation: str, max_cache_len: int) -> Any:
    """An empty cache of ``implementation`` for one sequence of up to ``max_cache_len`` tokens."""
    from transformers import cache_utils

    cls = getattr(cache_utils, CLASSES[implementation], None)
    if cls is None and implementation in ("sliding_window", "hybrid"):
        cls = cache_utils.StaticCache  # 5.x: a static cache takes its sliding layers from the config
    if cls is None:
        raise GatekeeperError(f"transformers {_version()} has no {CLASSES[implementation]}")
    offered = {"config": model.config, "max_batch_size": 1, "batch_size": 1, "max_cache_len": max_cache_len,
               "device": model.device, "dtype": model.dtype}
    params = inspect.signature(cls.__init__).parameters
    if implementation == "quantized":
        if "backend" not in params:  # 4.x: a config object and a class per backend
            raise GatekeeperError(f"options.cache_implementation: quantized is run through transformers 5's "
                                  f"QuantizedCache; transformers {_version()} builds it otherwise")
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        offered |= {"backend": "quanto", "nbits": 4, "q_group_size": min(64, head)}  # groups within one head
    try:
        return cls(**{k: v for k, v in offered.items() if k in params})
    except ImportError as e:  # a quantized cache's backend
        raise GatekeeperError(f"options.cache_implementation: {implementation}: {e}; install its backend "
                              "(optimum-quanto) in the engine's environment") from None


def _version() -> str:
    import transformers

    return transformers.__version__


class WholeState:
    """``StateOps`` for a cache object reused whole: a static cache cannot be cut back, so a stored prefix serves only
    a prompt that extends all of it, through a deep copy. No faults are planted on this path."""

    def length(self, state: Any) -> int:
        # what gatekeeper's own forwards wrote (TorchEngine._logits); a static cache of 4.5x counts non-zero slots
        return int(getattr(state, "gatekeeper_seen", None) or state.get_seq_length())

    def nbytes(self, state: Any) -> int:
        seen: dict[int, int] = {}

        def walk(v: Any) -> None:
            if isinstance(v, torch.Tensor):
                try:
                    seen[v.untyped_storage().data_ptr()] = v.untyped_storage().nbytes()
                except RuntimeError:  # a tensor subclass with no storage of its own (a quantized cache's)
                    seen[id(v)] = v.numel() * v.element_size()
            elif isinstance(v, (list, tuple)):
                for x in v:
                    walk(x)
            elif hasattr(v, "__dict__") and not isinstance(v, type):
                for x in vars(v).values():
                    walk(x)

        walk(state)
        return sum(seen.values())

    def trimmable(self, state: Any) -> bool:
        return False

    def fork(self, state: Any, n: int) -> Any:
        if n != self.length(state):
            raise ValueError("a cache of transformers' generate path is reused whole")
        return copy.deepcopy(state)

    def _none(self, *args: Any) -> Any:
        raise GatekeeperError("options.cache_implementation: calibration's planted faults and the result layer work on "
                              "gatekeeper's own cache; remove cache_implementation to calibrate")

    save = load = perturb = drop = _none


class GenerateSession(GreedySession):
    """A configuration on ``generate``: the prefix cache (pins) holds caches of the implementation; each call hands
    ``generate`` a copy of the longest one the prompt extends (cache on), or a fresh one (off)."""

    model: Any  # the TorchEngine that opened it (torch.py imports this module: no import back)

    def generate(self, prompt: Sequence[int], *, max_tokens: int, stop: Sequence[str] = (), top2: bool = False,
                 until: Until | None = None, sampling: Any = None) -> Generation:
        prompt = checked_request(prompt, max_tokens)
        if self.cache:
            self._build_pins()
        start = perf_counter()
        state, cached = self._begin(prompt)
        margins: list[list[list[float]]] = []
        try:
            tokens, first = run_generate(self.model, prompt, state, max_tokens, stop, margins, until)
        except (RuntimeError, ValueError, IndexError) as e:  # transformers failed the request: a crash on this side
            if bug := internal(e):  # unless gatekeeper's own code raised it
                raise bug from e
            raise EngineCrash.raised("transformers generate", described(e), len(prompt), max_tokens) from None
        end = perf_counter()
        g = Generation(tokens=tokens, text=self.model.final_text(tokens, stop), prompt_tokens=len(prompt),
                       cached_tokens=cached, prefill_s=first - start, decode_s=end - first, ttft_s=first - start,
                       top2=margins if top2 else None)
        self.stats.add(g)
        return g


def run_generate(engine: Any, prompt: list[int], state: Any, max_tokens: int, stop: Sequence[str],
                 margins: list, until: Until | None) -> tuple[list[int], float]:
    """``generate`` greedy from ``state``: the tokens and when the first was picked. Each kept token's top-2 goes to
    ``margins`` (from the logits ``generate`` returns); EOS, a stop string or ``until`` (asked with the tokens so far
    only: the margins are read once it returns) ends it."""
    from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

    n, first = len(prompt), []
    size = engine.max_cache_len
    if engine.generation not in ("dynamic", "quantized") and n + max_tokens > size:
        raise GatekeeperError(f"{engine.profile.where}: field 'options.max_cache_len': a {engine.generation} cache of "
                              f"{size} tokens cannot hold this call's {n} prompt tokens and {max_tokens} to generate; "
                              "raise it")

    class Watch(LogitsProcessor):  # the first call ends the prefill
        def __call__(self, input_ids: Any, scores: Any) -> Any:
            first.append(perf_counter())
            return scores

    class Done(StoppingCriteria):
        def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
            done = engine._done(input_ids[0, n:].tolist(), max_tokens, stop, margins, until)
            return torch.tensor([done], dtype=torch.bool, device=input_ids.device)

    ids = torch.tensor([prompt], dtype=torch.long, device=engine.device)
    eos = sorted(engine.eos_ids)
    with torch.inference_mode():
        out = engine.model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, **{engine._cache_arg: state},
            do_sample=False, num_beams=1, logits_processor=LogitsProcessorList([Watch()]),
            stopping_criteria=StoppingCriteriaList([Done()]), eos_token_id=eos or None,
            pad_token_id=eos[0] if eos else 0, return_dict_in_generate=True, output_logits=True, **_assisted(engine))
    # one row per token kept (assisted decoding scores drafts it then rejects: only the kept rows come back)
    for row in out.logits:
        pick(row[0].float().cpu().numpy(), margins)
    return out.sequences[0, n:].tolist(), first[0]


def _assisted(engine: Any) -> dict[str, Any]:
    """Assisted generation, where the profile names a draft: transformers' own, its schedule as the draft's generation
    config says unless ``draft_tokens`` is given."""
    if engine.draft is None:
        return {}
    if "draft_tokens" in engine.profile.options:
        engine.draft.generation_config.num_assistant_tokens = engine.draft_tokens
    return {"assistant_model": engine.draft}
