"""The interleave scenario as chat requests on real servers, beside gatekeeper, on one set of tiny weights.

The tiny random hybrid model is converted to GGUF with llama.cpp's own converter (vendored in the
llama-cpp-python source distribution; ``gatekeeper.setup.llama_build`` builds ``llama-server`` from it)
and loaded by mlx-lm's server from a copy whose ``model_type`` reads ``qwen3_5``. Requests:
A = a long system message (the stage's static prefix) + a long user message, C = the same system
message + another user message, B = a short unrelated chat; sequences A->C and A->B->C, each on a
fresh server with one slot. Each peer's own counts: llama-server's ``timings.prompt_n`` (tokens it
computed), mlx-lm's ``usage.prompt_tokens_details.cached_tokens``. gatekeeper's stage boundary is
the system message's text, inside the message (before its end-of-turn token).

    python bench/hybrid_peers.py [--scale 1.0]      (also run by bench/hybrid_replay.py --peers)
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

from gatekeeper.identity import child_env  # noqa: E402
from gatekeeper.setup.tiny_hybrid import CORPUS, build  # noqa: E402
from gatekeeper.traffic.captures import replay  # noqa: E402
from gatekeeper.workspace import EngineProfile  # noqa: E402

WORDS = " ".join(CORPUS).split()
MAX_TOKENS = 8


def text(rng: random.Random, tok, n_tokens: int) -> str:
    """Words from the tokenizer's corpus until the text is about ``n_tokens`` tokens long."""
    words: list[str] = []
    while len(tok(" ".join(words), add_special_tokens=False)["input_ids"]) < n_tokens:
        words.extend(rng.choice(WORDS) for _ in range(16))
    return " ".join(words)


def chats(tok, scale: float) -> tuple[dict[str, list[list[dict]]], dict[str, list[replay.Item]]]:
    """The scenario as chat messages (for mlx-lm) and as rendered tokens with the stage boundary."""
    rng = random.Random(0)
    system = text(rng, tok, round(2500 * scale))
    a = [{"role": "system", "content": system}, {"role": "user", "content": text(rng, tok, round(1950 * scale))}]
    c = [{"role": "system", "content": system}, {"role": "user", "content": text(rng, tok, round(1950 * scale))}]
    b = [{"role": "user", "content": text(rng, tok, round(90 * scale))}]
    head = tok(f"<|im_start|>system\n{system}", add_special_tokens=False)["input_ids"]

    def item(messages, stage):
        ids = tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), add_special_tokens=False)["input_ids"]
        shared = head if stage == "chat" and ids[: len(head)] == head else []
        return replay.Item(stage, stage, tuple(ids), len(shared))

    A, B, C = item(a, "chat"), item(b, "other"), item(c, "chat")
    return {"A->C": [a, c], "A->B->C": [a, b, c]}, {"A->C": [A, C], "A->B->C": [A, B, C]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict, timeout: float = 900) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


class Server:
    """A server process on a free local port, up until its health URL answers."""

    def __init__(self, argv: list[str], health: str, port: int, env: dict | None = None):
        self.port = port
        self.log = tempfile.NamedTemporaryFile(prefix="peer-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.time() + 300
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{argv[0]} exited ({self.proc.returncode}); see {self.log.name}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}{health}", timeout=2)
                return
            except Exception:
                time.sleep(0.5)
        self.close()
        raise RuntimeError(f"{argv[0]} did not come up; see {self.log.name}")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def to_gguf(model: Path, out: Path) -> Path:
    from gatekeeper.setup import llama_build

    src = llama_build.source_dir()
    # Our tiny tokenizer's pre-tokenizer hash is unknown to the converter; it is byte-level BPE like GPT-2.
    code = ("import runpy, sys; src = sys.argv[1]; sys.path[:0] = [src, src + '/gguf-py']\n"
            "import conversion.base as b; b.TextModel.get_vocab_base_pre = lambda self, t: 'gpt-2'\n"
            "sys.argv = ['convert_hf_to_gguf.py', sys.argv[2], '--outfile', sys.argv[3], '--outtype', 'f32', '--no-mtp']\n"
            "runpy.run_path(src + '/convert_hf_to_gguf.py', run_name='__main__')")
    subprocess.run([sys.executable, "-c", code, str(src), str(model), str(out)], check=True, capture_output=True)
    return out


def llama_server(binary: Path, gguf: Path, seqs: dict[str, list[replay.Item]], extra: list[str]) -> dict[str, list[dict]]:
    out = {}
    for name, items in seqs.items():
        port = free_port()
        server = Server([str(binary), "-m", str(gguf), "--port", str(port), "-np", "1", "-c", "16384", "-t", "2", *extra],
                        "/health", port)
        try:
            rows = []
            for item in items:
                r = post(f"http://127.0.0.1:{port}/completion", {"prompt": list(item.tokens), "n_predict": MAX_TOKENS,
                         "cache_prompt": True, "temperature": 0, "top_k": 1, "return_tokens": True})
                rows.append({"prompt": len(item.tokens), "reused": len(item.tokens) - r["timings"]["prompt_n"],
                             "tokens": r.get("tokens")})
            out[name] = rows
        finally:
            server.close()
    return out


def llama_trace(binary: Path, gguf: Path, items: list[replay.Item], extra: list[str]) -> list[int]:
    """Tokens llama-server reused per request of one trace, on one slot from a fresh start."""
    port = free_port()
    server = Server([str(binary), "-m", str(gguf), "--port", str(port), "-np", "1", "-c", "16384", "-t", "2", *extra],
                    "/health", port)
    try:
        return [len(i.tokens) - post(f"http://127.0.0.1:{port}/completion", {
            "prompt": list(i.tokens), "n_predict": 1, "cache_prompt": True, "temperature": 0})["timings"]["prompt_n"]
            for i in items]
    finally:
        server.close()


def mlx_server(model: Path, seqs: dict[str, list[list[dict]]]) -> dict[str, list[dict]]:
    copy = Path(tempfile.mkdtemp(prefix="tiny-hybrid-mlx-"))
    for f in model.iterdir():
        shutil.copy(f, copy / f.name)
    config = json.loads((copy / "config.json").read_text())
    config["model_type"] = "qwen3_5"  # transformers writes qwen3_5_text
    (copy / "config.json").write_text(json.dumps(config))
    out = {}
    for name, requests in seqs.items():
        port = free_port()
        server = Server([sys.executable, "-m", "mlx_lm.server", "--model", str(copy), "--port", str(port)],
                        "/health", port, env=child_env(PYTHONUNBUFFERED="1"))
        try:
            rows = []
            for messages in requests:
                r = post(f"http://127.0.0.1:{port}/v1/chat/completions",
                         {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0})
                usage = r["usage"]
                rows.append({"prompt": usage["prompt_tokens"],
                             "reused": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)})
            out[name] = rows
        finally:
            server.close()
    return out


def run(scale: float, model: Path | None = None, chunk: int = 256, requests: int = 0) -> None:
    from transformers import AutoTokenizer

    from gatekeeper.setup import llama_build

    model = model or build(Path(tempfile.mkdtemp(prefix="tiny-hybrid-")))
    tok = AutoTokenizer.from_pretrained(str(model))
    messages, seqs = chats(tok, scale)
    A, C = seqs["A->C"]
    print(f"\npeers: A {len(A.tokens)} tokens, C {len(C.tokens)} (sharing {replay.bounds([A, C])[1]} with A; stage boundary "
          f"{A.boundary}, inside the system message), B {len(seqs['A->B->C'][1].tokens)}; one slot, fresh server per sequence")
    base = EngineProfile(adapter="torch", model=str(model), dtype="float32", device="cpu", chunk=chunk)
    specs = ["tail+erase", "boundaries+erase", "boundaries"]
    ours = replay.replay(seqs, specs, replay.maker(base, None, simulate=False), parity=True, max_tokens=MAX_TOKENS)
    rows = [(f"gatekeeper {p['policy']}", {n: p["traces"][n]["detail"][-1] for n in seqs},
             "yes (vs cache off)" if p["total"]["identical"] else "NO") for p in ours["policies"]]
    with replay.maker(base, None, simulate=False)("boundaries") as loaded:
        cold = replay.serve(loaded, seqs["A->C"], MAX_TOKENS, False)[0]
    binary = llama_build.server_binary()
    if binary is None:
        print("llama-server is not built (python -m gatekeeper.setup.llama_build builds it, several minutes): skipped")
    else:
        gguf = to_gguf(model, model.parent / f"{model.name}.gguf")
        for label, extra in (("llama-server", []), ("llama-server --cache-ram 0", ["--cache-ram", "0"])):
            got = llama_server(binary, gguf, seqs, extra)
            same = got["A->C"][-1]["tokens"] == cold[-1].tokens
            rows.append((label, {n: got[n][-1] for n in seqs}, f"{'yes' if same else 'NO'} (vs torch)"))
    try:
        got = mlx_server(model, messages)
        rows.append(("mlx_lm.server", {n: got[n][-1] for n in seqs}, "- (its own tokenization)"))
    except Exception as e:  # a peer that cannot run here is reported, not fatal
        rows.append((f"mlx_lm.server (failed: {e})", {n: None for n in seqs}, "-"))

    def cell(r: dict | None) -> str:
        return "-" if r is None else f"{r['reused']}/{r['prompt']} ({r['reused'] / r['prompt']:.0%})"

    print(f"{'engine':34} {'C reused/prompt, A->C':>24} {'A->B->C':>24}  same greedy tokens")
    for label, reused, same in rows:
        print(f"{label:34} {cell(reused['A->C']):>24} {cell(reused['A->B->C']):>24}  {same}")
    if requests and binary is not None:
        trace = replay.synthetic(requests)["synthetic"]  # the first N requests of the 1,000-request trace
        bound = sum(replay.bounds(trace))
        for label, extra in (("llama-server", []), ("llama-server --cache-ram 0", ["--cache-ram", "0"])):
            start = time.perf_counter()
            reused = llama_trace(binary, gguf, trace, extra)
            print(f"synthetic trace ({requests} requests, bound {bound:,}) on {label}, one slot: reused {sum(reused):,}, "
                  f"realized {sum(reused) / bound:.1%}, {sum(1 for r in reused if r)} restores "
                  f"({time.perf_counter() - start:.0f} s); gatekeeper's figures for this trace are in the tables above")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--requests", type=int, default=300,
                    help="the first N requests of the synthetic trace on llama-server too (0: skip; 1,000 took 12 min here)")
    args = ap.parse_args()
    run(args.scale, requests=args.requests)
