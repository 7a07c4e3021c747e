"""Changes of known size on the default model, each evaluated by the gate (prints a table; no pass/fail).

The ladder, on the default model's GGUF in-process (llama.cpp, flash attention on both sides so only the
change differs): an A/A rung (a change that changes nothing), then the KV cache stored as q8_0, q5_1 and q4_0
(keys and values); then the weights, against the model's weights as F16 (``bench/gguf_rungs.py``): quantized
to q8_0, q5_1 and q4_0, and F16 with seeded Gaussian noise (5% of each matrix's standard deviation); and the
runtime migration of ``policies/examples/runtime.yaml`` (torch in float32 to llama.cpp's Q4_1 GGUF). Each rung is
a declared change gated by ``non_inferiority`` at ``--margin``; the row gives the teacher-forced distance (mean
KL(off||on) ± SE, p99, same top-1), the harmful and beneficial flips, the loss in pass rate with its one-sided
bound, the verdict, the cases used and the seconds, and the cost of the teacher-forced pass against decoding the
flag-on side (both measured in the same evaluation).

What to expect: the A/A rung never FAILs (its KL is the floor, 0 on a deterministic engine) and the KL column
grows down each part of the ladder as llama.cpp's published quantization tables do (q8_0 << q5_1 < q4_0). On the shipped
battery (20 cases) no rung can PASS a small margin: the verdicts say how many cases it would need. ``--battery world``
runs the country facts of ``bench/world_battery.py`` instead (answers from a data package, clustered by country),
large enough for the flips to decide; ``--max-kld`` and ``--min-same-top1`` bound the distance as a policy may.

    python bench/lossy.py [--limit N] [--margin 0.05] [--only aa q8_0 w_q4_0 ...] [--battery world --countries 120]
                          [--max-kld 0.01 --min-same-top1 0.95]
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
BASE = {"flash_attn": True, "n_ctx": 4096}
RUNGS = {"aa": {"chunk": 256},  # the profile as it is: a change that changes nothing
         "q8_0": {"options": {"type_k": "q8_0", "type_v": "q8_0"}},
         "q5_1": {"options": {"type_k": "q5_1", "type_v": "q5_1"}},
         "q4_0": {"options": {"type_k": "q4_0", "type_v": "q4_0"}}}
WEIGHTS = ("w_q8_0", "w_q5_1", "w_q4_0", "w_noise")  # against engines/f16.yaml: the model field names the rung's file
MIGRATION = "runtime"  # policies/examples/runtime.yaml's change: the default model on torch (float32) to llama.cpp (Q4_1)


def workspace(into: Path, a: argparse.Namespace) -> Path:
    ws, rungs = into / "ws", a.only
    for folder in ("assertions", "prompts", "policies"):
        shutil.copytree(ROOT / folder, ws / folder, ignore=shutil.ignore_patterns("examples"))
    policy = f"gate: non_inferiority\nmargin: {a.margin}\nprobes: off\n"
    if a.battery == "world":
        from world_battery import write

        shutil.rmtree(ws / "assertions")
        n = write(ws, ["capital", "continent", "demonym"], a.countries)
        print(f"world battery: {n} cases from {a.countries or 'all'} countries, clustered by country")
        policy += "cluster: var:country\n"
    policy += "".join(f"{k}: {v}\n" for k, v in (("max_kld", a.max_kld), ("min_same_top1", a.min_same_top1)) if v is not None)
    (ws / "engines").mkdir()
    (ws / "engines" / "lc.yaml").write_text(f"adapter: llamacpp\nmodel: default\nchunk: 256\noptions: {json.dumps(BASE)}\n")
    weights = {}
    if any(r in WEIGHTS for r in rungs):
        from gguf_rungs import ladder

        from gatekeeper.setup.models import find_gguf

        weights = {f"w_{k}": str(v) for k, v in ladder(find_gguf(), into / "weights").items()}
        (ws / "engines" / "f16.yaml").write_text(f"adapter: llamacpp\nmodel: {weights['w_f16']}\nchunk: 256\n"
                                                 f"options: {json.dumps(BASE)}\n")
    if MIGRATION in rungs:
        (ws / "engines" / "torch.yaml").write_text("adapter: torch\nmodel: default\ndtype: float32\ndevice: cpu\n")
    for name in rungs:
        change = ("{engine: lc}" if name == MIGRATION else
                  f"{{profile: {json.dumps({'model': weights[name]} if name in WEIGHTS else RUNGS[name])}}}")
        (ws / "policies" / f"{name}.yaml").write_text(f"flag: {name}\n{policy}change: {change}\n")
    return ws


def evaluate(ws: Path, flag: str, limit: int | None) -> tuple[dict, float]:
    engine = "f16" if flag in WEIGHTS else "torch" if flag == MIGRATION else "lc"
    args = [sys.executable, "-m", "gatekeeper.cli", "--workspace", str(ws), "evaluate", "--flag", flag, "--engine", engine,
            "--operator", "bench", "--json", *(["--limit", str(limit)] if limit else [])]
    t0 = time.perf_counter()
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode not in (0, 1):
        raise SystemExit(f"{flag}: exit {done.returncode}: {done.stdout[-400:]} {done.stderr[-800:]}")
    return json.loads(done.stdout), time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=None, help="cases per suite (default: every case)")
    ap.add_argument("--margin", type=float, default=0.05)
    ap.add_argument("--only", nargs="*", default=[*RUNGS, *WEIGHTS, MIGRATION],
                    choices=[*RUNGS, *WEIGHTS, MIGRATION])
    ap.add_argument("--battery", choices=("shipped", "world"), default="shipped")
    ap.add_argument("--countries", type=int, default=None, help="world battery: a seeded sample of countries")
    ap.add_argument("--max-kld", type=float, default=None)
    ap.add_argument("--min-same-top1", type=float, default=None)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="gatekeeper-lossy-") as tmp:
        ws = workspace(Path(tmp), a)
        print(f"margin {a.margin}, alpha 0.05; default model's GGUF in-process, flash attention on both sides; "
              "KV rungs against the packaged Q4_1 weights, w_ rungs against the same weights as F16, "
              "runtime from torch (float32) to llama.cpp (Q4_1)")
        head = ("rung", "mean KLD ± SE", "p99 KLD", "same top-1", "harmful", "beneficial", "loss [bound]", "verdict",
                "cases", "seconds", "forced / decode on")
        print(" | ".join(head))
        for name in a.only:
            out, wall = evaluate(ws, name, a.limit)
            d, p = out.get("distance") or {}, out.get("paired") or {}
            k = (d.get("distance") or {}).get("kld") or {}
            same = (d.get("distance") or {}).get("same_top1")
            cost = (f"{d['seconds'] / out['seconds']['on']:.2f}" if d.get("seconds") and out["seconds"]["on"] else "n/a")
            print(" | ".join([
                name, f"{k['mean']:.5f} ± {k['se']:.5f}" if k else d.get("not_observable", "n/a"),
                f"{k['p99']:.4f}" if k else "n/a", f"{100 * same:.2f}%" if same is not None else "n/a",
                str(p.get("harmful", "n/a")), str(p.get("beneficial", "n/a")),
                f"{p['loss']:.3f} [{p['upper']:.3f}]" if p else "n/a", out["verdict"], str(out["cases"]),
                f"{wall:.0f}", cost]))
            under = next((r for r in out["reasons"] if r.startswith("underpowered:")), None)
            if under:
                print(f"    {under}")


if __name__ == "__main__":
    main()
