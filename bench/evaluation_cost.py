"""What an evaluation costs beside its decodes, step by step, and whether batching the forced reads would help here.

Runs `evaluate --flag prefix_cache` on the default workspace and model, as `make demo` does (a throwaway ledger), and
prints each step's seconds and share of the evaluation: the decode runs the gate cannot do without (the flag-off run
and its repeats, the flag-on run), the cache probes, the teacher-forced distance, the reference arm, and the rest
(rendering, comparing, the ledger); then the ratio of the whole to its decode runs (issue #65's target: 1.3).

Then the forced reads' shape, side by side in one run: the reference arm's cache-free reader reads answers of the
evaluation's own lengths one at a time (what it does) and as one right-padded batch (causal attention: no position
reads the padding, so the rows are the same read), and prints both times and their ratio.

    python bench/evaluation_cost.py [--limit 20] [--batch 4]
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


def steps(outcome, wall: float, repeats: int) -> dict[str, float]:
    """The evaluation's seconds by step, as its result records them; the rest is what none of them names."""
    out = {"flag-off runs": outcome.seconds["off"] * repeats, "flag-on run": outcome.seconds["on"],
           "cache probes": outcome.probe_seconds,
           "teacher-forced distance": (outcome.distance or {}).get("seconds") or 0.0,
           "reference arm": (outcome.reference or {}).get("seconds") or 0.0}
    out["the rest"] = max(0.0, wall - sum(out.values()))
    return out


def lengths(ledger: Ledger, evaluation_id: int) -> list[tuple[int, int]]:
    """(prompt tokens, answer tokens) of each first-turn flag-off answer the evaluation recorded."""
    rows = ledger.evaluation(evaluation_id)["case_results"]
    return [(r["result"]["turns"][0]["prompt_tokens"], len(r["result"]["turns"][0]["tokens"]))
            for r in rows if r["config"] == "off" and r["repeat"] == 0 and "crash" not in r["result"]]


def reads(model_dir: Path, shapes: list[tuple[int, int]], batch: int) -> tuple[float, float, float]:
    """Seconds to read sequences of these shapes one at a time and in right-padded batches of ``batch``, and the
    largest difference between the two reads' logits."""
    import torch

    from gatekeeper.engines import reader

    model = reader.load(model_dir)
    generator = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, model.config.vocab_size, (p + a,), generator=generator).tolist() for p, a in shapes]
    start = time.perf_counter()
    alone = [reader.logits(model, s, a) for s, (_, a) in zip(seqs, shapes)]
    one = time.perf_counter() - start
    start, worst = time.perf_counter(), 0.0
    for i in range(0, len(seqs), batch):
        group, width = seqs[i:i + batch], max(map(len, seqs[i:i + batch]))
        ids = torch.tensor([s + [0] * (width - len(s)) for s in group])
        first = min(len(s) - a - 1 for s, (_, a) in zip(group, shapes[i:i + batch]))  # the first position any row reads
        with torch.inference_mode():
            logits = model(input_ids=ids, use_cache=False, logits_to_keep=width - first).logits.double()
        for j, s in enumerate(group):
            answer = shapes[i + j][1]
            rows = logits[j, len(s) - answer - 1 - first:len(s) - 1 - first]
            worst = max(worst, float((rows - torch.from_numpy(alone[i + j])).abs().max()))
    return one, time.perf_counter() - start, worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=None, help="cases per suite (default: all, as make demo runs)")
    ap.add_argument("--engine", default="torch")
    ap.add_argument("--batch", type=int, default=4, help="answers per batched forced read")
    args = ap.parse_args()

    ws = Workspace(ROOT)
    with tempfile.TemporaryDirectory() as tmp, Ledger(f"sqlite:///{tmp}/evidence.db") as ledger:
        plan = planning.plan(ws, "prefix_cache", args.engine, None, args.limit, force=pipeline.in_force(ws, ledger))
        models = runs.open_engines(plan)
        try:
            start = time.perf_counter()
            outcome = gate.evaluate(plan, ledger, models, "bench")
            wall = time.perf_counter() - start
            model_dir = models["off"].model_dir
        finally:
            runs.close_engines(models)
        shapes = lengths(ledger, outcome.evaluation_id)
    repeats = plan.policy.baseline_repeats
    by_step = steps(outcome, wall, repeats)
    decodes = by_step["flag-off runs"] + by_step["flag-on run"]
    print(f"evaluate --flag prefix_cache --engine {args.engine}: {outcome.cases} cases, verdict {outcome.verdict}, "
          f"{wall:.1f} s")
    print(f"{'step':<26}{'s':>9}{'share':>9}")
    for name, seconds in by_step.items():
        print(f"{name:<26}{seconds:>9.1f}{seconds / wall:>9.1%}")
    print(f"the whole / its decode runs ({repeats} flag-off + 1 flag-on): {wall / decodes:.2f} (target 1.3)")
    if model_dir is None or not shapes:
        return
    one, batched, worst = reads(Path(model_dir), shapes, args.batch)
    print(f"\nforced reads of {len(shapes)} answers of the evaluation's lengths by the reference reader, this machine's "
          f"threads: one at a time {one:.1f} s, in batches of {args.batch} {batched:.1f} s "
          f"(batched / one at a time {batched / one:.2f}; largest logit difference {worst:.1e})")


if __name__ == "__main__":
    main()
