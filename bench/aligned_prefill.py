"""The price of the aligned prefill plan, measured side by side in one run (prints ratios; no pass/fail).

On the default battery's prompts (the workspace's suites, rendered partitioned, first turn of each
case), with torch on the default model, it times per suite:
  cold   a cache-off prefill of the whole prompt, under each plan: aligned (cut at the suite's
         pinned prefix and every ``chunk`` tokens) vs monolithic (one pass); target aligned/mono <= 1.05
  hit    the same prompts with the cache on and the stage prefix pinned, under each plan: prefill
         time saved against that plan's own cold run, and tokens served from the cache.
One loaded model serves both plans (a session per plan, opened with the model's profile set to
that plan), and plans alternate rep by rep on each prompt, so both see the same weights, kernels and machine load; each figure is the
fastest of the reps (the least disturbed by other work on the machine).

    python bench/aligned_prefill.py [--limit 3] [--reps 3] [--dtype float32] [--chunk 256] [--threads N]
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

import torch  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from gatekeeper.battery import partition  # noqa: E402
from gatekeeper.battery import suites as battery  # noqa: E402
from gatekeeper.engines.registry import build_engine  # noqa: E402
from gatekeeper.setup.models import is_prepared, prepare_default_model  # noqa: E402
from gatekeeper.workspace import EngineProfile, Workspace  # noqa: E402

PLANS = ("monolithic", "aligned")


def prompts(model, ws: Workspace, limit: int) -> dict[str, tuple[list[list[int]], list[int]]]:
    """suite -> (prompts, the static prefix the gate would pin)."""
    out: dict[str, tuple[list[list[int]], list[int]]] = {}
    for item in battery.read(ws, limit=limit):
        values = {**item.case.vars, **(item.case.turns[0] if item.case.turns else {})}
        r = partition.render(model, partition.pieces(ws, item.suite, values), "partitioned")
        ids, _ = out.setdefault(item.suite.suite, ([], r.tokens[: r.static_tokens]))
        ids.append(r.tokens)
    return out


def open_session(model, base: EngineProfile, plan: str, prefixes: list[list[int]], *, cache: bool):
    """A fresh session under ``plan`` (a session takes its plan from the model's profile when it
    opens), every stage prefix registered: for both plans and both cache states, as the gate does."""
    model.profile = base.model_copy(update={"prefill": plan})
    session = model.session(cache=cache)
    for prefix in prefixes:
        session.pin(prefix)
    return session


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=3, help="cases per suite")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    hf_logging.disable_progress_bar()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not is_prepared():
        prepare_default_model()

    ws = Workspace(ROOT)
    base = EngineProfile(adapter="torch", model="default", dtype=args.dtype, device="auto", chunk=args.chunk)
    model = build_engine(base, workspace_root=ws.root)
    suites = prompts(model, ws, args.limit)
    prefixes = [pre for _, pre in suites.values()]
    colds = {plan: open_session(model, base, plan, prefixes, cache=False) for plan in PLANS}
    colds["aligned"].generate(next(iter(suites.values()))[0][0], max_tokens=1)  # warm-up

    cold: dict[tuple[str, str], list[float]] = defaultdict(list)  # (suite, plan) -> per prompt
    hit: dict[tuple[str, str], list[float]] = defaultdict(list)
    cached: dict[tuple[str, str], int] = defaultdict(int)
    for suite, (ids, _) in suites.items():
        for p in ids:
            times = {plan: [] for plan in PLANS}
            for rep in range(args.reps):
                for plan in PLANS if rep % 2 == 0 else PLANS[::-1]:
                    times[plan].append(colds[plan].generate(p, max_tokens=1).prefill_s)
            for plan in PLANS:
                cold[suite, plan].append(min(times[plan]))
        for plan in PLANS:  # hits: the suite's prompts in order, the stage prefix pinned
            per = [[] for _ in ids]
            for _ in range(args.reps):
                # A fresh session each rep: the pinned states only, computed under this plan.
                with open_session(model, base, plan, prefixes, cache=True) as on:
                    for i, p in enumerate(ids):
                        g = on.generate(p, max_tokens=1)
                        per[i].append(g.prefill_s)
                        cached[suite, plan] += g.cached_tokens
            hit[suite, plan] = [min(t) for t in per]
    for session in colds.values():
        session.close()

    print(f"torch {model.device_name} {model.dtype_name}, threads {torch.get_num_threads()}, chunk {args.chunk}, "
          f"{args.limit} cases per suite, fastest of {args.reps}")
    print(f"{'suite':<12} {'prompts':>7} {'tokens':>7} {'prefix':>6}   {'cold mono':>9} {'cold aligned':>12} {'aligned/mono':>12}"
          f"   {'hit mono':>8} {'saved':>6} {'hit aligned':>11} {'saved':>6}   {'cached mono/aligned':>19}")
    totals = defaultdict(float)
    for suite, (ids, prefix) in suites.items():
        c = {plan: sum(cold[suite, plan]) for plan in PLANS}
        h = {plan: sum(hit[suite, plan]) for plan in PLANS}
        for plan in PLANS:
            totals["cold " + plan] += c[plan]
            totals["hit " + plan] += h[plan]
        tokens = sum(len(p) for p in ids)
        n = {plan: cached[suite, plan] // args.reps for plan in PLANS}
        print(f"{suite:<12} {len(ids):>7} {tokens:>7} {len(prefix):>6}   {c['monolithic']:>8.2f}s {c['aligned']:>11.2f}s "
              f"{c['aligned'] / c['monolithic']:>12.3f}   {h['monolithic']:>7.2f}s {1 - h['monolithic'] / c['monolithic']:>6.1%} "
              f"{h['aligned']:>10.2f}s {1 - h['aligned'] / c['aligned']:>6.1%}   {n['monolithic']:>9}/{n['aligned']}")
    ratio = totals["cold aligned"] / totals["cold monolithic"]
    print(f"{'all':<12} cold prefill aligned/monolithic {ratio:.3f} (target <= 1.05); "
          f"hit saves {1 - totals['hit monolithic'] / totals['cold monolithic']:.1%} (monolithic) "
          f"vs {1 - totals['hit aligned'] / totals['cold aligned']:.1%} (aligned) of cold prefill time")
    model.close()


if __name__ == "__main__":
    main()
