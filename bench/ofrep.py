"""What serving flags over OFREP costs: bulk evaluations per second and p50/p99 latency for 100 flags on
loopback, on a small ledger and on one of 100,000 entries, in one run.

A workspace with 100 policies (engine: the simulator, so no model is loaded) and its ledger: first 100 flips
(every flag flipped once), then the same grown to 100,000 entries (small measurement records, one write
transaction). ``gatekeeper flags serve`` runs as its own process; one client on a keep-alive connection asks,
in turn: bulk evaluation (200, every flag), bulk with If-None-Match (304: what a poll of an unchanged ledger
costs), and one flag. Then one flip is appended while the server runs, and the first request after it is
timed: the re-verification a change costs.

    python bench/ofrep.py [--requests 2000] [--entries 100000]
"""

from __future__ import annotations

import argparse
import http.client
import json
import select
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FLAGS = 100
RESULT = {"prompt_tokens": 900, "cached_tokens": 836, "prefill_s": 0.01, "decode_s": 0.2, "stage": "router"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def workspace(root: Path) -> Path:
    from gatekeeper.setup.scaffold import init_workspace

    init_workspace(root)
    (root / "engines" / "auto.yaml").write_text("adapter: gatekeeper.engines.sim:SimEngine\nmodel: default\n")
    (root / "policies" / "prefix_cache.yaml").unlink()  # exactly FLAGS flags, all declared
    for i in range(FLAGS):
        flag = f"flag_{i:03d}"
        (root / "policies" / f"{flag}.yaml").write_text(
            f"flag: {flag}\ngate: byte_equivalence\nchange: {{profile: {{options: {{{flag}: true}}}}}}\n")
    return root


def grow(ws: Path, entries: int) -> int:
    """Append records until the ledger holds ``entries`` (one transaction: this is set-up, not the bench)."""
    from gatekeeper.ledger import Ledger
    from gatekeeper.ledger.chain import append
    from gatekeeper.ledger.database import write

    with Ledger(f"sqlite:///{ws / 'ledger' / 'evidence.db'}") as ledger:
        have = (ledger.head() or {"entries": 0})["entries"]
        with write(ledger.engine) as conn:
            for n in range(have, entries):
                append(conn, "measurement", {"operator": "bench", "config": {"n": n}, "result": RESULT})
        return ledger.head()["entries"]


def flip_all(ws: Path) -> None:
    from gatekeeper.ledger import Ledger

    with Ledger(f"sqlite:///{ws / 'ledger' / 'evidence.db'}") as ledger:
        for i in range(FLAGS):
            ledger.add_flip(f"flag_{i:03d}", "off", "bench", "bench")


class Served:
    def __init__(self, ws: Path):
        self.port = free_port()
        start = time.perf_counter()
        self.proc = subprocess.Popen([sys.executable, "-m", "gatekeeper.cli", "--workspace", str(ws), "flags", "serve",
                                      "--listen", f"127.0.0.1:{self.port}", "--json"], stdout=subprocess.PIPE, text=True)
        while not select.select([self.proc.stdout], [], [], 1)[0]:
            if self.proc.poll() is not None:
                raise SystemExit("flags serve did not start")
        info = json.loads(self.proc.stdout.readline())
        self.start_s = time.perf_counter() - start
        assert info["error"] is None and len(info["flags"]) == FLAGS, info
        self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)

    def ask(self, path: str, headers: dict[str, str] | None = None) -> tuple[float, int, str | None]:
        start = time.perf_counter()
        self.conn.request("POST", path, b'{"context": {"targetingKey": "bench"}}',
                          {"Content-Type": "application/json", **(headers or {})})
        r = self.conn.getresponse()
        r.read()
        return time.perf_counter() - start, r.status, r.getheader("ETag")

    def stop(self) -> None:
        self.conn.close()
        self.proc.terminate()
        self.proc.wait(30)


def measure(server: Served, requests: int) -> list[tuple[str, list[float]]]:
    _, _, tag = server.ask("/ofrep/v1/evaluate/flags")
    kinds = [("bulk, 200", "/ofrep/v1/evaluate/flags", None, 200),
             ("bulk poll, 304", "/ofrep/v1/evaluate/flags", {"If-None-Match": tag}, 304),
             ("one flag", "/ofrep/v1/evaluate/flags/flag_042", None, 200)]
    times: dict[str, list[float]] = {k[0]: [] for k in kinds}
    for _ in range(requests):  # interleaved, so drift on a shared machine hits every kind alike
        for name, path, headers, want in kinds:
            seconds, status, _ = server.ask(path, headers)
            assert status == want, (name, status)
            times[name].append(seconds)
    return [(name, sorted(times[name])) for name, *_ in kinds]


def row(entries: int, name: str, ordered: list[float]) -> str:
    from gatekeeper.traffic.captures.analyze import percentile

    mean = sum(ordered) / len(ordered)
    flags = FLAGS if name.startswith("bulk, 200") else (0 if "304" in name else 1)
    per_s = f"{flags / mean:>12,.0f}" if flags else f"{'-':>12}"
    return (f"{entries:>9,}  {name:<16} {percentile(ordered, 50) * 1e3:>7.3f} {percentile(ordered, 99) * 1e3:>7.3f} "
            f"{1 / mean:>10,.0f} {per_s}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000, help="per kind of request and per ledger")
    ap.add_argument("--entries", type=int, default=100_000, help="the large ledger's length")
    args = ap.parse_args()
    from gatekeeper.ledger import Ledger

    ws = workspace(Path(tempfile.mkdtemp(prefix="ofrep-bench-")) / "ws")
    flip_all(ws)
    lines, notes = [], []
    for target in (None, args.entries):
        entries = grow(ws, target) if target else FLAGS
        server = Served(ws)
        try:
            lines += [row(entries, name, ordered) for name, ordered in measure(server, args.requests)]
            with Ledger(f"sqlite:///{ws / 'ledger' / 'evidence.db'}") as ledger:  # a change while it serves
                ledger.add_flip("flag_007", "off", "bench", "a change")
            after, status, _ = server.ask("/ofrep/v1/evaluate/flags")
            assert status == 200
            notes.append(f"{entries:>9,}  start (first verification, engine identity) {server.start_s:.2f} s; "
                         f"first request after one more entry (a full re-verification) {after * 1e3:,.1f} ms")
        finally:
            server.stop()
    print(f"OFREP on loopback, {FLAGS} flags, one client on a keep-alive connection, {args.requests} requests per kind")
    print(f"{'entries':>9}  {'request':<16} {'p50 ms':>7} {'p99 ms':>7} {'requests/s':>10} {'evals/s':>12}")
    print("\n".join(lines))
    print("\n".join(notes))


if __name__ == "__main__":
    main()
