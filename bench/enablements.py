"""The four example enablements (policies/examples/) evaluated on the default workspace, side by side.

Copies the repository's workspace (battery, prompts, engine profiles) into a temporary folder with
all four example policies, runs `gatekeeper evaluate` for each on the default model (torch) or its
GGUF (llamacpp) with a throwaway ledger, and prints per example: the verdict, the cases that
differ, and the on/off ratios of prefill and decode seconds summed over every stage, as each
evaluation's telemetry recorded them (one run of each side, measured in the same evaluation).

    python bench/enablements.py [--limit 1] [--only kv_q8 ...]
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
EXAMPLES = {"kv_q8": "llamacpp", "speculative": "torch", "flash_attn": "llamacpp", "runtime": "torch"}


def workspace(into: Path) -> Path:
    ws = into / "ws"
    for folder in ("engines", "assertions", "prompts", "policies"):
        shutil.copytree(ROOT / folder, ws / folder, ignore=shutil.ignore_patterns("examples"))
    for name in EXAMPLES:
        shutil.copy(ROOT / "policies" / "examples" / f"{name}.yaml", ws / "policies")
    return ws


def evaluate(ws: Path, flag: str, engine: str, limit: int) -> dict:
    cmd = [sys.executable, "-m", "gatekeeper.cli", "--workspace", str(ws), "evaluate", "--flag", flag,
           "--engine", engine, "--limit", str(limit), "--operator", "bench", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True).stdout
    return json.loads(out)


def ratio(on: float, off: float) -> str:
    return f"{on / off:.2f}" if off else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=1, help="cases per suite")
    ap.add_argument("--only", nargs="*", choices=sorted(EXAMPLES), help="these examples only")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ws = workspace(Path(tmp))
        print(f"{'example':<12} {'engine':<9} {'verdict':<8} {'cases':>5} {'differ':>6} "
              f"{'prefill on/off':>14} {'decode on/off':>13}  reasons")
        for flag, engine in EXAMPLES.items():
            if args.only and flag not in args.only:
                continue
            out = evaluate(ws, flag, engine, args.limit)
            if "error" in out:
                print(f"{flag:<12} {engine:<9} error: {out['error']}")
                continue
            tel = {side: {k: sum(s[k] for s in out["telemetry"][side].values()) for k in ("prefill_s", "decode_s")}
                   for side in ("off", "on")}
            reasons = "; ".join(r.split(":")[0] for r in out["reasons"])
            print(f"{flag:<12} {engine:<9} {out['verdict']:<8} {out['cases']:>5} {len(out['differing_cases']):>6} "
                  f"{ratio(tel['on']['prefill_s'], tel['off']['prefill_s']):>14} "
                  f"{ratio(tel['on']['decode_s'], tel['off']['decode_s']):>13}  {reasons}")


if __name__ == "__main__":
    main()
