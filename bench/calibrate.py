"""The gate's detection curve on the default battery and model: torch, float32 and bfloat16.

For each dtype, copies the repository's workspace into a temporary folder, runs
`gatekeeper calibrate --flag prefix_cache --engine torch` (a few cases per suite, a throwaway
ledger) and prints, per planted fault, the share of cases the gate flagged, side by side for the
two dtypes, and the cost of a calibration as a multiple of one flag-on run (its zero-noise run,
measured in the same calibration).

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
DTYPES = ("float32", "bfloat16")


def calibrate(dtype: str, limit: int, tmp: Path) -> dict:
    ws = tmp / dtype
    for folder in ("engines", "assertions", "prompts", "policies"):
        shutil.copytree(ROOT / folder, ws / folder, ignore=shutil.ignore_patterns("examples"))
    profile = ws / "engines" / "torch.yaml"
    profile.write_text(profile.read_text().replace("dtype: auto", f"dtype: {dtype}"))
    cmd = [sys.executable, "-m", "gatekeeper.cli", "--workspace", str(ws), "calibrate", "--engine", "torch",
           "--limit", str(limit), "--operator", "bench", "--json"]
    return json.loads(subprocess.run(cmd, capture_output=True, text=True).stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=1, help="cases per suite")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = {d: calibrate(d, args.limit, Path(tmp)) for d in DTYPES}
    for d, r in results.items():
        if "error" in r:
            sys.exit(f"{d}: {r['error']}")
    print(f"{'fault':<14}" + "".join(f"{d:>12}" for d in DTYPES))
    for i, row in enumerate(results[DTYPES[0]]["faults"]):
        cells = []
        for d in DTYPES:
            f = results[d]["faults"][i]
            cells.append(f"{f['flagged']}/{f['cases']}" if f["supported"] else "-")
        print(f"{row['spec']:<14}" + "".join(f"{c:>12}" for c in cells))
    print(f"{'cost (flag-on runs)':<14}" + "".join(f"{results[d]['seconds'].get('per_flag_on_run', 0):>12.1f}" for d in DTYPES))


if __name__ == "__main__":
    main()
