"""gatekeeper's own cost inside an evaluation, measured side by side with the model's.

Runs `evaluate --flag prefix_cache` on the default workspace and default model (a few cases per
suite, a throwaway ledger), timing every call into the engine. Prints:
  - gatekeeper's own time (rendering, comparing, ledger writes) as a share of evaluation wall time
    (target: under 2%);
  - prompt tokens served from cache with the flag on, as a share of the stable-prefix bound
    (target: at least 95%).

    python bench/gate_overhead.py [--limit 4] [--engine torch]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from gatekeeper import gate, pipeline
from gatekeeper.engines.registry import build_engine
from gatekeeper.ledger import Ledger
from gatekeeper.workspace import Workspace

ROOT = Path(__file__).resolve().parent.parent


class Timed:
    """Forwards to an engine and adds up the seconds the model spends computing (generate, pin).

    Rendering, tokenizing and identity digests count as gatekeeper's own time.
    """

    MODEL_CALLS = ("generate", "pin")

    def __init__(self, engine):
        self._engine, self.seconds = engine, 0.0

    def __getattr__(self, name):
        attr = getattr(self._engine, name)
        if name not in self.MODEL_CALLS:
            return attr

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return attr(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        return timed

    def __setattr__(self, name, value):
        if name in ("_engine", "seconds"):
            object.__setattr__(self, name, value)
        else:
            setattr(self._engine, name, value)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, default=4, help="cases per suite")
    ap.add_argument("--engine", default="torch")
    args = ap.parse_args()

    ws = Workspace(ROOT)
    with tempfile.TemporaryDirectory() as tmp, Ledger(f"sqlite:///{tmp}/evidence.db") as ledger:
        plan = gate.plan(ws, "prefix_cache", args.engine, None, args.limit, force=pipeline.in_force(ws, ledger))
        engine = Timed(build_engine(plan.configs["off"].profile, cache=False, workspace_root=ws.root))
        t0 = time.perf_counter()
        outcome = gate.evaluate(plan, ledger, {"off": engine, "on": engine}, "bench")
        wall = time.perf_counter() - t0
    own = wall - engine.seconds
    print(f"cases: {outcome.cases} x {plan.policy.baseline_repeats + 1} runs   verdict: {outcome.verdict}")
    print(f"evaluation wall time:           {wall:8.2f} s")
    print(f"  inside the engine:            {engine.seconds:8.2f} s")
    print(f"  gatekeeper's own:             {own:8.2f} s   share {own / wall:.2%}   (target < 2%)")
    bound = outcome.tokens["stable_prefix_bound"]
    print(f"stable-prefix bound (flag on):  {bound} tokens")
    print(f"served from cache:              {outcome.tokens['cached_on']} tokens   share {outcome.tokens['cached_on'] / bound:.2%}   (target >= 95%)")


if __name__ == "__main__":
    main()
