"""The gate's detection curve on the shipped battery and the default model, and what a calibration costs.

Copies the repository's workspace into a temporary folder (a throwaway ledger), then, in one run, calibrates
`--flag prefix_cache` on the shipped torch profile (float32 on a CPU, the shipped prefill plan) twice: in
full (every case of every fault run decoded whole) and with early stopping (each case stopped at its
first flag), under the shipped policy's drift rule and under `require: bit_exact`. Prints per planted fault
the share of cases flagged (by outputs, by drift, either), side by side, and each calibration's cost in
flag-on runs (the sum of its fault runs over its unfaulted run), measured in the same calibration.

`--before-after` compares instead, side by side, the battery shipped until it was mined (the 64-case
candidate pool in bench/candidates/) with the shipped battery mined from it (`battery mine --cases 20
--max-tokens 64 --faults shift,drop` on the pool): the curve of each (early stopping, the shipped policy;
the mined battery also in full, so its "by outputs" shares are exact), and the wall time of
`evaluate --flag prefix_cache` on each.

    python bench/calibrate.py [--limit 1] | [--before-after]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNS = (("shipped", "full"), ("shipped", "early"), ("bit_exact", "full"), ("bit_exact", "early"))


def workspace(policy: str, tmp: Path) -> Path:
    ws = tmp / policy
    if not ws.exists():
        for folder in ("engines", "assertions", "prompts", "policies"):
            shutil.copytree(ROOT / folder, ws / folder, ignore=shutil.ignore_patterns("examples"))
        profile = ws / "engines" / "torch.yaml"
        profile.write_text(profile.read_text().replace("dtype: auto", "dtype: float32").replace("device: auto", "device: cpu"))
        if policy == "bit_exact":
            path = ws / "policies" / "prefix_cache.yaml"
            path.write_text(path.read_text() + "require: bit_exact\n")
    return ws


def cli(ws: Path, *args: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "gatekeeper.cli", "--workspace", str(ws), *args, "--json"],
                          capture_output=True, text=True)
    result = json.loads(done.stdout or "{}")
    if done.returncode not in (0, 1) or "error" in result:
        sys.exit(f"{args[0]} in {ws.name}: {result.get('error') or done.stderr[-2000:]}")
    return result


def calibrate(ws: Path, mode: str, limit: int | None) -> dict:
    return cli(ws, "calibrate", "--engine", "torch", *(["--limit", str(limit)] if limit else []), "--operator", "bench",
               *(["--full"] if mode == "full" else []))


def before_and_after(tmp: Path) -> None:
    """The candidate pool (the battery before mining) against the shipped battery: curve, cost, evaluation time."""
    shipped, pool = workspace("shipped", tmp), tmp / "pool"
    shutil.copytree(shipped, pool, ignore=shutil.ignore_patterns("ledger", "assertions"))
    shutil.copytree(ROOT / "bench" / "candidates", pool / "assertions")
    rows = {}
    for name, ws in (("pool", pool), ("shipped", shipped)):
        t0 = time.perf_counter()
        verdict = cli(ws, "evaluate", "--flag", "prefix_cache", "--engine", "torch", "--operator", "bench")
        rows[name] = (verdict, time.perf_counter() - t0, calibrate(ws, "early", None))
    full = calibrate(shipped, "full", None)
    print("\nbefore and after mining (shares by outputs / by drift / either)")
    print(f"{'fault':<14}{'pool, early':>24}{'shipped, early':>24}{'shipped, full':>24}")
    for i, f in enumerate(full["faults"]):
        cells = [(lambda g: f"{g['share_outputs']:.0%} / {g['share_drift']:.0%} / {g['share']:.0%}" if g["supported"] else "-")(
            c["faults"][i]) for c in (rows["pool"][2], rows["shipped"][2], full)]
        print(f"{f['spec']:<14}" + "".join(f"{c:>24}" for c in cells))
    for label, pick in (("cases", lambda r: str(r[2]["cases"])), ("verdict", lambda r: r[0]["verdict"]),
                        ("evaluate s", lambda r: f"{r[1]:.0f}"),
                        ("cost (runs)", lambda r: f"{r[2]['seconds'].get('per_flag_on_run', 0):.2f}")):
        print(f"{label:<14}{pick(rows['pool']):>24}{pick(rows['shipped']):>24}")
    print(f"full calibration of the shipped battery: {full['seconds'].get('per_flag_on_run', 0):.2f} flag-on runs")
    print(f"evaluation time, shipped / pool: {rows['shipped'][1] / rows['pool'][1]:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=1, help="cases per suite")
    ap.add_argument("--before-after", action="store_true", help="compare the candidate pool with the shipped battery")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.before_after:
            before_and_after(Path(tmp))
        else:
            report({run: calibrate(workspace(run[0], Path(tmp)), run[1], args.limit) for run in RUNS})


def report(results: dict) -> None:
    first = results[RUNS[0]]
    print(f"{first['cases']} cases; shares flagged by outputs / by drift / either")
    print(f"{'fault':<14}" + "".join(f"{p + ' ' + m:>22}" for p, m in RUNS))
    for i, row in enumerate(first["faults"]):
        cells = []
        for run in RUNS:
            f = results[run]["faults"][i]
            cells.append(f"{f['share_outputs']:.0%} / {f['share_drift']:.0%} / {f['share']:.0%}" if f["supported"] else "-")
        print(f"{row['spec']:<14}" + "".join(f"{c:>22}" for c in cells))
    print(f"{'cost (runs)':<14}" + "".join(f"{results[r]['seconds'].get('per_flag_on_run', 0):>22.2f}" for r in RUNS))
    print(f"{'seconds':<14}" + "".join(f"{results[r]['seconds']['faults'] + results[r]['seconds'].get('reference', 0):>22.1f}"
                                       for r in RUNS))
    for policy in ("shipped", "bit_exact"):
        same = all(sorted(a["flagged_cases"]) == sorted(b["flagged_cases"]) for a, b in
                   zip(results[(policy, "full")]["faults"], results[(policy, "early")]["faults"]) if a["supported"])
        ratio = results[(policy, "full")]["seconds"]["faults"] / results[(policy, "early")]["seconds"]["faults"]
        print(f"{policy}: early stopping flags {'the same' if same else 'DIFFERENT'} cases, {ratio:.1f}x cheaper "
              f"({results[(policy, 'early')]['drift_rule']['rule']})")


if __name__ == "__main__":
    main()
