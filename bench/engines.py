"""Prefill seconds with the prefix cache off and on, for every engine, side by side in one run.

The same cases (one ~1,100-token system prompt, several user questions) go through each engine
twice: cache off (every prompt prefilled whole) and cache on (the system turn pinned, llama.cpp's
own reuse where it has one). Prints, per engine, the prefill seconds of all cases (median of the
repetitions), the cached share of prompt tokens, and the on/off ratio. Rows:
  torch     the default model (dequantized, float32, CPU)
  mlx       a tiny random llama (mlx's Linux CPU backend is ~50x slower: not the default model)
  llamacpp  the default model's GGUF in-process (llama-cpp-python)
  http      the same GGUF served by llama-server on loopback (-fa off), cache_prompt false vs true

    python bench/engines.py [--reps 3] [--skip mlx,http]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "bench")]

from engine_cache import system_prompt  # noqa: E402

from gatekeeper.engines.registry import build_engine  # noqa: E402
from gatekeeper.setup.models import find_gguf, is_prepared, prepare_default_model  # noqa: E402
from gatekeeper.workspace import EngineProfile  # noqa: E402

QUESTIONS = [
    "Find me a hotel in Porto for two people on 2024-06-01.",
    "Cancel my train to Lisbon tomorrow.",
    "What is the weather in Madrid on Friday?",
    "Book a table for four at a restaurant in Seville tonight.",
    "I need a car in Faro from Monday to Thursday, automatic, cheapest please.",
    "Are there any museums open late in Coimbra this weekend?",
]


def run(model, prompts: list[list[int]], pin: list[int], cache: bool, max_tokens: int) -> tuple[float, int, int]:
    """(prefill seconds, cached tokens, prompt tokens) over all prompts in one configuration, on a fresh session."""
    with model.session(cache=cache) as session:
        session.pin(pin)
        gens = [session.generate(p, max_tokens=max_tokens) for p in prompts]
    return sum(g.prefill_s for g in gens), sum(g.cached_tokens for g in gens), sum(g.prompt_tokens for g in gens)


def measure(label: str, model, prefix_tokens: int, reps: int, max_tokens: int) -> None:
    system = system_prompt(model, prefix_tokens)
    prompts = [model.tokenize(model.render([{"role": "system", "content": system}, {"role": "user", "content": q}]))
               for q in QUESTIONS]
    shared = 0
    while all(len(p) > shared + 1 and p[shared] == prompts[0][shared] for p in prompts):
        shared += 1
    pin = prompts[0][:shared]
    run(model, prompts[:1], pin, True, 1)  # warm-up: first-call allocations, kernels
    off, on = [], []
    for _ in range(reps):
        off.append(run(model, prompts, pin, False, max_tokens))
        on.append(run(model, prompts, pin, True, max_tokens))
    t_off, t_on = statistics.median(r[0] for r in off), statistics.median(r[0] for r in on)
    cached, total = on[-1][1], on[-1][2]
    print(f"{label:<34} prompts {len(prompts)} x ~{total // len(prompts):>4} tok  shared {shared:>5}  "
          f"prefill off {t_off:7.3f} s  on {t_on:7.3f} s  cached {cached / total:5.1%}  on/off {t_on / t_off:5.3f}",
          flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prefix-tokens", type=int, default=1100)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--skip", default="", help="comma-separated rows to leave out: torch,mlx,llamacpp,http")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if not is_prepared():
        prepare_default_model()
    # The aligned plan (the shipped default) for the built-in engines: hits are exact by construction.
    base = EngineProfile(adapter="torch", model="default", dtype="float32", device="cpu")

    def row(label: str, profile: EngineProfile) -> None:
        with build_engine(profile) as model:
            measure(label, model, args.prefix_tokens, args.reps, args.max_tokens)

    with ExitStack() as stack:
        if "torch" not in skip:
            row("torch cpu default model", base)
        if "mlx" not in skip:
            from tiny_models import build_tiny_llama

            tiny = build_tiny_llama(Path(stack.enter_context(tempfile.TemporaryDirectory())) / "tiny", layers=4, hidden=128)
            row("mlx cpu tiny llama", base.model_copy(update={"adapter": "mlx", "model": str(tiny)}))
        if "llamacpp" not in skip:
            row("llamacpp cpu default GGUF", EngineProfile(adapter="llamacpp", model="default"))
        if "http" not in skip:
            from served import llama_server

            log = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "server.log"
            # -fa off: the configuration under which cache_prompt was exact in the tests
            url = stack.enter_context(llama_server(find_gguf(), "-fa", "off", log=log))
            row("http llama-server default GGUF", EngineProfile(adapter="http", url=url, cache_switch="cache_prompt"))


if __name__ == "__main__":
    main()
