"""What a sampled evaluation costs against the greedy one, and what it certifies per minute, side by side in one run.

`gatekeeper evaluate --flag prefix_cache` on two copies of the default workspace (the default model, the shipped
battery, `--limit N` cases per suite): as shipped (greedy), and with every suite's decoding sampled (by default
temperature 0.7, top-p 0.9, repetition penalty 1.1, 4 samples per case). Printed per run: the verdict, wall seconds,
answers and coupled steps, the per-token total-variation bound the coupled steps certify and the coupled steps per
minute; then the sampled run's cost as a multiple of the greedy one's. A third run reads pass rates: the shipped
`kv_q8` example (a change that is not exact, gated by non-inferiority on the in-process llama.cpp engine) under the
same sampled decoding, with the paired bound on the loss in pass rate it reached and the margin it supports. With
`--bugs`, the sampled entries of `bench/real_bugs/` (those that declare a decoding) run too, a row per release.

    python bench/sampled.py [--limit N] [--engine NAME] [--samples K] [--bugs] [--json]
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

import yaml

ROOT = Path(__file__).resolve().parent.parent
SAMPLED = {"temperature": 0.7, "top_p": 0.9, "repetition_penalty": 1.1}


def run(limit: int, engine: str, decoding: dict | None, flag: str = "prefix_cache") -> dict:
    """One evaluation of a copy of the default workspace; ``decoding``: merged into every suite's (None: as shipped);
    ``flag``: the shipped policy, or an example's (``policies/examples/FLAG.yaml``)."""
    with tempfile.TemporaryDirectory(prefix="gatekeeper-sampled-") as tmp:
        ws = Path(tmp) / "ws"
        for folder in ("engines", "assertions", "prompts", "policies"):
            shutil.copytree(ROOT / folder, ws / folder, ignore=shutil.ignore_patterns("examples"))
        if flag != "prefix_cache":
            shutil.copy(ROOT / "policies" / "examples" / f"{flag}.yaml", ws / "policies")
        if decoding:
            for path in (ws / "assertions").glob("*.yaml"):
                suite = yaml.safe_load(path.read_text())
                suite["decoding"] = {**suite.get("decoding", {}), **decoding}
                path.write_text(yaml.safe_dump(suite, sort_keys=False, allow_unicode=True))
        t0 = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "gatekeeper.cli", "--workspace", str(ws), "evaluate", "--flag",
                               flag, "--engine", engine, "--limit", str(limit), "--json"],
                              capture_output=True, text=True)
        wall = time.perf_counter() - t0
    try:
        out = json.loads(done.stdout)
    except ValueError:
        raise SystemExit(f"evaluate exited {done.returncode}: {done.stderr[-2000:]}") from None
    s, rates = out.get("sampling") or {}, out.get("paired") or {}
    return {"decoding": ("sampled" if decoding else "greedy") + ("" if flag == "prefix_cache" else f" {flag}"),
            "verdict": out["verdict"], "cases": out["cases"],
            "loss_bound": rates.get("upper"), "supported_margin": rates.get("supported_margin"),
            "wall_s": round(wall, 1), "answers": s.get("answers", out["cases"]), "coupled_steps": s.get("steps"),
            "mismatches": s.get("mismatches"), "tv_bound": round(s["tv_bound"], 4) if s else None,
            "steps_per_min": round(s["steps"] / (wall / 60), 1) if s else None,
            "declared_p": {k: v["p"] for k, v in (s.get("declared") or {}).items()}, "reasons": out["reasons"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=1, help="cases per suite (default 1)")
    ap.add_argument("--engine", default="auto", help="the engine profile (default: auto, the default model)")
    ap.add_argument("--samples", type=int, default=4, help="sampled answers per case (default 4)")
    ap.add_argument("--bugs", action="store_true", help="also the sampled entries of bench/real_bugs (minutes each)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    sampled = {**SAMPLED, "samples": a.samples}
    rows = [run(a.limit, a.engine, None), run(a.limit, a.engine, sampled), run(a.limit, "llamacpp", sampled, "kv_q8")]
    bugs = real_bug_rows() if a.bugs else []
    if a.json:
        print(json.dumps({"runs": rows, "real_bugs": bugs}, indent=2))
        return
    print(f"{'decoding':<9} {'verdict':<13} {'cases':>5} {'answers':>7} {'wall s':>7} {'steps':>6} {'mism.':>5} "
          f"{'TV bound':>9} {'steps/min':>9}")
    for r in rows:
        print(f"{r['decoding']:<9} {r['verdict']:<13} {r['cases']:>5} {r['answers']:>7} {r['wall_s']:>7} "
              f"{r['coupled_steps'] or '-':>6} {r['mismatches'] if r['mismatches'] is not None else '-':>5} "
              f"{r['tv_bound'] if r['tv_bound'] is not None else '-':>9} {r['steps_per_min'] or '-':>9}")
    greedy, sampled, rated = rows
    print(f"pass rates ({rated['decoding']}, {rated['answers']} answers in {rated['wall_s']} s): the loss in pass rate "
          f"at most {rated['loss_bound']}, supporting a margin of {rated['supported_margin']} "
          f"({rated['verdict']}; {60 * rated['answers'] / rated['wall_s']:.1f} paired answers per minute)")
    print(f"sampled / greedy wall time: {sampled['wall_s'] / greedy['wall_s']:.2f}x "
          f"({sampled['answers']} sampled answers against {greedy['answers']} greedy ones)")
    print(f"the sampled run's draws against the declared decoding, KS p per side: {sampled['declared_p']}")
    for r in rows:
        if r["verdict"] != "PASS":
            print(f"{r['decoding']}: {r['verdict']}: " + "; ".join(r["reasons"][:3]))
    for b in bugs:
        print(f"{b['id']}: affected {b['affected']} {b['affected_verdict']}, fixed {b['fixed']} {b['fixed_verdict']}: "
              f"{'holds' if b['holds'] else 'DOES NOT HOLD'}; {b['first_reason'][:200]}")


def real_bug_rows() -> list[dict]:
    """The sampled real-bug entries (``bench/real_bugs.py``), each at its last affected and first fixed release."""
    sys.path.insert(0, str(Path(__file__).parent))
    import real_bugs

    out = []
    for entry in (e for e in real_bugs.entries() if e.get("decoding")):
        r = {side: real_bugs.run(entry, side) for side in ("affected", "fixed")}
        out.append({"id": entry["id"], "holds": real_bugs.judged(entry, r), "affected": r["affected"]["release"],
                    "affected_verdict": r["affected"]["verdict"], "fixed": r["fixed"]["release"],
                    "fixed_verdict": r["fixed"]["verdict"], "first_reason": (r["affected"].get("reasons") or [""])[0]})
    return out


if __name__ == "__main__":
    main()
