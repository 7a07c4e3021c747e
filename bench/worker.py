"""What running an engine in another Python environment costs: ``gatekeeper evaluate --flag prefix_cache`` on the
default model with the torch adapter in process and in a worker process (a profile's ``python``), side by side in
one run, alternating; the verdicts and every recorded token must agree.

The second environment is ``gatekeeper runtime prepare NAME PACKAGES`` (``--runtime NAME``, made once if missing),
or by default a virtual environment of this interpreter that sees this one's packages (the same versions: only
the process boundary differs).

    python bench/worker.py [--limit 2] [--reps 2] [--runtime NAME --packages 'transformers==5.25.0']

``--upgrade FROM TO`` instead evaluates an upgrade as a user gates it: the default model's torch profile runs under
the environment FROM, and the declared flag ``upgrade`` (``change: {profile: {python: TO}}``) under TO, both made
by ``gatekeeper runtime prepare`` beforehand; it prints the verdict, the libraries of each side and whether the
pipeline-version hash moved.

    python bench/worker.py --upgrade tf-5.24.0 tf-5.25.0 [--limit 2]
"""

from __future__ import annotations

import argparse
import json
import shutil
import site
import statistics
import subprocess
import sys
import tempfile
import time
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def gk(ws: Path, *args: str) -> tuple[float, dict]:
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "gatekeeper.cli", "--workspace", str(ws), *args, "--json"],
                          capture_output=True, text=True)
    if done.returncode not in (0, 1):
        raise SystemExit(f"gatekeeper {' '.join(args)}: {done.stdout[-800:]} {done.stderr[-800:]}")
    return time.perf_counter() - t0, json.loads(done.stdout)


def second_python(tmp: Path, runtime: str | None, packages: list[str]) -> str:
    if runtime:
        from gatekeeper.setup.runtimes import environment, prepare

        return environment(runtime) or prepare(runtime, packages)["python"]
    root = tmp / "env2"
    venv.EnvBuilder(with_pip=False).create(root)
    (next((root / "lib").glob("python*/site-packages")) / "parent.pth").write_text(site.getsitepackages()[0] + "\n")
    return str(root / "bin" / "python")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=2, help="cases per suite of the shipped battery")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--runtime", help="an environment made by 'gatekeeper runtime prepare' (made here if missing)")
    ap.add_argument("--packages", nargs="*", default=[], help="what --runtime holds, if it must be made")
    ap.add_argument("--upgrade", nargs=2, metavar=("FROM", "TO"), help="evaluate an upgrade between two environments")
    a = ap.parse_args()
    if a.upgrade:
        upgrade(*a.upgrade, a.limit)
        return
    with tempfile.TemporaryDirectory(prefix="gatekeeper-worker-") as tmp:
        ws = Path(tmp) / "ws"
        for folder in ("assertions", "engines", "policies", "prompts"):
            shutil.copytree(ROOT / folder, ws / folder)
        python = second_python(Path(tmp), a.runtime, a.packages)
        torch = (ws / "engines" / "torch.yaml").read_text()
        (ws / "engines" / "worker.yaml").write_text(torch + f"python: {python}\n")
        policy = ws / "policies" / "prefix_cache.yaml"
        policy.write_text(policy.read_text() + "probes: off\ndistance: false\n")
        seconds: dict[str, list[float]] = {"torch": [], "worker": []}
        outs: dict[str, dict] = {}
        for _ in range(a.reps):
            for engine in ("torch", "worker"):
                s, out = gk(ws, "evaluate", "--flag", "prefix_cache", "--engine", engine, "--limit", str(a.limit))
                seconds[engine].append(s)
                outs[engine] = out
        tokens = {}
        for engine, out in outs.items():
            record = gk(ws, "ledger", "show", str(out["evaluation_id"]))[1]
            tokens[engine] = {(r["case_id"], r["config"], r["repeat"]): [t["tokens"] for t in r["result"]["turns"]]
                              for r in record["case_results"]}
        same = sum(tokens["worker"].get(k) == v for k, v in tokens["torch"].items())
        print(f"evaluate --flag prefix_cache --limit {a.limit} on the default model, median of {a.reps} (worker: {python})")
        print(f"{'engine':10} {'verdict':8} {'wall s':>8}")
        for engine, xs in seconds.items():
            print(f"{engine:10} {outs[engine]['verdict']:8} {statistics.median(xs):8.1f}")
        ratio = statistics.median(seconds["worker"]) / statistics.median(seconds["torch"])
        print(f"worker / in-process: {ratio:.3f}; runs with the same tokens: {same} of {len(tokens['torch'])}")


def upgrade(old: str, new: str, limit: int) -> None:
    with tempfile.TemporaryDirectory(prefix="gatekeeper-upgrade-") as tmp:
        ws = Path(tmp) / "ws"
        for folder in ("assertions", "engines", "policies", "prompts"):
            shutil.copytree(ROOT / folder, ws / folder)
        shutil.rmtree(ws / "policies" / "examples", ignore_errors=True)
        torch = ws / "engines" / "torch.yaml"
        torch.write_text(torch.read_text() + f"python: {old}\n")
        (ws / "policies" / "upgrade.yaml").write_text(f"flag: upgrade\ngate: byte_equivalence\nprobes: off\ndistance: false\n"
                                                      f"change: {{profile: {{python: {new}}}}}\n")
        s, out = gk(ws, "evaluate", "--flag", "upgrade", "--engine", "torch", "--limit", str(limit))
        record = gk(ws, "ledger", "show", str(out["evaluation_id"]))[1]
        sides = {side: record["identity"][side]["engine"]["libraries"] for side in ("off", "on")}
        print(f"evaluate --flag upgrade ({old} -> {new}) --limit {limit}: {out['verdict']} in {s:.0f} s")
        for reason in out["reasons"]:
            print(f"  {reason}")
        print(f"  flag off runs {sides['off']}; flag on runs {sides['on']}")


if __name__ == "__main__":
    main()
