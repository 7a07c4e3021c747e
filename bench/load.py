"""Evidence under production conditions, side by side in one run, on the default model and battery:

- replicas: `evaluate --flag prefix_cache` on one llama-server vs two replicas (each one slot, one
  thread; `concurrency: 2`), battery cases per second of evaluation wall time, and the ratio;
- load on vLLM for CPUs (prefix caching off and on, float32): the same evaluation alone and under
  `--load 8`; per battery case, the model seconds vLLM reports, alone vs under load (p50/p95 of the
  added latency), the evaluation's verdict, and how many cases' outputs changed between the battery
  decoded one at a time and decoded inside batches (flag off: the `alone~off#0` comparisons).

Servers start on loopback as the tests start them (tests/served.py).

    python bench/load.py [--limit 2] [--parts replicas,vllm]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def workspace(tmp: Path, name: str, profile: str) -> Path:
    ws = tmp / name
    for folder in ("engines", "assertions", "prompts", "policies"):
        shutil.copytree(ROOT / folder, ws / folder, ignore=shutil.ignore_patterns("examples"))
    (ws / "engines" / "served.yaml").write_text("adapter: http\ntimeout: 1800\n" + profile)
    return ws


def evaluate(ws: Path, limit: int | None, *extra: str) -> tuple[dict, dict, float]:
    """(outcome, ledger record, wall seconds) of one evaluation through the CLI."""
    cmd = [sys.executable, "-m", "gatekeeper.cli", "--workspace", str(ws), "evaluate", "--flag", "prefix_cache",
           "--engine", "served", "--operator", "bench", *(["--limit", str(limit)] if limit else []), *extra, "--json"]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    out = json.loads(done.stdout or "{}")
    if done.returncode not in (0, 1):
        sys.exit(f"evaluate in {ws.name}: {out.get('error') or done.stderr[-2000:]}")
    shown = subprocess.run([sys.executable, "-m", "gatekeeper.cli", "--workspace", str(ws), "ledger", "show",
                            str(out["evaluation_id"]), "--json"], capture_output=True, text=True)
    return out, json.loads(shown.stdout), wall


def model_seconds(record: dict, config: str) -> dict[str, float]:
    return {r["case_id"]: sum(t["prefill_s"] + t["decode_s"] for t in r["result"]["turns"])
            for r in record["case_results"] if r["config"] == config and r["repeat"] == 0}


def nearest(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[max(1, -(-len(ordered) * p // 100)) - 1] if ordered else float("nan")


def replicas(limit: int | None, tmp: Path) -> None:
    from served import llama_server

    from gatekeeper.setup.models import find_gguf

    rows = []
    with ExitStack() as stack:
        a = stack.enter_context(llama_server(find_gguf(), "-fa", "off", log=tmp / "a.log"))
        b = stack.enter_context(llama_server(find_gguf(), "-fa", "off", log=tmp / "b.log"))
        for label, urls in (("1 replica", [a]), ("2 replicas", [a, b])):
            ws = workspace(tmp, label.replace(" ", "-"), f"url: {json.dumps(urls)}\ncache_switch: cache_prompt\nconcurrency: 2\n")
            out, record, wall = evaluate(ws, limit)
            runs = len({(r["config"], r["repeat"]) for r in record["case_results"]})
            rows.append((label, out["verdict"], out["cases"] * runs / wall, wall))
    print("\nllama-server replicas (one slot, one thread each; concurrency 2)")
    print(f"{'':<12}{'verdict':>10}{'cases/s':>10}{'wall s':>9}")
    for label, verdict, rate, wall in rows:
        print(f"{label:<12}{verdict:>10}{rate:>10.3f}{wall:>9.1f}")
    print(f"ratio 2 replicas / 1: {rows[1][2] / rows[0][2]:.2f}x cases per second")


def vllm(limit: int | None, tmp: Path) -> None:
    from served import vllm_server

    from gatekeeper.setup.models import default_model_dir

    model = default_model_dir()
    with ExitStack() as stack:
        off = stack.enter_context(vllm_server(model, "--dtype", "float32", "--no-enable-prefix-caching", log=tmp / "off.log"))
        on = stack.enter_context(vllm_server(model, "--dtype", "float32", "--enable-prefix-caching", log=tmp / "on.log"))
        ws = workspace(tmp, "vllm", f"url: {off}\nurl_on: {on}\n")
        alone, _, wall_alone = evaluate(ws, limit)
        loaded, record, wall_loaded = evaluate(ws, limit, "--load", "8")
    single, batched = model_seconds(record, "alone"), model_seconds(record, "off")
    added = [batched[c] - single[c] for c in single]
    changed = [c["case_id"] for c in record["comparisons"] if c["detail"]["pair"] == "alone#0~off#0" and not c["equal"]]
    print("\nvLLM for CPUs, float32, prefix caching off/on, alone vs --load 8 (battery prompts as background)")
    print(f"verdict alone: {alone['verdict']} ({wall_alone:.0f} s); under load: {loaded['verdict']} ({wall_loaded:.0f} s)")
    for r in loaded["reasons"][:6]:
        print(f"  {r}")
    print(f"model seconds per case, alone: p50 {nearest(list(single.values()), 50):.3f}; "
          f"under load: p50 {nearest(list(batched.values()), 50):.3f}")
    print(f"added latency per case under load: p50 {nearest(added, 50):+.3f} s, p95 {nearest(added, 95):+.3f} s")
    print(f"outputs changed, one at a time vs batched (flag off): {len(changed)} of {len(single)} cases {changed}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=int, default=None, help="at most N cases per suite")
    ap.add_argument("--parts", default="replicas,vllm")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    with tempfile.TemporaryDirectory() as tmp:
        for part in args.parts.split(","):
            {"replicas": replicas, "vllm": vllm}[part](args.limit, Path(tmp))


if __name__ == "__main__":
    main()
