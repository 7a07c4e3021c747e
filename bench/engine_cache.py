"""Prefix-cache TTFT, measured side by side in one run (prints ratios; no pass/fail on time).

For a ~45-token suffix on a ~1,100-token prefix it compares time to first token on
  miss   a cold, one-pass prefill of the whole prompt (cache off),
  hit    the prefix served by the cache (pinned), the suffix computed,
  floor  the suffix alone, prefilled on top of a state already held in hand (no lookup, no fork),
and prints hit/miss (target <= 0.15) and hit/floor (target <= 1.3).
Rows: torch on the default model; mlx on a tiny random model (mlx's Linux CPU backend is slow).

    python bench/engine_cache.py [--reps 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from time import perf_counter

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from transformers.utils import logging as hf_logging  # noqa: E402

from gatekeeper.engines.greedy import pick  # noqa: E402
from gatekeeper.engines.registry import build_engine  # noqa: E402
from gatekeeper.setup.models import is_prepared, prepare_default_model  # noqa: E402
from gatekeeper.workspace import EngineProfile  # noqa: E402

QUESTION = (
    "I need to get from Lisbon to Porto next Friday morning with two colleagues, we each carry one "
    "small bag, and the company budget is tight, so please find the cheapest option that arrives before noon."
)


def system_prompt(model, min_tokens: int) -> str:
    """Tool descriptions, added until the rendered system turn reaches ``min_tokens`` tokens."""
    kinds = ["flights", "hotels", "trains", "cars", "weather", "events", "museums", "restaurants", "tours", "ferries"]
    lines = ["You are the router of a travel assistant. Pick exactly one tool and answer with its name and JSON arguments."]
    i = 0
    while len(model.tokenize(model.render([{"role": "system", "content": "\n".join(lines)}]))) < min_tokens:
        kind, action = kinds[i % len(kinds)], ["search", "book", "cancel"][i // len(kinds) % 3]
        lines.append(
            f"- {action}_{kind}: {action.capitalize()} {kind} for the traveller. Arguments: "
            f'{{"city": string, "date": "YYYY-MM-DD", "travellers": integer, "budget_eur": number}}. '
            f"Use it when the user wants to {action} {kind}; never guess missing dates."
        )
        i += 1
    return "\n".join(lines)


def build_prompt(model, system: str, suffix_tokens: int) -> tuple[list[int], int]:
    """(prompt, shared): the question's words are added until the suffix reaches ``suffix_tokens``."""
    head = model.tokenize(model.render([{"role": "system", "content": system}]))
    words = QUESTION.split()
    for n in range(1, len(words) + 1):
        turn = [{"role": "system", "content": system}, {"role": "user", "content": " ".join(words[:n])}]
        prompt = model.tokenize(model.render(turn))
        shared = next(i for i, (a, b) in enumerate(zip(prompt, head + [-1])) if a != b)
        if len(prompt) - shared >= suffix_tokens:
            break
    return prompt, shared


def measure(label: str, model, prefix_tokens: int, reps: int) -> None:
    prompt, shared = build_prompt(model, system_prompt(model, prefix_tokens), suffix_tokens=45)
    off = model.session(cache=False)
    off.pin(prompt[:shared])  # a boundary of the plan, as in the cache-on session

    miss, hit, floor, cached = [], [], [], []
    with model.session(cache=True) as warm:  # warm-up: first-call allocations, kernels
        warm.pin(prompt[:shared])
        warm.generate(prompt, max_tokens=1)
    for _ in range(reps):
        miss.append(off.generate(prompt, max_tokens=1).ttft_s)

        # A fresh session each rep: only the pinned prefix is held, not the previous rep's full prompt.
        with model.session(cache=True) as on:
            on.pin(prompt[:shared])
            pinned = on.prefix_cache.get(prompt[:shared])
            g = on.generate(prompt, max_tokens=1)
            hit.append(g.ttft_s)
            cached.append(g.cached_tokens)

            held = model.state_ops.fork(pinned.state, shared)  # in hand before the clock starts
            start = perf_counter()
            pick(model._forward(held, prompt[shared:]), None)
            floor.append(perf_counter() - start)
    off.close()

    m, h, f = (statistics.median(x) for x in (miss, hit, floor))
    print(
        f"{label:<28} prefix {shared:>5}  suffix {len(prompt) - shared:>3}  cached {min(cached):>5}  "
        f"ttft miss {m * 1e3:8.1f} ms  hit {h * 1e3:7.1f} ms  floor {f * 1e3:7.1f} ms  "
        f"hit/miss {h / m:5.3f} (<= 0.15)  hit/floor {h / f:5.2f} (<= 1.3)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--prefix-tokens", type=int, default=1100)
    args = ap.parse_args()
    hf_logging.disable_progress_bar()

    if not is_prepared():
        prepare_default_model()
    profile = EngineProfile(adapter="torch", model="default", dtype="float32", device="auto", prefill="monolithic")
    with build_engine(profile) as torch_model:
        measure(f"torch {torch_model.device_name} default model", torch_model, args.prefix_tokens, args.reps)

    from tiny_models import build_tiny_llama

    with tempfile.TemporaryDirectory() as tmp:
        tiny = build_tiny_llama(Path(tmp) / "tiny", layers=4, hidden=128)
        with build_engine(profile.model_copy(update={"adapter": "mlx", "model": str(tiny)})) as mlx_model:
            measure(f"mlx {mlx_model.device_name} tiny llama", mlx_model, args.prefix_tokens, args.reps)


if __name__ == "__main__":
    main()
