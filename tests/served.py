"""Servers on loopback for the http adapter's tests: real llama-server, vLLM, mlx_lm.server and
llama-cpp-python servers, and a tiny stdlib server in front of one that answers completions late or
with garbage."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from gatekeeper.identity import child_env


def evaluate(run_cli, ws, engine, *extra, operator="ci"):
    """``gatekeeper evaluate --flag prefix_cache --json`` through the CLI; returns (exit code, JSON),
    with the raw output in the failure message when it is not one JSON document."""
    code, out, err = run_cli("--workspace", ws, "evaluate", "--flag", "prefix_cache", "--engine", engine,
                             "--operator", operator, *extra, "--json")
    try:
        return code, json.loads(out)
    except ValueError:
        raise AssertionError(f"exit {code}, stdout not JSON: {out[:2000]!r}; stderr: {err[-2000:]!r}") from None


def not_blamed_on_batching(code: int, out: dict, ev: dict, fix: str) -> None:
    """Whatever a real server does under load, a flag-off side that batching changed is never a FAIL:
    INCONCLUSIVE (batch_variant:, naming the server's ``fix``) exactly when the flag-off runs disagree."""
    stable = all(c["equal"] for c in ev["comparisons"] if c["detail"]["pair"].split("~")[1].startswith("off"))
    if out["verdict"] == "INCONCLUSIVE":
        assert not stable and out["reasons"][0].startswith("batch_variant:"), out["reasons"]
        assert fix in out["reasons"][0]
    else:
        assert stable and (code, out["verdict"]) in ((0, "PASS"), (1, "FAIL")), out["reasons"]


def served_ws(workspace, rules: int | None = None, **profiles: str):
    """The workspace with the tiny suite as its battery (``rules`` rules; default ``conftest.SHORT``) and these engine
    profiles (name -> YAML)."""
    from conftest import SHORT, suite

    (workspace / "assertions" / "assistant.yaml").unlink()
    (workspace / "assertions" / "tiny.yaml").write_text(suite(rules or SHORT))
    for name, body in profiles.items():
        (workspace / "engines" / f"{name}.yaml").write_text(body)
    return workspace


def read_distance(ws) -> None:
    """The prefix_cache policy as shipped: the teacher-forced distance read (the fixture turns it off)."""
    policy = ws / "policies" / "prefix_cache.yaml"
    policy.write_text(policy.read_text().replace("distance: false\n", ""))


# A llama small enough to convert and serve in seconds, with the default model's tokenizer (which llama.cpp's
# converter knows) and weights louder than the initialiser's, so its answers vary from token to token.
TINY = {"library": "gguf", "seed": 0,
        "config": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True,
                   "max_position_embeddings": 2048},
        "normal": {"proj.weight": 0.3, "embed_tokens.weight": 1.0}}
# Flash attention off and the KV cache in float32 (llama.cpp keeps it in float16 by default, which moves a log-
# probability by about 1e-2 on this model even in one pass): the server computes as the in-process reference does.
F32 = ("-fa", "off", "-ctk", "f32", "-ctv", "f32")


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory) -> Path:
    """``TINY`` converted by llama.cpp's own script: ``model.gguf`` beside its Hugging Face files (a module imports
    it under the name its tests ask for)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    import real_bugs

    from gatekeeper.setup.models import resolve_model

    out = tmp_path_factory.mktemp("tiny-gguf")
    real_bugs.build(TINY, resolve_model("default", None), out)
    return out


TEXTS = ("Book a table for four at eight.", "What is the capital of Portugal?", "Summarise: the team ships Friday.",
         "Send the notes to Ana.", "Is it raining in Lisbon?", "Add milk to the list.")


def forced_agreement(local, served, texts=TEXTS[:3]) -> tuple[float, float, int]:
    """A server's cold forced reads (``HTTPEngine._forced``, one per answer position) against gatekeeper's in-process
    reference (``TorchEngine.reference``) on the same weights, over the model's own greedy answers to ``texts``:
    (the largest top-2 gap difference where both rank the same two tokens first, the floor the reference arm would
    measure in process (its read against the engine's own kernels), positions compared). Asserts the server picks
    R's token wherever R's margin is clear."""
    from gatekeeper.errors import GatekeeperError
    from gatekeeper.gate.arms.reference import FLIP, FLOOR

    worst, floor, compared = 0.0, FLOOR, 0
    for text in texts:
        prompt = local.tokenize(local.render([{"role": "user", "content": text}]))
        with local.session(cache=False) as s:
            answer = list(s.generate(prompt, max_tokens=12).tokens)
        sequence, steps = prompt + answer, len(answer)
        asked = [[t, t] for t in answer]
        ref = local.reference(sequence, steps, asked)
        own = local.reference(sequence, steps, asked, own=True)  # what the engine's kernels alone move
        floor = max(floor, *(abs(_gap(a) - _gap(b)) for a, b in zip(ref.top2, own.top2)))
        for j, want in enumerate(ref.top2):
            try:
                read = served._forced(sequence[:len(prompt) + j + 1])
            except GatekeeperError as e:  # a text prompt whose tokens do not round-trip is refused, never misread
                assert "do not come back from their text" in str(e)
                continue
            top = [[i, lp] for i, lp in sorted(read.items(), key=lambda kv: (-kv[1], kv[0]))[:2]]
            if _gap(want) > FLIP * floor:  # a clear pick: the server makes the same one
                assert top[0][0] == want[0][0], (text, j, top, want)
            if [t for t, _ in top] == [t for t, _ in want]:
                worst = max(worst, abs(_gap(top) - _gap(want)))
                compared += 1
    return worst, floor, compared


def _gap(top2) -> float:
    return top2[0][1] - top2[1][1]


def _cpus() -> set[int]:
    """The logical CPUs this process may run on."""
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


def threads() -> int:
    """Threads for a served engine's decode: two where this process may run on two cores (one where it has one:
    under make test's workers, each held to a core, tests/conftest.py; TEST_JOBS=1 gives them two).

    Two where there are two: a kernel bug that shows only when a decode step's attention is split across
    threads (each thread a share of the KV cache, the partial results merged) cannot show with one. No more
    than the cores: threads that wait on each other at every op spin, and on a shared core are far slower."""
    return max(1, min(2, len(_cpus())))


def physical_cores() -> int:
    """The physical cores among the CPUs this process may run on (SMT siblings count once)."""
    cores = set()
    for cpu in _cpus():
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(((topology / "physical_package_id").read_text().strip(), (topology / "core_id").read_text().strip()))
        except OSError:
            cores.add(("cpu", str(cpu)))
    return len(cores)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serving(cmd: list[str], url: str, *, log: Path, ready: str = "/health", within: float = 120, env=None):
    """A real server process started from ``cmd``, yielded once GET ``url + ready`` answers 200;
    stopped (SIGTERM, then SIGKILL) when the caller is done. Its output goes to ``log``."""
    name = Path(cmd[0]).name if "-m" not in cmd[:2] else cmd[2]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + within
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited ({proc.returncode}); see {log}: {log.read_text(errors='replace')[-1500:]}")
            try:
                with urllib.request.urlopen(url + ready, timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not come up in {within:g} s; see {log}")
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def llama_server(gguf: Path, *extra: str, log: Path):
    """A real llama-server (built once by gatekeeper.setup.llama_build) on a free loopback port."""
    from gatekeeper.setup.llama_build import build_server

    port = free_port()
    # One slot and a fixed context: requests run one at a time in the order they come. Two threads
    # (threads()): a bug in attention split across threads cannot show with one.
    cmd = [str(build_server()), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
           "-np", "1", "-c", "4096", "-t", str(threads()), *extra]
    with serving(cmd, f"http://127.0.0.1:{port}", log=log) as url:
        yield url


@contextmanager
def vllm_server(model: Path, *extra: str, log: Path):
    """A real vLLM-for-CPU server (set up once by gatekeeper.setup.vllm) on a free loopback port:
    blocks of 32 tokens, cached-token and timing figures on, 1 GiB of KV cache, eager (no compilation:
    it comes up in about 35 s instead of 80 s on two cores)."""
    from gatekeeper.setup.vllm import install

    port = free_port()
    cmd = [str(install()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
           "--port", str(port), "--served-model-name", "served", "--max-model-len", "2048", "--block-size", "32",
           "--enable-prompt-tokens-details", "--enable-per-request-metrics", "--return-tokens-as-token-ids",
           "--enforce-eager", *extra]
    # At least two threads (threads()): a bug in attention split across threads cannot show with one.
    # vLLM for CPU sets its worker's OpenMP threads itself: VLLM_CPU_OMP_THREADS_BIND unset is "auto", one
    # thread per physical core (of the first NUMA node) less one core kept for vLLM's scheduler, which on
    # two cores leaves the worker one thread: there, keep none (VLLM_CPU_NUM_OF_RESERVED_CPU=0). Both are
    # dropped from the caller's environment so that neither pins the worker to one core.
    # OMP_NUM_THREADS counts only under a binding of "nobind", where vLLM leaves the count alone.
    n = threads()
    env = child_env()
    for k in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU"):
        env.pop(k, None)
    # VLLM_ENABLE_V1_MULTIPROCESSING=0: the model runs in the engine core's process, not one more process that imports
    # torch and vLLM again (about 7 s of one core per server at start; the server batches and caches as before)
    env.update({"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": str(n), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    if physical_cores() - 1 < n:
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    with serving(cmd, f"http://127.0.0.1:{port}", log=log, within=900, env=env) as url:
        yield url


@contextmanager
def mlx_server(model: Path, *extra: str, log: Path):
    """A real mlx_lm.server (the project's venv; CPU backend on Linux) on a free loopback port."""
    port = free_port()
    hub = log.parent / "hf-hub"  # an existing folder, or its /v1/models answers an empty body
    hub.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "mlx_lm.server", "--model", str(model), "--host", "127.0.0.1", "--port", str(port), *extra]
    with serving(cmd, f"http://127.0.0.1:{port}", log=log, ready="/v1/models",
                 env=child_env(HF_HUB_CACHE=str(hub))) as url:
        yield url


@contextmanager
def llama_cpp_python_server(gguf: Path, *extra: str, log: Path):
    """llama-cpp-python's own OpenAI-compatible server (``llama-cpp-python[server]``) on a free port."""
    port = free_port()
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port),
           "--n_ctx", "4096", "--n_threads", str(threads()), *extra]  # threads(): see there
    with serving(cmd, f"http://127.0.0.1:{port}", log=log, ready="/v1/models") as url:
        yield url


# faulty_front modes, the timeout they run under, and what the error must say
BAD_ANSWERS = [
    ("garbage", 60, "not JSON"),
    ("wrong", 60, "not an OpenAI-compatible completion"),
    ("slow", 1, "no answer within 1 s; raise 'timeout'"),
]


def assert_aborted(code: int, out: dict, front: str, message: str, ws) -> None:
    """A bad answer from ``front``: exit 2 naming its URL and the profile, the evaluation aborted, the ledger intact."""
    from conftest import ledger

    assert code == 2, out
    assert f"{front}/v1/completions" in out["error"] and message in out["error"] and "engines/bad.yaml" in out["error"]
    lg = ledger(ws)
    (ev,) = lg.evaluations()
    assert ev["status"] == "aborted" and ev["verdict"] is None
    assert lg.verify().ok


@contextmanager
def faulty_front(upstream: str, mode: str, delay: float = 0.0, other: str | None = None, seen: list | None = None):
    """Forwards every request to ``upstream`` except POST /v1/completions, which it answers with
    ``mode``: ``garbage`` (200 with a body that is not JSON), ``wrong`` (JSON, not a completion),
    ``slow`` (forwards after ``delay`` seconds) or ``diverted`` (a completion of more than one token
    goes to ``other``: the answers come from another model than the one-token reads), ``hotter`` (a sampled
    request forwarded at twice its temperature: a server whose sampler does not follow the declared decoding) or
    ``unseeded_under_load`` (a request's seed dropped while another is in flight: a server that loses seeds when it
    batches) or ``frozen`` (every request's seed replaced by one: a generator that ignores its seeds). ``seen``: each
    completion request's body is appended to it."""
    in_flight = [0]
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # keep test output clean
            pass

        def _forward(self, body: bytes | None, to: str = upstream):
            req = urllib.request.Request(to + self.path, data=body, method=self.command,
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=60) as r:
                    self._send(r.status, r.read())
            except urllib.error.HTTPError as e:
                self._send(e.code, e.read())

        def _send(self, status: int, payload: bytes):
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up (its timeout): nothing to answer

        def do_GET(self):
            self._forward(None)

        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if self.path != "/v1/completions":
                return self._forward(body)
            if seen is not None:
                seen.append(json.loads(body))
            with lock:
                in_flight[0] += 1
                busy = in_flight[0] > 1
            try:
                self._complete(body, busy)
            finally:
                with lock:
                    in_flight[0] -= 1

        def _complete(self, body: bytes, busy: bool):
            if mode == "garbage":
                return self._send(200, b"<html>502 bad gateway</html>")
            if mode == "wrong":
                return self._send(200, json.dumps({"choices": [{"message": "hi"}]}).encode())
            if mode == "diverted" and other and json.loads(body).get("max_tokens", 16) > 1:
                return self._forward(body, other)
            if mode == "hotter" and json.loads(body).get("temperature"):
                request = json.loads(body)
                return self._forward(json.dumps({**request, "temperature": 2 * request["temperature"]}).encode())
            if mode == "frozen" and "seed" in (request := json.loads(body)):
                return self._forward(json.dumps({**request, "seed": 1}).encode())
            if mode == "unseeded_under_load" and busy and "seed" in (request := json.loads(body)):
                return self._forward(json.dumps({k: v for k, v in request.items() if k != "seed"}).encode())
            time.sleep(delay)
            self._forward(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def profile(off: str, on: str, *extra: str) -> str:
    extra = extra if any(e.startswith("timeout:") for e in extra) else (*extra, "timeout: 600")
    return "\n".join(["adapter: http", f"url: {off}", f"url_on: {on}", *extra]) + "\n"


def started(*servers):
    """Start servers side by side (vLLM takes minutes to come up); yields their URLs, stops them all."""
    stack = ExitStack()
    with ThreadPoolExecutor(len(servers)) as pool:
        futures = [pool.submit(lambda cm: (cm, cm.__enter__()), cm) for cm in servers]
    try:
        urls = []
        for f in futures:
            cm, url = f.result()  # a server that did not start fails the fixture, naming its log
            stack.push(cm.__exit__)
            urls.append(url)
    except BaseException:
        for f in futures:
            if f.exception() is None:
                f.result()[0].__exit__(None, None, None)
        raise
    return stack, urls
