"""What the review app costs on a long ledger: page latency (p50/p95) of the evaluations list (the newest page, a
page deep in the list, a filter), one evaluation, a case page and their JSON, compare, flags and integrity, against
``ledger show``, ``ledger diff`` and ``ledger list`` on the same ledger, side by side in one run.

The ledger is made of real records: one evaluation run through ``gatekeeper evaluate`` (a tiny random llama built
here, the cache restoring one position short on a few evaluations so cases differ), then its records appended again
through the ledger's own chain code (new ids, verdicts and flags varied) until the chain holds ``--entries``;
``ledger verify`` passes on it. ``gatekeeper review`` runs as its own process; one client on a keep-alive
connection asks for each page in turn, after one warm-up request each.

    python bench/review.py [--entries 100000] [--reps 20] [--cli-reps 5] [--dir DIR]
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import quote

from gatekeeper.identity import child_env

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the tiny model the tests build, and their fault engine (ShortRestore)

RULES = " ".join(f"Rule {i}: the router reads the request, picks a tool, and passes the arguments on." for i in range(12))
SUITE = f"""suite: tiny
stage: tiny
prompt:
  - {{role: system, static: true, text: "{RULES}"}}
  - {{role: user, static: false, text: "{{query}}"}}
decoding: {{max_tokens: 12}}
cases:
""" + "".join(f"  - {{id: q{i}, vars: {{query: \"Request {i}: find item {i * 7 % 13}.\"}}, assert: [{{type: max-length, value: 10000}}]}}\n"
              for i in range(8))


ENV = child_env(PYTHONPATH=str(ROOT / "tests"))  # where the fault engine's profile finds it


def cli(ws: Path, *args: str) -> tuple[float, str]:
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "gatekeeper.cli", "--workspace", str(ws), *args], capture_output=True,
                          text=True, env=ENV)
    if done.returncode not in (0, 1):
        raise SystemExit(f"gatekeeper {' '.join(args)} failed: {done.stderr[-1500:]}")
    return time.perf_counter() - t0, done.stdout


def build(ws: Path, entries: int) -> dict[str, int]:
    """The workspace and its ledger; returns {"pass": id, "fail": id} of two evaluations to show and diff."""
    from tiny_models import build_tiny_llama

    from gatekeeper.ledger import Ledger
    from gatekeeper.ledger.chain import append
    from gatekeeper.ledger.database import write
    from gatekeeper.setup.scaffold import init_workspace

    init_workspace(ws)
    (ws / "assertions" / "assistant.yaml").unlink()
    (ws / "assertions" / "tiny.yaml").write_text(SUITE)
    model = build_tiny_llama(ws.parent / "model")
    for name, adapter in (("auto", "torch"), ("short", "fault_engines:ShortRestore")):
        (ws / "engines" / f"{name}.yaml").write_text(f"adapter: {adapter}\nmodel: {model}\ndtype: float32\ndevice: cpu\n"
                                                     "prefill: monolithic\n")
    policy = ws / "policies" / "prefix_cache.yaml"
    policy.write_text("".join(x for x in policy.read_text().splitlines(keepends=True) if not x.startswith("min_power:"))
                      + "probes: off\ndistance: false\n")
    (ws / "policies" / "static_first.yaml").write_text("flag: static_first\ngate: assertion_equivalence\n")
    made = {}
    for name, engine in (("pass", "auto"), ("fail", "short")):
        _, out = cli(ws, "evaluate", "--flag", "prefix_cache", "--engine", engine, "--operator", "bench", "--json")
        made[name] = json.loads(out)["evaluation_id"]
    url = f"sqlite:///{ws / 'ledger' / 'evidence.db'}"
    with Ledger(url) as ledger:
        records = [ledger.evaluation(made["pass"]), ledger.evaluation(made["fail"])]
        n = 0
        while (ledger.head() or {"entries": 0})["entries"] < entries:
            with write(ledger.engine) as conn:  # set-up, not the bench: one transaction per 100 evaluations
                for _ in range(100):
                    r = records[n % 2]
                    started = {k: r[k] for k in ("operator", "pid", "host", "gate", "identity", "config")}
                    eid = append(conn, "evaluation", {**started, "flag": ("prefix_cache", "static_first")[n % 3 == 2]})
                    for c in r["case_results"]:
                        append(conn, "case_result", {"evaluation_id": eid, **{k: c[k] for k in ("case_id", "config", "repeat", "result")}})
                    for c in r["comparisons"]:
                        append(conn, "comparison", {"evaluation_id": eid, **{k: c[k] for k in ("case_id", "equal", "detail")}})
                    verdict = r["verdict_record"]
                    append(conn, "verdict", {"evaluation_id": eid, "verdict": ("PASS", "FAIL", "INCONCLUSIVE")[n % 3] if n % 2 == 0
                                             else verdict["verdict"], "reasons": verdict["reasons"], "summary": verdict["summary"]})
                    n += 1
            print(f"\r  {ledger.head()['entries']:,} entries", end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)
    return made


def quantiles(xs: list[float]) -> tuple[float, float]:
    xs = sorted(xs)
    return statistics.median(xs), xs[min(len(xs) - 1, round(0.95 * (len(xs) - 1)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--entries", type=int, default=100_000)
    ap.add_argument("--reps", type=int, default=20, help="requests per page")
    ap.add_argument("--cli-reps", type=int, default=5, help="runs per CLI command")
    ap.add_argument("--dir", type=Path, help="build the workspace here, or reuse the one built there before")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="gatekeeper-review-") as tmp:
        ws = (a.dir or Path(tmp)) / "ws"
        t0 = time.perf_counter()
        if (ws / "made.json").is_file():
            made = json.loads((ws / "made.json").read_text())
        else:
            made = build(ws, a.entries)
            (ws / "made.json").write_text(json.dumps(made))
        built = time.perf_counter() - t0
        verify_s, out = cli(ws, "ledger", "verify", "--json")
        verified = json.loads(out)
        listed = json.loads(cli(ws, "ledger", "list", "--json")[1])["evaluations"]
        newest = listed[0]["id"]
        for e in (e for e in listed if e["verdict"] == "FAIL"):  # the newest FAIL with a differing case, to show
            record = json.loads(cli(ws, "ledger", "show", str(e["id"]), "--json")[1])
            if any(not c["equal"] for c in record["comparisons"]):
                fail = e["id"]
                break
        db = ws / "ledger" / "evidence.db"
        print(f"ledger: {verified['entries']:,} entries, {len(listed):,} evaluations, {db.stat().st_size / 2**20:.1f} MB; "
              f"built or reused in {built:.0f} s; ledger verify {verify_s:.1f} s ({'ok' if verified['ok'] else 'NOT OK'})")

        rows = []
        for name, args in (("ledger show ID --json", ["ledger", "show", str(fail), "--json"]),
                           ("ledger diff A B --json", ["ledger", "diff", str(made["pass"]), str(fail), "--json"]),
                           ("ledger list --limit 50 --json", ["ledger", "list", "--limit", "50", "--json"])):
            p50, p95 = quantiles([cli(ws, *args)[0] for _ in range(a.cli_reps)])
            rows.append((f"CLI  {name}", p50 * 1000, p95 * 1000))

        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "gatekeeper.cli", "--workspace", str(ws), "review", "--listen",
                                 "127.0.0.1:0", "--json"], stdout=subprocess.PIPE, text=True, env=ENV)
        try:
            line = proc.stdout.readline() if proc.stdout else ""
            if not line:
                raise SystemExit("gatekeeper review did not start")
            started = time.perf_counter() - t0
            host, port = json.loads(line)["url"].removeprefix("http://").rsplit(":", 1)
            conn = http.client.HTTPConnection(host, int(port), timeout=120)
            case = quote(next(c["case_id"] for c in record["comparisons"] if not c["equal"]), safe="")
            pages = {"/evaluations (newest page)": "/evaluations",
                     "/evaluations?before=MIDDLE": f"/evaluations?before={newest // 2}",
                     "/evaluations?flag=static_first&verdict=FAIL": "/evaluations?flag=static_first&verdict=FAIL",
                     "/evaluations/ID": f"/evaluations/{fail}", "/evaluations/ID.json": f"/evaluations/{fail}.json",
                     "/evaluations/ID/cases/CASE": f"/evaluations/{fail}/cases/{case}",
                     "/evaluations/ID/cases/CASE.json": f"/evaluations/{fail}/cases/{case}.json",
                     "/compare/A/B": f"/compare/{made['pass']}/{fail}", "/flags": "/flags", "/integrity": "/integrity"}
            for name, path in pages.items():
                times = []
                for rep in range(a.reps + 1):
                    t = time.perf_counter()
                    conn.request("GET", path)
                    response = conn.getresponse()
                    response.read()
                    if response.status != 200:
                        raise SystemExit(f"{path}: {response.status}")
                    if rep:  # the first is the warm-up
                        times.append(time.perf_counter() - t)
                p50, p95 = quantiles(times)
                rows.append((f"page {name}", p50 * 1000, p95 * 1000))
        finally:
            proc.terminate()
            proc.wait(20)
        print(f"gatekeeper review: ready in {started:.1f} s (the first integrity check of the whole ledger included)")
        print(f"{'what':52} {'p50 ms':>9} {'p95 ms':>9}")
        for name, p50, p95 in rows:
            print(f"{name:52} {p50:9.1f} {p95:9.1f}")


if __name__ == "__main__":
    main()
