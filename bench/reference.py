"""What the reference arm costs and what it catches, side by side in one run.

1. Cost: `gatekeeper evaluate --flag prefix_cache` on a copy of the default workspace (the default model, the shipped
   battery, `--limit N` cases per suite), the reference arm on (as shipped): its seconds against the evaluation's wall
   time, and the reads it made; in process (torch) and served (llama-server on the default GGUF, started by gatekeeper,
   one forced request per answer turn).
2. Catch: the real-bug entries whose defect both arms share (`bench/real_bugs/*-base.yaml`), at their last affected
   and first fixed release, with the reference arm off (what the gate saw before it) and on.

    python bench/reference.py [--limit N] [--skip-cost] [--skip-catch]
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
sys.path.insert(0, str(ROOT / "bench"))
import real_bugs  # noqa: E402


def served_profile() -> str:
    """llama-server on the default GGUF, switched per request, started by gatekeeper."""
    from gatekeeper.setup.llama_build import build_server
    from gatekeeper.setup.models import find_gguf

    return (f"adapter: http\ncache_switch: cache_prompt\ntimeout: 600\nserve:\n  command: {build_server()} -m "
            f"{find_gguf()} --host {{host}} --port {{port}} -np 1 -c 8192 -fa off\n  ready: /health\n")


def cost(limit: int, engine: str) -> dict:
    """One evaluation of the default workspace with the reference arm on: its seconds and the whole run's."""
    with tempfile.TemporaryDirectory(prefix="gatekeeper-reference-") as tmp:
        ws = Path(tmp) / "ws"
        for folder in ("engines", "assertions", "prompts", "policies"):
            shutil.copytree(ROOT / folder, ws / folder, ignore=shutil.ignore_patterns("examples"))
        if engine == "served":
            (ws / "engines" / "served.yaml").write_text(served_profile())
        t0 = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "gatekeeper.cli", "--workspace", str(ws), "evaluate", "--flag",
                               "prefix_cache", "--engine", engine, "--limit", str(limit), "--json"],
                              capture_output=True, text=True)
        wall = time.perf_counter() - t0
    out = json.loads(done.stdout)
    r = out["reference"] or {}
    return {"engine": engine, "verdict": out["verdict"], "cases": out["cases"], "wall_s": round(wall, 1),
            "reference_s": r.get("seconds"), "share": round(r["seconds"] / wall, 3) if r.get("seconds") else None,
            "positions": {k: a["positions"] for k, a in r.get("arms", {}).items()},
            "floor": r.get("floor"), "dtype": r.get("dtype"), "reasons": out["reasons"]}


def catch() -> list[dict]:
    """Each shared-defect entry's two releases, the reference arm off and on."""
    rows = []
    for entry in (e for e in real_bugs.entries() if e.get("shared")):
        for label, extra in (("reference off", "reference: false\n"), ("reference on", "")):
            variant = real_bugs.variant(entry, extra=extra)
            found = {side: real_bugs.run(variant, side) for side in ("affected", "fixed")}
            rows.append({"id": entry["id"], "arm": label, **found, "holds": real_bugs.judged(variant, found)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=2, help="cases per suite in the cost run (default 2)")
    ap.add_argument("--skip-cost", action="store_true")
    ap.add_argument("--skip-catch", action="store_true", help="only the cost rows")
    ap.add_argument("--engine", action="append", choices=("torch", "served"), help="the cost rows to run (default both)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    a.engine = a.engine or ["torch", "served"]
    spent = [] if a.skip_cost else [cost(a.limit, engine) for engine in a.engine]
    caught = [] if a.skip_catch else catch()
    if a.json:
        print(json.dumps({"cost": spent, "catch": caught}, indent=2))
        return
    for row in spent:
        print(f"cost ({row['engine']}): the default model, {row['cases']} cases, {row['verdict']}: the reference arm "
              f"{row['reference_s']} s of {row['wall_s']} s ({100 * (row['share'] or 0):.1f}% of the evaluation), "
              f"{row['dtype']}, positions read {row['positions']}, floor {row['floor']}")
        print("\n".join(f"  - {r[:300]}" for r in row["reasons"]))
    for row in caught:
        print(f"{row['id']} ({row['arm']}):")
        for side in ("affected", "fixed"):
            r = row[side]
            print(f"  {side:8} {r['release']:8} {r['verdict']:13} {r['seconds']:6.1f} s  {r['reason'][:150]}")
        print(f"  {'holds' if row['holds'] else 'does not hold'}: affected never PASS, fixed PASS")


if __name__ == "__main__":
    main()
