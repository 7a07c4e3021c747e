"""How fast ``gatekeeper forensics`` reads a server log, on one core: the per-slot figures alone, and
with reuse measured across requests (the prompts from a capture beside the log); peak memory of
each; and the advice's replay time per 10,000 requests.

The log is real: a llama-server built by gatekeeper.setup.llama_build runs the interleave scenario
(A->C, A->B->C) on the tiny random hybrid model at its most verbose (-v), so every kind of line
(checkpoints, prompt cache, per-token debug noise) is in it; the file is then read ``--copies``
times over as one rotated series (about 170 KB each). The capture beside it is generated: per copy,
prompts of the lengths the log shows, all sharing one system prefix (the first 55% of the first
prompt) and each copy's own rest, repeated where the scenario repeats a prompt, so the token trie
grows with every copy as it would on real traffic. Each measurement runs in a fresh interpreter,
so its peak memory is its own. Target: at least 200 MB of log a minute.

    python bench/forensics.py [--copies 600] [--log FILE] [--advice-requests 10000]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from gatekeeper.traffic.logs import advice, forensics  # noqa: E402


def make_log(out: Path) -> Path:
    """The interleave scenario's log from a real server (a minute the first time: builds the model)."""
    from hybrid_peers import Server, chats, free_port, post, to_gguf
    from transformers import AutoTokenizer

    from gatekeeper.setup import llama_build
    from gatekeeper.setup.tiny_hybrid import build

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


def make_capture(log: Path, copies: int, out: Path) -> int:
    """A capture for ``copies`` reads of ``log``: one line per request, in order; its token count."""
    sizes = [d["prompt_tokens"] for d in forensics.read([log])["requests_detail"]]
    rng = random.Random(0)
    system = [rng.randrange(2, 512) for _ in range(int(sizes[0] * 0.55))]
    tokens, t = 0, 0
    with out.open("w") as f:
        for _ in range(copies):
            mine: dict[int, list[int]] = {}  # a prompt length seen before in this copy: the same prompt again
            for n in sizes:
                if n not in mine:
                    head = system if n > len(system) else []
                    mine[n] = head + [rng.randrange(2, 512) for _ in range(n - len(head))]
                f.write(json.dumps({"stage": "chat", "stream": str(t), "t": t, "tokens": mine[n]}) + "\n")
                tokens, t = tokens + n, t + 1
    return tokens


def peak_mib() -> float:
    """This process's peak resident memory (VmHWM: unlike ru_maxrss, not carried over from the parent)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _read(paths: list[str], capture: str | None, queue) -> None:
    start = time.perf_counter()
    report = forensics.read(paths, capture, advise=False)
    seconds = time.perf_counter() - start
    queue.put((seconds, peak_mib(), report["bytes"], report["lines"],
               report["requests"], report["reuse"]))


def _advise(capture: str, n: int, queue) -> None:
    prompts = []
    with open(capture) as f:
        for line in f:
            prompts.append(tuple(json.loads(line)["tokens"]))
            if len(prompts) == n:
                break
    server = {"slots": 1, "n_ctx_slot": 16384, "cache_ram_mib": 0, "ctx_checkpoints": 32, "kv_bytes_per_token": 256.0}
    start = time.perf_counter()
    out = advice.advise(prompts, ["chat"] * len(prompts), 1, server, 0.016)
    queue.put((time.perf_counter() - start, len(prompts), len(out["lines"])))


def fresh(target, *args):
    """``target(*args, queue)`` in a fresh interpreter; what it put on the queue."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, queue))
    proc.start()
    result = queue.get()
    proc.join()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--copies", type=int, default=600)
    ap.add_argument("--log", type=Path)
    ap.add_argument("--advice-requests", type=int, default=10000)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="forensics-bench-"))
    log = args.log or make_log(work)
    copies = 1 if args.log else args.copies
    capture = work / "capture.jsonl"
    tokens = make_capture(log, max(copies, -(-args.advice_requests // 5)), capture)
    paths = [str(log)] * copies
    print(f"log: {log} x {copies}; capture: {capture} ({capture.stat().st_size / 1e6:,.0f} MB, {tokens:,} prompt tokens)")
    for label, cap in (("per slot (log only)", None), ("across requests (log + capture)", str(capture))):
        seconds, peak, nbytes, lines, requests, cross = fresh(_read, paths, cap)
        mb = nbytes / 1e6
        print(f"{label}: {lines:,} lines, {mb:,.1f} MB, {requests:,} requests in {seconds:.2f} s on one core: "
              f"{mb / seconds * 60:,.0f} MB/min (target >= 200), peak memory {peak:,.0f} MiB")
        if cross:
            print(f"  possible {cross['possible']:,}, obtained {cross['obtained']:,}, lost by cause {cross['lost_by_cause']}")
    seconds, n, settings = fresh(_advise, str(capture), args.advice_requests)
    print(f"advice: {settings} settings replayed over {n:,} requests in {seconds:.1f} s = "
          f"{seconds / n * 10000:.1f} s per 10,000 requests")


if __name__ == "__main__":
    main()
