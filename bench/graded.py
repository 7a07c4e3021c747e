"""What a model-graded suite adds to an evaluation's wall time, side by side in one run.

Two throwaway workspaces hold the same suite (the shipped template's prompt, N cases); in one, each case also
carries an ``llm-rubric`` assertion, graded by the policy's grader (the same model, greedy, cache off). Both
are evaluated with ``--flag prefix_cache`` in this process, alternately ``--reps`` times after a warm-up of
the engine (the fastest of each kept: a shared machine's noise only adds). Prints each wall time, the
ratio, and the grader's calls and seconds per call (timed inside the evaluation, so noise-free of the rest). ``--model tiny``
builds the tests' tiny random llama (its replies are noise, but it generates as many tokens: the cost is real).

    python bench/graded.py [--cases 4] [--model default|tiny|DIR] [--grader-max-tokens 64] [--reps 3]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import yaml

from gatekeeper.gate import evaluator as gate
from gatekeeper.gate import planning
from gatekeeper.gate.run import graders as graders_
from gatekeeper.gate.run import runs
from gatekeeper.gate.state import pipeline
from gatekeeper.ledger import Ledger
from gatekeeper.setup.scaffold import init_workspace
from gatekeeper.workspace import Workspace

QUERIES = ["What is the capital of France?", "What is 2+2?", "Name a primary colour.", "Which planet is largest?",
           "What language is spoken in Brazil?", "How many days are in a week?", "What is water made of?",
           "Who wrote Hamlet?"]


ENGINE = "bench"


def workspace(root: Path, cases: int, model: str, grader_tokens: int | None) -> Workspace:
    """The template workspace with one suite of ``cases`` cases; with ``grader_tokens``, an llm-rubric on each."""
    init_workspace(root)
    (root / "engines" / f"{ENGINE}.yaml").write_text(f"adapter: torch\nmodel: {model}\ndtype: float32\ndevice: cpu\n")
    suite_path = root / "assertions" / "assistant.yaml"
    suite = yaml.safe_load(suite_path.read_text())
    suite["decoding"] = {"max_tokens": 16, "stop": []}
    suite["cases"] = [{"id": f"q{n}", "vars": {"session": f"user={n}", "query": q},
                       "assert": [{"type": "max-length", "value": 2000}]
                       + ([{"type": "llm-rubric", "value": "The reply answers the question"}] if grader_tokens else [])}
                      for n, q in enumerate((QUERIES * cases)[:cases])]
    suite_path.write_text(yaml.safe_dump(suite, sort_keys=False))
    policy = root / "policies" / "prefix_cache.yaml"
    text = "".join(line for line in policy.read_text().splitlines(keepends=True) if not line.startswith("min_power:"))
    policy.write_text(text + (f"grader: {{engine: {ENGINE}, max_tokens: {grader_tokens}}}\n" if grader_tokens else ""))
    return Workspace(root)


def timed_evaluation(ws: Workspace, engine: str = ENGINE) -> tuple[float, object, dict]:
    calls = {"n": 0, "s": 0.0}
    complete = graders_.Graders.complete

    def counted(self, prompt):
        t0 = time.perf_counter()
        try:
            return complete(self, prompt)
        finally:
            calls["n"] += 1
            calls["s"] += time.perf_counter() - t0

    graders_.Graders.complete = counted  # counts the grader's calls; the call itself is unchanged
    try:
        with Ledger(f"sqlite:///{ws.root}/ledger/evidence.db") as ledger:
            plan = planning.plan(ws, "prefix_cache", engine, force=pipeline.in_force(ws, ledger))
            models = runs.open_engines(plan)
            try:
                t0 = time.perf_counter()
                outcome = gate.evaluate(plan, ledger, models, "bench")
                return time.perf_counter() - t0, outcome, calls
            finally:
                runs.close_engines(models)
    finally:
        graders_.Graders.complete = complete


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=4)
    ap.add_argument("--model", default="default", help="default (the prepared default model), tiny, or a model folder")
    ap.add_argument("--grader-max-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model == "tiny":
            sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
            from tiny_models import build_tiny_llama

            model = str(build_tiny_llama(Path(tmp) / "tiny"))
        plain = workspace(Path(tmp) / "plain", args.cases, model, None)
        graded = workspace(Path(tmp) / "graded", args.cases, model, args.grader_max_tokens)
        timed_evaluation(plain)  # warm-up: libraries imported, weights in the page cache
        plains, gradeds = [], []
        for _ in range(args.reps):
            plains.append(timed_evaluation(plain))
            gradeds.append(timed_evaluation(graded))
        wall_plain, out_plain, _ = min(plains, key=lambda r: r[0])
        wall_graded, out_graded, calls = min(gradeds, key=lambda r: r[0])
    runs = out_plain.cases * 3
    print(f"cases: {out_plain.cases} x 3 runs (2 flag-off, 1 flag-on); model {args.model} (torch, float32, CPU); grader: "
          f"the same profile, max_tokens {args.grader_max_tokens}")
    print(f"without llm-rubric:   {wall_plain:8.2f} s   verdict {out_plain.verdict}   (fastest of {args.reps}: "
          f"{', '.join(f'{r[0]:.1f}' for r in plains)})")
    print(f"with llm-rubric:      {wall_graded:8.2f} s   verdict {out_graded.verdict}   (fastest of {args.reps}: "
          f"{', '.join(f'{r[0]:.1f}' for r in gradeds)})")
    print(f"added wall time:      {wall_graded - wall_plain:8.2f} s   ratio {wall_graded / wall_plain:.2f}x")
    print(f"grader calls:         {calls['n']:8d}     ({calls['n'] / runs:.1f} per case run), "
          f"{calls['s'] / max(1, calls['n']):.3f} s each, {calls['s']:.2f} s in all, {calls['s'] / wall_graded:.0%} of the graded "
          "evaluation (grader load and identity: the rest of the difference)")


if __name__ == "__main__":
    main()
