"""``gatekeeper proxy`` (a real process) in front of a real llama-server on loopback, with a TCP relay
between them that records what the server sent, and can hold or cut its answers: bodies pass byte
for byte and streams as they arrive; the capture holds one line per call with the server's own
figures; ``analyze`` on it agrees with ``measure --capture``; a dead, slow or absent upstream gives
the client an error and the proxy keeps serving."""

from __future__ import annotations

import http.client
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import SUITE
from served import free_port, llama_server

from gatekeeper.setup.models import find_gguf

MESSAGES = [{"role": "system", "content": "You are a terse assistant. Answer in one line."},
            {"role": "user", "content": "What is 2+2?"}]


class Relay:
    """A loopback TCP relay to ``port`` that records the bytes the server sends back; it can hold
    them (``hold(sent so far)`` true: the next bytes wait for ``release``) or cut the connection
    once ``cut`` has gone by."""

    def __init__(self, port: int):
        self.target, self.received, self.conns = port, [], []
        self.hold = self.cut = None
        self.holding, self.released = False, threading.Event()
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target))
            self.conns += [client, server]
            buf = bytearray()
            self.received.append(buf)
            threading.Thread(target=self._pump, args=(client, server, None), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, buf), daemon=True).start()

    def _pump(self, src, dst, record):
        try:
            while data := src.recv(65536):
                if record is None:
                    dst.sendall(data)
                    continue
                if self.hold and self.hold(bytes(record)) and not self.released.is_set():
                    self.holding = True
                    self.released.wait(120)
                record += data
                dst.sendall(data)
                if self.cut and self.cut in record:
                    break
        except OSError:
            pass
        for s in (src, dst):  # one side closed: so does the other, as a real connection would
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def release(self):
        self.holding = False
        self.released.set()

    def close(self):
        self.listener.close()
        for s in self.conns:
            try:
                s.close()
            except OSError:
                pass


def bodies(raw: bytes) -> list[bytes]:
    """The bodies of the HTTP/1.1 responses in one connection's bytes (Content-Length or chunked)."""
    out, i = [], 0
    while i < len(raw) and b"\r\n\r\n" in raw[i:]:
        end = raw.index(b"\r\n\r\n", i)
        head, i = raw[i:end].decode("latin-1").lower(), end + 4
        body = b""
        if "transfer-encoding: chunked" in head:
            while b"\r\n" in raw[i:]:
                j = raw.index(b"\r\n", i)
                size = int(raw[i:j].split(b";")[0], 16)
                body, i = body + raw[j + 2:j + 2 + size], j + 4 + size
                if size == 0:
                    break
        else:
            n = int(re.search(r"content-length: *(\d+)", head).group(1))
            body, i = raw[i:i + n], i + n
        out.append(body)
    return out


@contextmanager
def proxy(upstream: str, capture: Path, *extra: str):
    """``gatekeeper proxy`` as its own process; stopped with SIGTERM, as a service manager would."""
    port = free_port()
    log = open(capture.with_suffix(".proxy.log"), "wb")
    proc = subprocess.Popen([sys.executable, "-m", "gatekeeper.cli", "proxy", "--upstream", upstream,
                             "--listen", f"127.0.0.1:{port}", "--capture", str(capture), *extra],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, capture.with_suffix(".proxy.log").read_text()
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "the proxy did not start listening"
                time.sleep(0.1)
        yield f"127.0.0.1:{port}", proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def call(where: str, path: str, body: dict | None = None, headers: dict | None = None, timeout: float = 300):
    """(status, body bytes) of one request, on a fresh connection; the body as read off the wire."""
    conn = http.client.HTTPConnection(*where.split(":"), timeout=timeout)
    conn.request("POST" if body is not None else "GET", path, None if body is None else json.dumps(body),
                 {"Content-Type": "application/json", **(headers or {})})
    r = conn.getresponse()
    data = r.read()
    conn.close()
    return r.status, data


def events(data: bytes) -> list[dict]:
    return [json.loads(line[6:]) for line in data.split(b"\n") if line.startswith(b"data: {")]


def lines(capture: Path, n: int) -> list[dict]:
    """The capture's lines once ``n`` are written (the proxy renders prompts after answering)."""
    deadline = time.monotonic() + 60
    while True:
        got = [json.loads(x) for x in capture.read_text().splitlines()] if capture.exists() else []
        if len(got) >= n or time.monotonic() > deadline:
            return got
        time.sleep(0.1)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with llama_server(find_gguf(), "-fa", "off", log=tmp_path_factory.mktemp("logs") / "server.log") as url:
        yield url


@pytest.fixture
def relay(server):
    r = Relay(int(server.rsplit(":", 1)[1]))
    yield r
    r.release()
    r.close()


@pytest.mark.slow
def test_bodies_pass_byte_for_byte_and_the_capture_has_the_servers_figures(server, relay, tmp_path):
    cap = tmp_path / "cap.jsonl"
    direct = server.removeprefix("http://")
    chat = {"messages": MESSAGES, "max_tokens": 8, "temperature": 0}
    streamed = {**chat, "stream": True, "stream_options": {"include_usage": True}, "user": "ana"}
    with proxy(f"http://127.0.0.1:{relay.port}", cap) as (where, proc):
        answers = [call(where, "/v1/chat/completions", chat, {"X-Gatekeeper-Stage": "router", "X-Gatekeeper-Stream": "s1"}),
                   call(where, "/v1/chat/completions", streamed),
                   call(where, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0})]
        assert call(where, "/health")[0] == 200 and call(where, "/v1/models")[0] == 200  # proxied, not captured
        got = lines(cap, 3)
        assert proc.poll() is None
    sent = [b for conn in relay.received for b in bodies(bytes(conn))]
    for status, body in answers:
        assert status == 200 and body in sent, body  # the very bytes the server sent: ids, timestamps and timings too
    # and the same answer as without the proxy (greedy; only ids, timestamps and timings differ)
    status, alone = call(direct, "/v1/chat/completions", chat)
    assert json.loads(alone)["choices"] == json.loads(answers[0][1])["choices"]
    status, alone = call(direct, "/v1/chat/completions", streamed)
    assert [e["choices"] for e in events(alone)] == [e["choices"] for e in events(answers[1][1])]

    assert len(got) == 3, got  # one line per completion call, none for /health or /v1/models
    reports = [json.loads(answers[0][1]), events(answers[1][1])[-1], json.loads(answers[2][1])]
    for line, answer in zip(got, reports):
        t, usage = answer["timings"], answer["usage"]
        assert line["prompt_tokens"] == usage["prompt_tokens"] == t["prompt_n"] + t["cache_n"] == len(line["tokens"])
        assert line["cached_tokens"] == t["cache_n"]
        assert line["prefill_s"] == pytest.approx(t["prompt_ms"] / 1000, abs=1e-6)
        assert line["decode_s"] == pytest.approx(t["predicted_ms"] / 1000, abs=1e-6)
        assert line["status"] == 200 and line["render"] == "server"
        assert line["duration_s"] >= line["prefill_s"] + line["decode_s"] - 1e-3  # wall time holds the server's
    assert (got[0]["stage"], got[0]["stream"], got[1]["stream"]) == ("router", "s1", "ana")
    assert got[1]["stage"].startswith("default/") and got[0]["text"] == got[1]["text"]  # same messages, same rendering
    assert got[0]["text"].startswith("<|im_start|>system\nYou are a terse") and got[2]["text"] == "Once upon a time"


@pytest.mark.slow
def test_a_burst_through_the_proxy_shows_as_calls_in_flight(server, tmp_path, run_cli):
    """Six calls sent at once to the real server: analyze sees them in flight together, from the wall
    times the proxy recorded (the one-slot server queues them, so each waits for the ones before)."""
    cap = tmp_path / "burst.jsonl"
    body = {"messages": MESSAGES, "max_tokens": 16, "temperature": 0}
    with proxy(server, cap) as (where, _):
        threads = [threading.Thread(target=call, args=(where, "/v1/chat/completions", body, {"X-Gatekeeper-Stage": "burst"}))
                   for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        got = lines(cap, 6)
    assert len(got) == 6 and all(line["duration_s"] > 0 for line in got)
    code, out, _ = run_cli("analyze", cap, "--json")
    load = json.loads(out)["stages"]["burst"]["load"]
    assert code == 0 and load["durations"]["wall"] == 6 and load["cannot_report"] == []
    assert load["concurrency"]["max"] >= 3 and load["requests_per_s"] > 0


@pytest.mark.slow
def test_streams_are_passed_on_as_they_arrive(server, relay, tmp_path):
    relay.hold = lambda sent: b"data: " in sent  # the server's first event goes by, then the relay holds the rest
    with proxy(f"http://127.0.0.1:{relay.port}", tmp_path / "cap.jsonl") as (where, proc):
        conn = http.client.HTTPConnection(*where.split(":"), timeout=120)
        conn.request("POST", "/v1/chat/completions", json.dumps(
            {"messages": MESSAGES, "max_tokens": 16, "temperature": 0, "stream": True}), {"Content-Type": "application/json"})
        r = conn.getresponse()
        first = r.read1(65536)
        deadline = time.monotonic() + 30
        while not relay.holding and time.monotonic() < deadline:
            time.sleep(0.05)
        assert b"data: " in first and b"[DONE]" not in first
        assert relay.holding  # the client has the first event while the rest is still held upstream
        relay.release()
        rest = r.read()
        assert b"[DONE]" in first + rest


@pytest.mark.slow
def test_an_upstream_that_dies_mid_stream_gives_the_client_an_error(server, relay, tmp_path):
    cap = tmp_path / "cap.jsonl"
    relay.cut = b"data: "  # the connection to the server drops after its first event
    with proxy(f"http://127.0.0.1:{relay.port}", cap) as (where, proc):
        conn = http.client.HTTPConnection(*where.split(":"), timeout=120)
        conn.request("POST", "/v1/chat/completions", json.dumps(
            {"messages": MESSAGES, "max_tokens": 64, "temperature": 0, "stream": True}), {"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200
        with pytest.raises(http.client.IncompleteRead) as info:
            r.read()
        assert b"upstream_failed" in info.value.partial  # a last event says why, then the stream is cut
        relay.cut = None
        assert proc.poll() is None
        status, body = call(where, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4, "temperature": 0})
        assert status == 200 and json.loads(body)["choices"]  # the proxy keeps serving
        got = lines(cap, 2)
    assert "failed mid-answer" in got[0]["error"] and "error" not in got[1]


@pytest.mark.slow
def test_a_silent_upstream_is_504_and_an_absent_one_502(server, relay, tmp_path):
    relay.hold = lambda sent: True  # the server's answer never gets through
    with proxy(f"http://127.0.0.1:{relay.port}", tmp_path / "slow.jsonl", "--timeout", "2") as (where, proc):
        status, body = call(where, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4})
        assert status == 504 and "did not answer within 2 s" in json.loads(body)["error"]["message"]
        assert proc.poll() is None
    nobody = f"http://127.0.0.1:{free_port()}"
    with proxy(nobody, tmp_path / "down.jsonl") as (where, proc):
        for _ in range(2):
            status, body = call(where, "/v1/chat/completions", {"messages": MESSAGES})
            error = json.loads(body)["error"]
            assert status == 502 and error["type"] == "upstream_unreachable"
            assert f"cannot reach {nobody}" in error["message"] and "start the server or fix --upstream" in error["message"]
        assert proc.poll() is None


@pytest.mark.slow
def test_analyze_on_the_proxy_capture_agrees_with_measure(server, workspace, run_cli, tmp_path):
    (workspace / "assertions" / "assistant.yaml").unlink()
    (workspace / "assertions" / "tiny.yaml").write_text(SUITE)
    proxied, measured = tmp_path / "proxied.jsonl", tmp_path / "measured.jsonl"
    with proxy(server, proxied) as (where, proc):
        (workspace / "engines" / "served.yaml").write_text(
            f"adapter: http\nurl: http://{where}\ncache_switch: cache_prompt\ntimeout: 600\n")
        code, out, err = run_cli("--workspace", workspace, "measure", "--engine", "served", "--flag-state", "off",
                                 "--capture", measured, "--json")
        assert code == 0, out + err
        expected = [json.loads(x) for x in measured.read_text().splitlines()]
        got = lines(proxied, len(expected) + 1)
    texts = {e["text"] for e in expected}
    battery = [g for g in got if g.get("text") in texts]
    assert len(battery) == len(expected)
    # the rest are measure's own calls: its warm-up, and the served engine warming the stage's static prefix
    warm_up, static = sorted((g["text"] for g in got if g not in battery), key=lambda t: "warm up" not in t)
    assert "warm up" in warm_up and all(e["text"].startswith(static) for e in expected) and len(got) == len(battery) + 2
    assert [g["tokens"] for g in battery] == [e["tokens"] for e in expected]
    only = tmp_path / "battery.jsonl"
    only.write_text("".join(json.dumps(g) + "\n" for g in battery))
    reports = []
    for path in (measured, only):
        code, out, _ = run_cli("analyze", path, "--json")
        assert code == 0, out
        reports.append(json.loads(out))
    (m,), (p,) = reports[0]["stages"].values(), reports[1]["stages"].values()
    assert p["byte_stable_share"] == m["byte_stable_share"] > 0
    assert (p["stable_prefix_bytes"], p["stable_prefix_tokens"]) == (m["stable_prefix_bytes"], m["stable_prefix_tokens"])
    assert m["telemetry"] is None and p["telemetry"]["calls_reported"] == len(battery)  # the server's figures
    assert p["telemetry"]["cached_tokens"] == 0 and 0 < p["telemetry"]["prefill_share"] < 1  # measured with the cache off


@pytest.mark.slow
def test_no_text_keeps_no_prompt_and_analyze_still_finds_the_shared_prefix(server, tmp_path, run_cli):
    caps = {mode: tmp_path / f"{mode}.jsonl" for mode in ("text", "meta")}
    for mode, cap in caps.items():
        with proxy(server, cap, *(["--no-text"] if mode == "meta" else [])) as (where, proc):
            for q in ("What is 2+2?", "Name a colour.", "Spell cat."):
                messages = [MESSAGES[0], {"role": "user", "content": q}]
                assert call(where, "/v1/chat/completions", {"messages": messages, "max_tokens": 2})[0] == 200
            lines(cap, 3)
    meta = [json.loads(x) for x in caps["meta"].read_text().splitlines()]
    assert all("text" not in m and "tokens" not in m and m["bytes"] > 0 and m["n_tokens"] > 0 for m in meta)
    assert "terse" not in caps["meta"].read_text()
    shares = {}
    for mode, cap in caps.items():
        code, out, _ = run_cli("analyze", cap, "--json")
        assert code == 0, out
        (shares[mode],) = json.loads(out)["stages"].values()
    exact, blocky = shares["text"]["stable_prefix_bytes"], shares["meta"]["stable_prefix_bytes"]
    assert exact - 64 < blocky <= exact and shares["meta"]["mean_prompt_bytes"] == shares["text"]["mean_prompt_bytes"]
    assert shares["meta"]["telemetry"]["calls_reported"] == 3


@pytest.mark.parametrize("args, words", [
    (["--upstream", "ftp://host"], "give the server's base URL"),
    (["--upstream", "http://127.0.0.1:1", "--listen", "nowhere"], "give HOST:PORT or PORT"),
    (["--upstream", "http://127.0.0.1:1", "--timeout", "0"], "--timeout must be above 0"),
])
def test_bad_options_are_exit_2(run_cli, tmp_path, args, words):
    code, out, err = run_cli("proxy", *args, "--capture", tmp_path / "cap.jsonl")
    assert code == 2 and words in err and not (tmp_path / "cap.jsonl").exists()


def test_a_capture_in_a_missing_folder_is_exit_2(run_cli, tmp_path):
    code, out, err = run_cli("proxy", "--upstream", "http://127.0.0.1:1", "--capture", tmp_path / "no" / "cap.jsonl")
    assert code == 2 and "does not exist" in err


class OneAnswerPerConnection:
    """A loopback HTTP/1.1 server that answers one request per connection with ``Connection: keep-alive``,
    then closes the connection when the next request arrives on it, unanswered: the moment a real
    server's keep-alive timeout ends a connection just as a client reuses it."""

    def __init__(self):
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.port, self.connections = self.listener.getsockname()[1], 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn):
        with conn:
            request = b""
            while b"\r\n\r\n" not in request:
                if not (data := conn.recv(65536)):
                    return
                request += data
            head, _, rest = request.partition(b"\r\n\r\n")
            length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1)) if b"ength:" in head else 0
            while len(rest) < length:
                rest += conn.recv(65536)
            body = json.dumps({"choices": [{"index": 0, "text": "four"}]}).encode()
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: keep-alive\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            conn.recv(65536)  # the next request on this connection: closed unanswered


def test_an_upstream_that_closes_a_kept_alive_connection_loses_no_call(tmp_path):
    """The proxy never sends a call on a connection the upstream may already be closing: each call
    reaches the upstream (CI once saw a 502 here from a real llama-server's keep-alive timeout)."""
    upstream = OneAnswerPerConnection()
    with proxy(f"http://127.0.0.1:{upstream.port}", tmp_path / "cap.jsonl") as (where, proc):
        for _ in range(4):  # a path the proxy passes on without rendering it, so only these calls reuse connections
            status, body = call(where, "/v1/embeddings", {"input": "2+2="})
            assert status == 200 and json.loads(body)["choices"][0]["text"] == "four", body
        assert proc.poll() is None and upstream.connections == 4
    upstream.listener.close()


# --- the capture format's telemetry, read by analyze (no server) ----------------------------------

def _write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_analyze_sums_the_reported_telemetry_and_leaves_absent_figures_absent(run_cli, tmp_path):
    base = {"stream": "s", "text": "<|system|>rules<|user|>q"}
    cap = _write(tmp_path / "cap.jsonl", [
        {**base, "stage": "router", "t": 0, "prompt_tokens": 100, "cached_tokens": 0, "prefill_s": 0.3, "decode_s": 0.1},
        {**base, "stage": "router", "t": 1, "prompt_tokens": 100, "cached_tokens": 90, "prefill_s": 0.1, "decode_s": 0.1},
        {**base, "stage": "router", "t": 2, "prompt_tokens": 50},  # a server that reports no timings
        {**base, "stage": "planner", "t": 3},  # nor anything at all
    ])
    code, out, _ = run_cli("analyze", cap, "--json")
    assert code == 0, out
    r = json.loads(out)
    assert r["stages"]["router"]["telemetry"] == {"calls": 3, "calls_reported": 3, "prompt_tokens": 250, "cached_tokens": 90,
                                                   "prefill_s": 0.4, "decode_s": 0.2, "prefill_share": 0.6667}
    assert r["stages"]["planner"]["telemetry"] is None  # absent, not zeros
    assert r["telemetry"]["calls"] == 4 and r["telemetry"]["calls_reported"] == 3
    code, out, _ = run_cli("analyze", cap)
    assert code == 0 and "prefill tax, as the server reported it" in out and "66.7%" in out


@pytest.mark.parametrize("field, value, words", [
    ("prefill_s", -1, "is not a number >= 0"), ("cached_tokens", 1.5, "is not a whole number"),
    ("decode_s", "fast", "is not a number >= 0")])
def test_bad_telemetry_is_exit_2_naming_the_line_and_field(run_cli, tmp_path, field, value, words):
    cap = _write(tmp_path / "cap.jsonl", [{"stage": "a", "stream": "s", "t": 0, "text": "x", field: value}])
    code, out, _ = run_cli("analyze", cap, "--json")
    error = json.loads(out)["error"]
    assert code == 2 and f"{cap}:1: field '{field}' {words}" in error


def test_a_metadata_only_capture_feeds_analyze_but_not_replay(tmp_path):
    from gatekeeper.errors import GatekeeperError
    from gatekeeper.traffic.captures import capture

    salt = b"s" * 16
    texts = ["S" * 200 + "query one", "S" * 200 + "another query"]
    cap = _write(tmp_path / "meta.jsonl", [{"stage": "a", "stream": "s", "t": i, **capture.metadata(t, salt)}
                                            for i, t in enumerate(texts)])
    requests = capture.read(cap, content=False)
    assert [r.size for r in requests] == [len(t) for t in texts] and requests[0].blocks[:3] == requests[1].blocks[:3]
    with pytest.raises(GatekeeperError, match="metadata-only line"):
        capture.read(cap)  # replay needs the prompt itself


@pytest.mark.slow
def test_a_served_engine_names_its_stages_and_streams_to_the_proxy(server, workspace, run_cli, tmp_path):
    from served import evaluate, served_ws

    cap = tmp_path / "staged.jsonl"
    with proxy(server, cap) as (where, proc):
        ws = served_ws(workspace, served=f"adapter: http\nurl: http://{where}\ncache_switch: cache_prompt\ntimeout: 600\n")
        code, out = evaluate(run_cli, ws, "served", "--limit", "1")
        assert code in (0, 1), out
        # case a: twice with the flag off, once on; and each of those three sessions warms the stage's static prefix once
        got = lines(cap, 6)
    assert len(got) == 6 and {g["stage"] for g in got} == {"tiny"}  # the suite's stage, not one named after the model
    assert sorted(g["stream"] for g in got) == ["default"] * 3 + ["tiny/a"] * 3  # a warm-up belongs to no conversation
