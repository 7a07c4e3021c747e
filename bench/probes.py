"""What the cache probes cost and what they catch, side by side in one run.

1. Cost: `gatekeeper evaluate --flag prefix_cache` on a copy of the default workspace (the default model on
   the torch engine, the shipped battery), with the probes on: their seconds against the evaluation's wall time.
2. Catch: a real llama-server (the default model's GGUF) behind a front that plants one cache fault on the
   flag-on side (tests/cache_fronts.py: a stale repeat, a prompt inside the cache answered on an empty one, a
   continuation that lost the answer, a lost window), evaluated with the probes off and on: the verdict each
   gives, and how many requests the fault changed. The battery is the tests' tiny suite by default: on the
   shipped one (~1,000-token prompts) llama-server with two threads already FAILs behind a faithful front.

    python bench/probes.py [--limit N] [--skip-cost] [--window 512] [--battery tiny|shipped]
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
MODES = ("none", "stale_repeat", "inside_empty", "continuation_skip", "lost_window")


def workspace(tmp: Path, name: str, probes: str, battery: str = "shipped") -> Path:
    ws = tmp / name
    for folder in ("engines", "assertions", "prompts", "policies"):
        shutil.copytree(ROOT / folder, ws / folder, ignore=shutil.ignore_patterns("examples"))
    if battery == "tiny":  # the tests' four-case suite (tests/conftest.py), on which llama-server's hit is exact
        sys.path.insert(0, str(ROOT / "tests"))
        from conftest import SUITE

        shutil.rmtree(ws / "assertions")
        (ws / "assertions").mkdir()
        (ws / "assertions" / "tiny.yaml").write_text(SUITE)
    policy = ws / "policies" / "prefix_cache.yaml"
    policy.write_text("".join(x for x in policy.read_text().splitlines(keepends=True) if not x.startswith("probes:"))
                      + f"probes: {probes}\n")
    return ws


def evaluate(ws: Path, engine: str, limit: int | None) -> tuple[dict, float]:
    cmd = [sys.executable, "-m", "gatekeeper.cli", "--workspace", str(ws), "evaluate", "--flag", "prefix_cache",
           "--engine", engine, "--json", *(["--limit", str(limit)] if limit else [])]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    try:
        return json.loads(done.stdout), wall
    except ValueError:
        raise SystemExit(f"evaluate failed ({done.returncode}): {done.stdout[-500:]} {done.stderr[-1500:]}") from None


def cost(tmp: Path, limit: int | None) -> None:
    out, wall = evaluate(workspace(tmp, "cost", "{}"), "auto", limit)
    print(f"default model, torch, shipped battery ({out['cases']} cases): verdict {out['verdict']}, evaluation "
          f"{wall:.1f} s wall, probes {out['probe_seconds']:.1f} s = {out['probe_seconds'] / wall:.1%} of it")
    print("  probes:", ", ".join(f"{k} {v}" for k, v in out["probes"].items()))


def catch(tmp: Path, limit: int | None, window: int, battery: str) -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    from cache_fronts import cache_front
    from served import llama_server

    from gatekeeper.setup.models import find_gguf

    print(f"\nllama-server behind a faulty flag-on front, {battery} battery, probes off vs on (window {window}):")
    print(f"{'fault':<18} {'battery alone':<14} {'with probes':<12} {'probes that differ':<34} planted (alone/probes)")
    with llama_server(find_gguf(), "-fa", "off", log=tmp / "server.log") as server:
        for mode in MODES:
            row = []
            for probes in ("off", f"{{window: {window}}}"):
                with cache_front(server, mode, window) as (front, history):
                    ws = workspace(tmp, f"{mode}-{len(row)}", probes, battery)
                    (ws / "engines" / "served.yaml").write_text(
                        f"adapter: http\nurl: {server}\nurl_on: {front}\ncache_switch: cache_prompt\ntimeout: 1800\n")
                    out, _ = evaluate(ws, "served", limit)
                    row.append((out, history.planted))
            (alone, n0), (probed, n1) = row
            differ = ", ".join(k for k, v in probed["probes"].items() if v == "differs") or "-"
            print(f"{mode:<18} {alone['verdict']:<14} {probed['verdict']:<12} {differ:<34} {n0}/{n1}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, default=None, help="cases per suite (default: all)")
    ap.add_argument("--skip-cost", action="store_true", help="leave out the torch cost measurement")
    ap.add_argument("--window", type=int, default=512, help="the window the lost_window fault and its probe use")
    ap.add_argument("--battery", choices=("tiny", "shipped"), default="tiny",
                    help="the faults' battery: tiny (the tests' suite) or the shipped one, whose ~1,000-token prompts "
                         "llama-server with two threads does not reuse exactly (a FAIL before any fault)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_cost:
            cost(Path(tmp), args.limit)
        catch(Path(tmp), args.limit, args.window, args.battery)


if __name__ == "__main__":
    main()
