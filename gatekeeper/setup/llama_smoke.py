"""Prove a freshly built llama.cpp tree before it is installed: a greedy decode through its libraries
(as llama-cpp-python loads them) and a one-request ``llama-server`` start, each in a child process, so a
build that traps on this CPU is one clear error at build time, never a segfault in someone's evaluation.
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from ..errors import GatekeeperError
from ..identity import child_env
from .llama_target import cpu_features

PROMPT = "The capital of France is"
TOKENS = 4
TIMEOUT = 180.0
# A child that decodes a few greedy tokens through the libraries named by $LLAMA_CPP_LIB_PATH.
DECODE = f"""
import json, sys, llama_cpp
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=128, n_threads=2, verbose=False)
out = llm.create_completion({PROMPT!r}, max_tokens={TOKENS}, temperature=0.0)
print(json.dumps({{"text": out["choices"][0]["text"], "tokens": out["usage"]["completion_tokens"]}}))
"""
AMX_MNEMONICS = ("tilezero", "tileloadd", "tilestored", "tilerelease", "ldtilecfg", "sttilecfg", "tdpb")


def prove(tree: Path, gguf: Path, python: str = sys.executable) -> dict:
    """Raise GatekeeperError naming the fault unless ``tree`` (``lib/``, ``bin/llama-server``) decodes
    ``gguf`` on this CPU (the decode under ``python``, whose llama-cpp-python is the libraries' release). Returns what
    each check produced."""
    amx = amx_instructions(tree / "lib")
    if amx:
        raise GatekeeperError(f"the llama.cpp build in {tree} holds {amx} AMX instructions ({_cpu_note()}); "
                              "AMX kernels trap on many Xeons, and this build is meant to leave them out; "
                              "nothing was installed: rebuild with GATEKEEPER_LLAMA_CPU=portable make llama-server")
    return {"decode": decode(tree / "lib", gguf, python), "server": serve(tree / "bin" / "llama-server", gguf)}


def decode(lib: Path, gguf: Path, python: str = sys.executable) -> dict:
    env = child_env(LLAMA_CPP_LIB_PATH=str(lib))
    try:
        done = subprocess.run([python, "-c", DECODE, str(gguf)], env=env, capture_output=True, text=True,
                              timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        raise GatekeeperError(_failed("a greedy decode through its libraries", f"hung past {TIMEOUT:.0f} s", lib)) from None
    if done.returncode != 0:
        raise GatekeeperError(_failed("a greedy decode through its libraries", _death(done.returncode), lib, done.stderr))
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if result["tokens"] < 1:
        raise GatekeeperError(_failed("a greedy decode through its libraries", "produced no token", lib))
    return result


def serve(binary: Path, gguf: Path) -> dict:
    """Start ``binary`` on a free loopback port, ask one completion, stop it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen([str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
                                 "-c", "256", "-np", "1", "-t", "2"], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
        try:
            return _ask(proc, url, log, binary.parent.parent / "lib")
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def _ask(proc: subprocess.Popen, url: str, log, lib: Path) -> dict:
    what = "a one-request llama-server start"
    deadline = time.monotonic() + TIMEOUT
    while True:
        if proc.poll() is not None:
            raise GatekeeperError(_failed(what, _death(proc.returncode), lib, _tail(log)))
        if time.monotonic() > deadline:
            raise GatekeeperError(_failed(what, f"not ready after {TIMEOUT:.0f} s", lib, _tail(log)))
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:  # not listening yet, or 503 while the model loads
            pass
        time.sleep(0.2)
    body = json.dumps({"prompt": PROMPT, "n_predict": TOKENS, "temperature": 0}).encode()
    request = urllib.request.Request(url + "/completion", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT) as r:
            answer = json.loads(r.read())
    except OSError as e:
        proc.poll()
        cause = _death(proc.returncode) if proc.returncode is not None else f"the request failed ({e})"
        raise GatekeeperError(_failed(what, cause, lib, _tail(log))) from None
    if not answer.get("tokens_predicted"):
        raise GatekeeperError(_failed(what, "answered with no token", lib, _tail(log)))
    return {"text": answer.get("content", ""), "tokens": answer["tokens_predicted"]}


def amx_instructions(lib: Path) -> int:
    """AMX instructions in the built CPU backend (0 where none is found). objdump comes with the linker
    (binutils) that built it; without it the decode below is the only proof."""
    cpu_lib = next(iter(sorted(lib.glob("libggml-cpu.*"))), None)
    if cpu_lib is None or shutil.which("objdump") is None:
        return 0
    done = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(cpu_lib)], capture_output=True, text=True)
    return sum(1 for line in done.stdout.splitlines()
               if any(f"\t{m}" in line or f" {m}" in line for m in AMX_MNEMONICS))


def _death(code: int) -> str:
    if code < 0:
        name = signal.Signals(-code).name
        meaning = {"SIGILL": "illegal instruction: the build uses an instruction this CPU does not execute",
                   "SIGSEGV": "segmentation fault", "SIGBUS": "bus error", "SIGABRT": "aborted"}.get(name, "killed")
        return f"died of {name} ({meaning})"
    return f"exited with status {code}"


def _cpu_note() -> str:
    amx = [f for f in cpu_features() if f.startswith("amx")]
    return f"this CPU advertises {', '.join(amx)}" if amx else "this CPU advertises no AMX"


def _failed(what: str, cause: str, lib: Path, output: str = "") -> str:
    last = next((line.strip() for line in reversed(output.splitlines()) if line.strip()), "")
    amx = amx_instructions(lib)
    note = f"; libggml-cpu holds {amx} AMX instructions and {_cpu_note()}" if amx else ""
    return (f"the freshly built llama.cpp failed its smoke test: {what} {cause}{note}"
            f"{f' (last output: {last[:200]})' if last else ''}; nothing was installed. "
            "Fix: rebuild for a portable CPU target: GATEKEEPER_LLAMA_CPU=portable make llama-server")


def _tail(log) -> str:
    log.flush()
    log.seek(0)
    return log.read()[-4000:]

