"""The gate's detection curve on the shipped battery and the default model, and what a calibration costs.

Copies the repository's workspace into a temporary folder (a throwaway ledger), then, in one run, calibrates
`--flag prefix_cache` on the shipped torch profile (float32 on a CPU, the shipped prefill plan) twice: in
full (every case of every fault run decoded whole) and with early stopping (each case stopped at its
first flag), under the shipped policy's drift rule and under `require: bit_exact`. Prints per planted fault
the share of cases flagged (by outputs, by drift, either), side by side, and each calibration's cost in
flag-on runs (the sum of its fault runs over its unfaulted run), measured in the same calibration.

    python bench/calibrate.py [--limit 1]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
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


def calibrate(ws: Path, mode: str, limit: int) -> dict:
    cmd = [sys.executable, "-m", "gatekeeper.cli", "--workspace", str(ws), "calibrate", "--engine", "torch",
           "--limit", str(limit), "--operator", "bench", "--json", *(["--full"] if mode == "full" else [])]
    done = subprocess.run(cmd, capture_output=True, text=True)
    result = json.loads(done.stdout or "{}")
    if done.returncode != 0 or "error" in result:
        sys.exit(f"calibrate {mode} in {ws.name}: {result.get('error') or done.stderr[-2000:]}")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=1, help="cases per suite")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = {run: calibrate(workspace(run[0], Path(tmp)), run[1], args.limit) for run in RUNS}
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
