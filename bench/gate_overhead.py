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

from gatekeeper.gate import evaluator as gate
from gatekeeper.gate import planning
from gatekeeper.gate.run import runs
from gatekeeper.gate.state import pipeline
from gatekeeper.ledger import Ledger
from gatekeeper.workspace import Workspace

ROOT = Path(__file__).resolve().parent.parent


class Clock:
    """The seconds the model spends computing (``generate`` and ``pin`` on its sessions).

    Rendering, tokenizing and identity digests count as gatekeeper's own time.
    """

    def __init__(self):
        self.seconds = 0.0

    def timed(self, call):
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        return run


class TimedSession:
    """Forwards to a session, timing its model calls."""

    MODEL_CALLS = ("generate", "pin")

    def __init__(self, session, clock: Clock):
        self._session, self._clock = session, clock

    def __getattr__(self, name):
        attr = getattr(self._session, name)
        return self._clock.timed(attr) if name in self.MODEL_CALLS else attr

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._session.__exit__(*exc)


class TimedModel:
    """Forwards to a loaded model; the sessions it opens are timed."""

    def __init__(self, model, clock: Clock):
        self._model, self._clock = model, clock

    def __getattr__(self, name):
        return getattr(self._model, name)

    def session(self, **kwargs):
        return TimedSession(self._model.session(**kwargs), self._clock)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, default=4, help="cases per suite")
    ap.add_argument("--engine", default="torch")
    args = ap.parse_args()

    ws = Workspace(ROOT)
    with tempfile.TemporaryDirectory() as tmp, Ledger(f"sqlite:///{tmp}/evidence.db") as ledger:
        plan = planning.plan(ws, "prefix_cache", args.engine, None, args.limit, force=pipeline.in_force(ws, ledger))
        models = runs.open_engines(plan)  # one loaded model when both configurations share a profile
        clock = Clock()
        wrapped = {id(m): TimedModel(m, clock) for m in models.values()}
        try:
            t0 = time.perf_counter()
            outcome = gate.evaluate(plan, ledger, {k: wrapped[id(m)] for k, m in models.items()}, "bench")
            wall = time.perf_counter() - t0
        finally:
            runs.close_engines(models)
    own = wall - clock.seconds
    print(f"cases: {outcome.cases} x {plan.policy.baseline_repeats + 1} runs   verdict: {outcome.verdict}")
    print(f"evaluation wall time:           {wall:8.2f} s")
    print(f"  inside the engine:            {clock.seconds:8.2f} s")
    print(f"  gatekeeper's own:             {own:8.2f} s   share {own / wall:.2%}   (target < 2%)")
    bound = outcome.tokens["stable_prefix_bound"]
    print(f"stable-prefix bound (flag on):  {bound} tokens")
    print(f"served from cache:              {outcome.tokens['cached_on']} tokens   share {outcome.tokens['cached_on'] / bound:.2%}   (target >= 95%)")


if __name__ == "__main__":
    main()
