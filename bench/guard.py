"""What the guard costs the live side, and how many shadowed requests it takes to catch a defect, in one run.

Two real llama-servers serve the default model, one thread each: the flag-on deployment and the flag-off one (its
prompt cache off, ``cache_prompt: false`` on every request through a tiny front). ``gatekeeper proxy`` runs as its
own process in front of the flag-on server four times over, each capturing: without a guard, and with ``--guard`` at
shadow rates 1%, 10% and 100% (each on a workspace of its own whose flag is on). Requests go to every proxy in turn, in a shuffled order
and each with a prompt of its own, so drift and the server's cache treat all alike, and the next request waits until the last one's shadow is done (the two
servers share this machine's cores; in production the flag-off deployment has its own); printed: p50 and p99 client
latency per proxy and what each guard adds.

Then detection: a front before the flag-on server that corrupts every k-th answer (a planted defect of rate 1/k, for
three k) behind a proxy guarding at 100% with the policy's limit 0.02 and alpha 0.05, until the guard turns the flag
off; printed beside the power analysis's prediction (``gate.stats.evalues.to_detect``). Failures: the same with a
front that answers 500 to every k-th request (k = 20 and 5: each a ``flag_on_failed`` parting). A fleet: 1, 2 and 3
proxies on one ledger, each before its own front of the flag-on server, only the first corrupting every 8th answer,
requests in turn until the fleet's one test rolls the flag back. In process: ``gatekeeper.Runtime`` on the default
model (the workspace's default engine), without a guard and with ``guard=`` at 10% and 100%, each given the same calls
(call i to each in a shuffled turn);
each call waits until the last one's replay is done, so what is printed is what the guard adds on the caller's thread
(on a machine whose cores the replays share, a replay running beside a call slows it as any other work would).

A staged rollout (``--parts rollout``): the policy's ``rollout: {steps: [0.01, 0.1, 0.5, 1.0], min_comparisons_per_step:
5, hold_s: 0}`` behind one guarding proxy, healthy requests back to back until the guard has raised the flag to every
request (its ``/metrics`` say so); printed: requests and seconds at each step. At a step of share s a step's
comparisons take about min_comparisons_per_step / s requests: the first step is most of a rollout.

Real defects (``--parts real``): each ``bench/real_bugs/`` entry with a ``guard:`` section, at its last affected and
first fixed release: its flag evaluated on a battery that does not reach the defect and flipped on where that PASSes,
then live calls that reach it through ``Runtime(guard=...)``, and again through ``gatekeeper proxy --guard`` in front of
the pipeline served flag on and flag off (``bench/runtime_server.py``), until a rollback or 60 calls
(``real_bugs.guarded``).

    python bench/guard.py [--requests 200] [--calls 40] [--parts latency,detection,failures,fleet,rollout,runtime,real]
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import random
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from hybrid_peers import Server, free_port

from gatekeeper.gate.stats.evalues import to_detect
from gatekeeper.ledger import Ledger, checkpoint
from gatekeeper.setup import llama_build
from gatekeeper.setup.models import find_gguf
from gatekeeper.setup.scaffold import init_workspace
from gatekeeper.traffic.captures.analyze import percentile
from gatekeeper.workspace import Workspace

GUARD = {"limit": 0.02, "alpha": 0.05, "min_comparisons": 10, "batch": 8, "flush_s": 1, "aa_rate": 0}  # one-sample rule
SYSTEM = "You are the support desk's router. Pick one tool for the request and say which, in a word. "
USERS = ["Book a table for four.", "Refund order 1182.", "Reset my password.", "When do you open on Sunday?",
         "Cancel the meeting at noon.", "Which plan fits nine people?", "Translate 'hello' to French.", "List two primes."]


def workspace(root: Path, key: Path, rate: float) -> Path:
    """An init workspace whose prefix_cache is on, with a guard at ``rate`` and ``key`` allowed to sign."""
    init_workspace(root)
    policy = root / "policies" / "prefix_cache.yaml"
    policy.write_text(policy.read_text() + f"guard: {json.dumps({**GUARD, 'rate': rate})}\n")
    kind, b64 = key.with_name(key.name + ".pub").read_text().split()[:2]
    (root / "policies" / "allowed_signers").write_text(f"guard {kind} {b64}\n")
    with Ledger(f"sqlite:///{root / 'ledger' / 'evidence.db'}") as ledger:
        ledger.add_flip("prefix_cache", "on", "bench", "the battery passed")
        checkpoint.after_flip(Workspace(root), ledger, None)
    return root


def proxy(upstream: str, ws: Path | None, other: str, key: Path, scratch: Path, name: str | None = None) -> tuple[subprocess.Popen, int]:
    port = free_port()
    cmd = [sys.executable, "-m", "gatekeeper.cli", *(["--workspace", str(ws)] if ws else []), "proxy", "--upstream", upstream,
           "--listen", f"127.0.0.1:{port}", "--capture", str(scratch / f"capture-{port}.jsonl")]  # every proxy captures
    cmd += ["--guard", "prefix_cache", "--shadow", other, "--sign", str(key)] if ws else []
    cmd += ["--name", name] if name else []
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(scratch / f"proxy-{port}.log", "wb"))
    deadline = time.time() + 60
    while True:
        try:
            http.client.HTTPConnection("127.0.0.1", port, timeout=2).connect()
            return proc, port
        except OSError:
            if time.time() > deadline or proc.poll() is not None:
                raise RuntimeError(f"the proxy did not come up; see {scratch}") from None
            time.sleep(0.1)


def ask(conn: http.client.HTTPConnection, i: int) -> tuple[float, str]:
    body = {"prompt": SYSTEM + USERS[i % len(USERS)] + f" #{i}", "max_tokens": 8, "temperature": 0}
    start = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = conn.getresponse()
    data = r.read()
    seconds = time.perf_counter() - start
    assert r.status == 200, data[:300]
    return seconds, json.loads(data)["choices"][0]["text"]


def settle(conn: http.client.HTTPConnection) -> None:
    """Wait until the proxy's shadows are done: on two cores the flag-off server's compute would otherwise slow the
    next request, whichever proxy it goes to, and the figures would measure the machine, not the proxy."""
    while True:
        try:
            with urllib.request.urlopen(f"http://{conn.host}:{conn.port}/metrics", timeout=10) as r:
                text = r.read().decode()
        except urllib.error.HTTPError:  # a proxy without a guard forwards /metrics upstream
            return
        line = next((x for x in text.splitlines() if x.startswith("gatekeeper_guard_in_flight")), None)
        if line is None or line.endswith(" 0"):
            return
        time.sleep(0.002)


@contextmanager
def front(upstream: str, every: int = 0, cache: bool = True, fail: bool = False):
    """``upstream`` behind a front: ``cache`` False adds cache_prompt: false; ``every`` k corrupts each k-th answer (with
    ``fail``, answers it 500 instead)."""
    count = [0]

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if not cache:
                body["cache_prompt"] = False
            req = urllib.request.Request(upstream + self.path, json.dumps(body).encode(), {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                answer = json.loads(r.read())
            count[0] += 1 if self.path == "/v1/completions" else 0
            if fail and every and self.path == "/v1/completions" and count[0] % every == 0:
                self.send_response(500)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            if every and self.path == "/v1/completions" and count[0] % every == 0:
                answer["choices"][0]["text"] = answer["choices"][0]["text"][::-1] + " (stale)"
            payload = json.dumps(answer).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=200, help="per proxy, for the latency part")
    ap.add_argument("--calls", type=int, default=40, help="per Runtime, for the in-process part")
    ap.add_argument("--parts", default="latency,detection,failures,fleet,rollout,runtime,real",
                    help="which parts to run, comma-separated")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    scratch = Path(tempfile.mkdtemp(prefix="guard-bench-"))
    key = scratch / "service"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "guard", "-f", str(key)], check=True)
    if "runtime" in parts:
        in_process(key, scratch, args.calls)
    if "real" in parts:
        real(key)
    if not parts & {"latency", "detection", "failures", "fleet", "rollout"}:
        return
    servers = []
    for _ in range(2):
        port = free_port()
        servers.append(Server([str(llama_build.build_server()), "-m", str(find_gguf()), "--port", str(port), "-np", "1",
                               "-c", "4096", "-t", "1", "-fa", "off"], "/health", port))
    on, off_server = (f"http://127.0.0.1:{s.port}" for s in servers)
    procs: list[subprocess.Popen] = []
    try:
        with front(off_server, cache=False) as off:
            if "latency" in parts:
                latency(on, off, key, scratch, procs, args.requests)
            if "detection" in parts:
                print(f"detection (limit {GUARD['limit']}, alpha {GUARD['alpha']}, every request shadowed):")
                for every in (20, 8, 3):
                    detect(on, off, key, scratch, procs, every, f"defect rate 1/{every:<3}")
            if "failures" in parts:
                print("failures (the flag-on side answers 500 to every k-th request, every request shadowed):")
                for every in (20, 5):
                    detect(on, off, key, scratch, procs, every, f"failing 1 in {every:<3}", fail=True)
            if "fleet" in parts:
                print("a fleet (proxies on one ledger, requests in turn; only the first replica corrupts every 8th answer):")
                for n in (1, 2, 3):
                    fleet(on, off, key, scratch, procs, n)
            if "rollout" in parts:
                rollout(on, off, key, scratch, procs)
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(30)
        for s in servers:
            s.close()


def latency(on: str, off: str, key: Path, scratch: Path, procs: list[subprocess.Popen], requests: int) -> None:
    """Client latency through a proxy without a guard and with one at three shadow rates, side by side."""
    routes = {}
    for name, rate in (("no guard", None), ("guard 1%", 0.01), ("guard 10%", 0.1), ("guard 100%", 1.0)):
        ws = workspace(scratch / name.replace(" ", "-").replace("%", ""), key, rate) if rate else None
        proc, port = proxy(on, ws, off, key, scratch)
        procs.append(proc)
        routes[name] = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    for conn in routes.values():
        ask(conn, 0)  # warm: connections open, the system prompt cached
    times: dict[str, list[float]] = {name: [] for name in routes}
    order, rng = list(routes), random.Random(0)
    for i in range(requests):
        rng.shuffle(order)  # no proxy always follows another
        for k, name in enumerate(order):
            times[name].append(ask(routes[name], i * len(routes) + k)[0])  # a prompt of its own each time
            settle(routes[name])
    base = {q: percentile(sorted(times["no guard"]), q) * 1000 for q in (50, 99)}
    print(f"client latency, {requests} greedy completions per proxy (8 tokens), in turn, shuffled:")
    for name, ts in times.items():
        p = {q: percentile(sorted(ts), q) * 1000 for q in (50, 99)}
        added = "" if name == "no guard" else f" | added p50 {p[50] - base[50]:+.2f} ms  p99 {p[99] - base[99]:+.2f} ms"
        print(f"  {name:10} p50 {p[50]:7.2f} ms  p99 {p[99]:7.2f} ms{added}")
    for proc in procs:
        proc.terminate()
        proc.wait(30)
    procs.clear()


def until_off(ws: Path, routes: list[http.client.HTTPConnection], cap: int = 3000) -> int:
    """Requests sent, in turn over ``routes``, until the ledger says the flag is off (``cap`` at most)."""
    sent = 0
    while sent < cap:
        try:
            ask(routes[sent % len(routes)], sent)
        except AssertionError:  # a request the flag-on side failed: the client got the 500
            pass
        sent += 1
        with Ledger(f"sqlite:///{ws / 'ledger' / 'evidence.db'}") as ledger:
            if ledger.flag_states()["prefix_cache"]["state"] == "off":
                break
    return sent


def detect(on: str, off: str, key: Path, scratch: Path, procs: list[subprocess.Popen], every: int, label: str,
           fail: bool = False) -> None:
    """Requests until a rollback behind a front that corrupts (or fails) every ``every``-th answer."""
    ws = workspace(scratch / f"detect-{every}-{'fail' if fail else 'stale'}", key, 1.0)
    with front(on, every=every, fail=fail) as broken:
        proc, port = proxy(broken, ws, off, key, scratch)
        procs.append(proc)
        sent = until_off(ws, [http.client.HTTPConnection("127.0.0.1", port, timeout=300)])
    predicted = to_detect(1 / every, GUARD["limit"], GUARD["alpha"] / 2)  # a watch's first rule: half the alpha
    print(f"  {label} rolled back after {sent:4} requests (power analysis: {predicted} comparisons at exactly that rate)")


def fleet(on: str, off: str, key: Path, scratch: Path, procs: list[subprocess.Popen], n: int) -> None:
    """``n`` proxies on one ledger, each before its own front of ``on``, the first corrupting every 8th answer."""
    ws = workspace(scratch / f"fleet-{n}", key, 1.0)
    with contextlib.ExitStack() as stack:
        routes = []
        for i in range(n):
            up = stack.enter_context(front(on, every=8 if i == 0 else 0))
            proc, port = proxy(up, ws, off, key, scratch, name=f"replica-{i}")
            procs.append(proc)
            routes.append(http.client.HTTPConnection("127.0.0.1", port, timeout=300))
        sent = until_off(ws, routes)
    predicted = to_detect(1 / (8 * n), GUARD["limit"], GUARD["alpha"] / 2)
    print(f"  {n} prox{'y' if n == 1 else 'ies'}: rolled back after {sent:4} requests in all (power analysis: "
          f"{predicted} comparisons at the fleet's rate 1/{8 * n})")



def rollout(on: str, off: str, key: Path, scratch: Path, procs: list[subprocess.Popen]) -> None:
    """A healthy staged rollout from its first step to every request: requests and seconds at each step."""
    plan = {"steps": [0.01, 0.1, 0.5, 1.0], "min_comparisons_per_step": 5, "hold_s": 0}
    ws = workspace(scratch / "rollout", key, 1.0)
    policy = ws / "policies" / "prefix_cache.yaml"
    policy.write_text(policy.read_text() + f"rollout: {json.dumps(plan)}\n")
    proc, port = proxy(on, ws, off, key, scratch)
    procs.append(proc)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    t0, sent, share, steps = time.perf_counter(), 0, plan["steps"][0], []
    while share < 1 and sent < 5000:
        ask(conn, sent)
        sent += 1
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            now = float(next(x for x in r.read().decode().splitlines() if x.startswith("gatekeeper_guard_rollout_share")).split()[-1])
        if now != share:
            steps.append((share, sent, time.perf_counter() - t0))
            share = now
    total = time.perf_counter() - t0
    print(f"a staged rollout {plan['steps']} (at least {plan['min_comparisons_per_step']} comparisons a step, every "
          f"served request shadowed), healthy: every request after {sent} requests, {total:.0f} s")
    for share, at, seconds in steps:
        print(f"  raised from {share:.0%} after {at} requests, {seconds:.0f} s")


def in_process(key: Path, scratch: Path, calls: int) -> None:
    """Caller latency of ``Runtime.complete`` without a guard and with one at two replay rates, side by side."""
    from gatekeeper.runtime import Runtime

    runtimes = {"no guard": Runtime(workspace(scratch / "runtime-none", key, 1.0), response_cache=False)}
    for name, rate in (("guard 10%", 0.1), ("guard 100%", 1.0)):
        ws = workspace(scratch / f"runtime-{int(rate * 100)}", key, rate)
        runtimes[name] = Runtime(ws, response_cache=False, guard="prefix_cache", sign=key)
    times: dict[str, list[float]] = {name: [] for name in runtimes}
    order, rng = list(runtimes), random.Random(0)
    try:
        for i in range(calls):
            rng.shuffle(order)
            for name in order:
                rt = runtimes[name]
                t0 = time.perf_counter()
                rt.complete("assistant", {"session": f"user={i}", "query": f"{USERS[i % len(USERS)]} ({i})"})  # the same call
                times[name].append(time.perf_counter() - t0)
                while rt.guard is not None and rt.guard.guarded.in_flight:  # its replay done before the next call
                    time.sleep(0.01)
        replayed = {name: rt.guard.guarded.totals["compared"] for name, rt in runtimes.items() if rt.guard is not None}
    finally:
        for rt in runtimes.values():
            rt.close()
    base = {q: percentile(sorted(times["no guard"]), q) * 1000 for q in (50, 99)}
    print(f"in process: Runtime.complete on the default model, {calls} calls per Runtime, in turn, shuffled "
          f"(replayed and compared: {replayed}):")
    for name, ts in times.items():
        p = {q: percentile(sorted(ts), q) * 1000 for q in (50, 99)}
        added = "" if name == "no guard" else f" | added p50 {p[50] - base[50]:+.2f} ms  p99 {p[99] - base[99]:+.2f} ms"
        print(f"  {name:10} p50 {p[50]:8.2f} ms  p99 {p[99]:8.2f} ms{added}")


def real(key: Path) -> None:
    """Real defects a battery missed, guarded in process after an honest flip (``real_bugs.guarded``)."""
    import real_bugs

    rule = {**GUARD, "rate": 1, "limit": 0, "min_comparisons": 4, "batch": 1, "timeout_s": 120}
    print(f"real defects the battery missed, every call replayed (limit {rule['limit']}, alpha {rule['alpha']}, at least "
          f"{rule['min_comparisons']} comparisons):")
    for entry in (e for e in real_bugs.entries() if e.get("guard")):
        for side, proxy in (("affected", False), ("fixed", False), ("affected", True), ("fixed", True)):
            t0 = time.perf_counter()
            r = real_bugs.guarded(entry, side, key, rule, proxy=proxy)
            share = r["mismatches"] / r["compared"] if r["compared"] else 0.0
            predicted = f"; power analysis at that share: {to_detect(share, rule['limit'], rule['alpha'] / 2)}" if share else ""
            print(f"  {entry['id']} {side:8} {r['release']:8} {'behind the proxy' if proxy else 'in process':16} battery {r['evaluation']}: "
                  f"{'rolled back' if r['rolled_back'] else 'kept on'} after {r['calls']} calls, {r['compared']} compared, "
                  f"{r['mismatches']} parted{predicted} ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
