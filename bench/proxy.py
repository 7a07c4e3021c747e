"""Latency the capturing proxy adds per request, against the same llama-server direct, in one run.

A real llama-server (built by gatekeeper.setup.llama_build) serves the default model; ``gatekeeper proxy``
runs in front of it as its own process, capturing to a temporary file. Requests alternate direct
and proxied on keep-alive connections, so drift on a shared machine hits both alike:
  - GET /health: the server answers at once, so the difference is the proxy's own cost;
  - a chat completion (max_tokens 1, the prompt cached): a real call, with its capture line and
    the rendering the proxy asks the server for afterwards.
Prints p50 and p99 of each and the added latency (target: p50 under 1 ms on loopback).

    python bench/proxy.py [--requests 300]
"""

from __future__ import annotations

import argparse
import http.client
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hybrid_peers import Server, free_port

from gatekeeper.setup import llama_build
from gatekeeper.setup.models import find_gguf
from gatekeeper.traffic.captures.analyze import percentile

MESSAGES = [{"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": "What is 2+2?"}]


def timed(conn: http.client.HTTPConnection, method: str, path: str, body: dict | None) -> float:
    data = None if body is None else json.dumps(body)
    start = time.perf_counter()
    conn.request(method, path, data, {"Content-Type": "application/json"})
    r = conn.getresponse()
    r.read()
    seconds = time.perf_counter() - start
    assert r.status == 200, (path, r.status)
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=300, help="per kind and per route (direct, proxied)")
    args = ap.parse_args()
    port = free_port()
    server = Server([str(llama_build.build_server()), "-m", str(find_gguf()), "--port", str(port), "-np", "1",
                     "-c", "4096", "-t", "1", "-fa", "off"], "/health", port)
    cap = Path(tempfile.mkdtemp(prefix="proxy-bench-")) / "capture.jsonl"
    listen = free_port()
    proxy = subprocess.Popen([sys.executable, "-m", "gatekeeper.cli", "proxy", "--upstream", f"http://127.0.0.1:{port}",
                              "--listen", f"127.0.0.1:{listen}", "--capture", str(cap)], stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 60
        while True:
            try:
                http.client.HTTPConnection("127.0.0.1", listen, timeout=2).connect()
                break
            except OSError:
                if time.time() > deadline:
                    raise RuntimeError("the proxy did not come up") from None
                time.sleep(0.1)
        routes = {"direct": http.client.HTTPConnection("127.0.0.1", port, timeout=300),
                  "proxied": http.client.HTTPConnection("127.0.0.1", listen, timeout=300)}
        chat = {"messages": MESSAGES, "max_tokens": 1, "temperature": 0}
        for kind, method, path, body in (("GET /health", "GET", "/health", None),
                                         ("chat completion", "POST", "/v1/chat/completions", chat)):
            for conn in routes.values():  # warm: connections open, the prompt cached
                timed(conn, method, path, body)
            times: dict[str, list[float]] = {name: [] for name in routes}
            for _ in range(args.requests):
                for name, conn in routes.items():
                    times[name].append(timed(conn, method, path, body))
            p = {name: {q: percentile(sorted(ts), q) * 1000 for q in (50, 99)} for name, ts in times.items()}
            print(f"{kind:16} direct p50 {p['direct'][50]:7.3f} ms  p99 {p['direct'][99]:7.3f} ms | proxied p50 "
                  f"{p['proxied'][50]:7.3f} ms  p99 {p['proxied'][99]:7.3f} ms | added p50 "
                  f"{p['proxied'][50] - p['direct'][50]:+.3f} ms  p99 {p['proxied'][99] - p['direct'][99]:+.3f} ms "
                  f"({args.requests} each)")
        time.sleep(1)
        print(f"capture: {sum(1 for _ in cap.open())} lines for {args.requests + 1} proxied completions ({cap})")
    finally:
        proxy.terminate()
        proxy.wait(30)
        server.close()


if __name__ == "__main__":
    main()
