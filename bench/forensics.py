"""How fast ``gatekeeper forensics`` reads a server log: lines and MB parsed per second, on one core.

The log is real: a llama-server built by gatekeeper.setup.llama_build runs the interleave scenario
(A->C, A->B->C) on the tiny random hybrid model at its most verbose (-v), so every kind of line
(checkpoints, prompt cache, per-token debug noise) is in it; the file is then read ``--copies``
times over as one rotated series (about 170 KB each). Target: at least 200 MB of log a minute.

    python bench/forensics.py [--copies 600] [--log FILE]   (--log: time your own log instead)
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from gatekeeper.traffic import forensics


def make_log(out: Path) -> Path:
    """The interleave scenario's log from a real server (a minute the first time: builds the model)."""
    from transformers import AutoTokenizer

    from gatekeeper.setup import llama_build
    from gatekeeper.setup.tiny_hybrid import build
    from hybrid_peers import Server, chats, free_port, post, to_gguf

    model = build(out / "tiny-hybrid")
    gguf = to_gguf(model, out / "tiny-hybrid.gguf")
    messages, _ = chats(AutoTokenizer.from_pretrained(str(model)), 1.0)
    port = free_port()
    server = Server([str(llama_build.build_server()), "-m", str(gguf), "--port", str(port), "-np", "1", "-c", "16384",
                     "-t", "1", "-v", "--cache-ram", "0"], "/health", port)
    try:
        for seq in ("A->C", "A->B->C"):
            for m in messages[seq]:
                post(f"http://127.0.0.1:{port}/v1/chat/completions", {"messages": m, "max_tokens": 4, "temperature": 0})
    finally:
        server.close()
    return Path(server.log.name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--copies", type=int, default=600)
    ap.add_argument("--log", type=Path)
    args = ap.parse_args()
    log = args.log or make_log(Path(tempfile.mkdtemp(prefix="forensics-bench-")))
    paths = [log] * (1 if args.log else args.copies)
    start = time.perf_counter()
    report = forensics.read(paths)
    seconds = time.perf_counter() - start
    mb = report["bytes"] / 1e6
    print(f"log: {log} x {len(paths)}: {report['lines']:,} lines, {mb:,.1f} MB, {report['requests']:,} requests, "
          f"{report['checkpoints']['created']:,} checkpoints created, {report['unparsed']['count']} unparsed")
    print(f"parsed in {seconds:.2f} s on one core: {report['lines'] / seconds:,.0f} lines/s, {mb / seconds:,.1f} MB/s "
          f"= {mb / seconds * 60:,.0f} MB/min (target >= 200 MB/min)")


if __name__ == "__main__":
    main()
