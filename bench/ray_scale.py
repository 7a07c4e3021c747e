"""Cases per second with 1 vs 2 Ray actors (``executor: ray``), side by side in one run.

Runs `evaluate --flag prefix_cache` on the repository's battery (``--limit`` cases per suite) three ways per
model: in this process (``executor: local``), on 1 Ray actor and on 2, for a tiny random llama and for the
default model (``engines/torch.yaml``). One local Ray cluster serves every run; each evaluation starts its
actors (each loads the model) and stops them. Prints, per row, the cases per second over the runs themselves
(two flag-off runs and one flag-on run, actor start-up excluded), the evaluation's wall time with start-up,
the verdict, and the 2-actor / 1-actor ratio.

    python bench/ray_scale.py [--limit 2] [--skip-default]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from gatekeeper.gate import evaluator as gate  # noqa: E402
from gatekeeper.gate import planning  # noqa: E402
from gatekeeper.gate.run import runs  # noqa: E402
from gatekeeper.gate.state import pipeline  # noqa: E402
from gatekeeper.ledger import Ledger  # noqa: E402
from gatekeeper.workspace import Workspace  # noqa: E402

EXECUTORS = {"local": "", "ray x1": "executor: ray\nray: {actors: 1}\n", "ray x2": "executor: ray\nray: {actors: 2}\n"}


def workspace(tmp: Path, models: dict[str, str]) -> Workspace:
    """The repository's battery and cache policy, with a profile per (model, executor)."""
    ws = tmp / "ws"
    for folder in ("assertions", "prompts"):
        shutil.copytree(ROOT / folder, ws / folder)
    (ws / "policies").mkdir(parents=True)
    shutil.copy(ROOT / "policies" / "prefix_cache.yaml", ws / "policies")
    (ws / "engines").mkdir()
    for model, base in models.items():
        for executor, extra in EXECUTORS.items():
            (ws / "engines" / f"{model}-{executor.replace(' ', '')}.yaml").write_text(base + extra)
    return Workspace(ws)


def run(ws: Workspace, engine: str, limit: int) -> dict:
    """One evaluation on a throwaway ledger: its case throughput over the runs, and its wall time."""
    with tempfile.TemporaryDirectory() as tmp, Ledger(f"sqlite:///{tmp}/evidence.db") as ledger:
        plan = planning.plan(ws, "prefix_cache", engine, None, limit, force=pipeline.in_force(ws, ledger))
        models = runs.open_engines(plan)
        try:
            t0 = time.perf_counter()
            outcome = gate.evaluate(plan, ledger, models, "bench")
            wall = time.perf_counter() - t0
        finally:
            runs.close_engines(models)
    repeats = plan.policy.baseline_repeats
    run_s = outcome.seconds["off"] * repeats + outcome.seconds["on"]
    return {"cases": outcome.cases, "runs": repeats + 1, "per_s": outcome.cases * (repeats + 1) / run_s,
            "run_s": run_s, "wall": wall, "verdict": outcome.verdict}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=2, help="cases per suite")
    ap.add_argument("--skip-default", action="store_true", help="only the tiny model")
    args = ap.parse_args()

    import ray
    from tiny_models import build_tiny_llama
    from transformers.utils import logging as hf_logging

    from gatekeeper.setup.models import is_prepared

    hf_logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as tmp:
        tiny = build_tiny_llama(Path(tmp) / "tiny")
        models = {"tiny": f"adapter: torch\nmodel: {tiny}\ndtype: float32\ndevice: cpu\n"}
        if not args.skip_default:
            if not is_prepared():
                sys.exit("the default model is not prepared: run 'gatekeeper models prepare' first")
            models["default"] = (ROOT / "engines" / "torch.yaml").read_text()
        ws = workspace(Path(tmp), models)
        ray.init(include_dashboard=False, log_to_driver=False, logging_level="ERROR")
        cpus = int(ray.cluster_resources().get("CPU", 0))
        print(f"{os.cpu_count()} cores, a local Ray cluster of {cpus} CPUs; --limit {args.limit} per suite; "
              "cases/s over 2 flag-off runs and 1 flag-on run")
        print(f"{'model':8} {'executor':8} {'cases':>5} {'cases/s':>8} {'runs s':>8} {'wall s':>8}  verdict")
        try:
            for model in models:
                rows = {}
                for executor in EXECUTORS:
                    r = rows[executor] = run(ws, f"{model}-{executor.replace(' ', '')}", args.limit)
                    print(f"{model:8} {executor:8} {r['cases']:5d} {r['per_s']:8.2f} {r['run_s']:8.2f} {r['wall']:8.2f}  "
                          f"{r['verdict']}", flush=True)
                print(f"{model:8} 2 actors / 1 actor: {rows['ray x2']['per_s'] / rows['ray x1']['per_s']:.2f}x cases/s, "
                      f"{rows['ray x1']['wall'] / rows['ray x2']['wall']:.2f}x wall; 2 actors / local: "
                      f"{rows['ray x2']['per_s'] / rows['local']['per_s']:.2f}x cases/s")
        finally:
            ray.shutdown()


if __name__ == "__main__":
    main()
