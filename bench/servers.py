"""The gate on the servers people run, side by side in one run: per server, `gatekeeper evaluate --flag
prefix_cache` on the default model and battery, its verdict, the cached share of the stable-prefix
bound (counted in the server's cache granularity) and the prefill seconds off and on as the server
reports them.

Each server is started on loopback as the tests start it (tests/served.py): llama-server switched per
request (`cache_prompt`), vLLM for CPUs as two deployments (prefix caching off and on, blocks of 32),
mlx_lm.server as two (prompt cache size 0 and default), llama-cpp-python's server as two (no cache
and `--cache true`; it reports no cached tokens). mlx's CPU backend is slow on this model: give it a
smaller `--limit-mlx`, or leave it out with `--servers`.

    python bench/servers.py [--limit 1] [--limit-mlx 1] [--servers llama-server,vllm,mlx,llama-cpp-python]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SERVERS = ("llama-server", "vllm", "mlx", "llama-cpp-python")


def deployments(name: str, logs: Path, stack: ExitStack) -> str:
    """Start the server's deployments; the profile lines that point the http adapter at them."""
    sys.path.insert(0, str(ROOT / "tests"))
    from served import llama_cpp_python_server, llama_server, mlx_server, vllm_server

    from gatekeeper.setup.models import default_model_dir, find_gguf

    model, gguf = default_model_dir(), find_gguf()
    if name == "llama-server":
        url = stack.enter_context(llama_server(gguf, "-fa", "off", log=logs / "llama.log"))
        return f"url: {url}\ncache_switch: cache_prompt\n"
    if name == "vllm":
        off = stack.enter_context(vllm_server(model, "--dtype", "float32", "--no-enable-prefix-caching", log=logs / "vllm-off.log"))
        on = stack.enter_context(vllm_server(model, "--dtype", "float32", "--enable-prefix-caching", log=logs / "vllm-on.log"))
        return f"url: {off}\nurl_on: {on}\n"
    if name == "mlx":
        off = stack.enter_context(mlx_server(model, "--prompt-cache-size", "0", log=logs / "mlx-off.log"))
        on = stack.enter_context(mlx_server(model, log=logs / "mlx-on.log"))
        return f"url: {off}\nurl_on: {on}\ntokenizer: default\n"
    off = stack.enter_context(llama_cpp_python_server(gguf, log=logs / "lcp-off.log"))
    on = stack.enter_context(llama_cpp_python_server(gguf, "--cache", "true", log=logs / "lcp-on.log"))
    return f"url: {off}\nurl_on: {on}\ntokenizer: default\n"


def evaluate(name: str, limit: int, tmp: Path) -> dict:
    ws = tmp / name
    for folder in ("engines", "assertions", "prompts", "policies"):
        shutil.copytree(ROOT / folder, ws / folder, ignore=shutil.ignore_patterns("examples"))
    with ExitStack() as stack:
        (ws / "engines" / "served.yaml").write_text("adapter: http\ntimeout: 1800\n" + deployments(name, tmp, stack))
        cmd = [sys.executable, "-m", "gatekeeper.cli", "--workspace", str(ws), "evaluate", "--flag", "prefix_cache",
               "--engine", "served", "--limit", str(limit), "--operator", "bench", "--json"]
        out = json.loads(subprocess.run(cmd, capture_output=True, text=True).stdout)
    if "error" in out:
        sys.exit(f"{name}: {out['error']}")
    return out


def prefill(out: dict, side: str) -> float:
    return sum(row["prefill_s"] for row in out["telemetry"][side].values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=1, help="cases per suite")
    ap.add_argument("--limit-mlx", type=int, default=1, help="cases per suite on mlx_lm.server")
    ap.add_argument("--servers", default=",".join(SERVERS), help="comma-separated, of: " + ", ".join(SERVERS))
    args = ap.parse_args()
    chosen = [s for s in args.servers.split(",") if s]
    if unknown := set(chosen) - set(SERVERS):
        sys.exit(f"--servers: unknown {', '.join(sorted(unknown))}; pick from {', '.join(SERVERS)}")
    with tempfile.TemporaryDirectory() as tmp:
        results = {s: evaluate(s, args.limit_mlx if s == "mlx" else args.limit, Path(tmp)) for s in chosen}
    print(f"{'server':<18}{'verdict':<14}{'cached/bound':>14}{'share':>8}{'prefill s off':>15}{'on':>9}{'on/off':>8}  first reason")
    for name, out in results.items():
        tokens = out["tokens"]
        cached = "n/a" if tokens["cached_on"] is None else str(tokens["cached_on"])
        off, on = prefill(out, "off"), prefill(out, "on")
        print(f"{name:<18}{out['verdict']:<14}{cached + '/' + str(tokens['stable_prefix_bound']):>14}"
              f"{out['exercised_share']:>8.0%}{off:>15.2f}{on:>9.2f}{on / off if off else 0:>8.2f}  {out['reasons'][0][:60]}")


if __name__ == "__main__":
    main()
