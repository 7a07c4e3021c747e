"""The guard after a flip (``gatekeeper proxy --guard``): the rule's statistics, bad ``guard:`` values, and a real
proxy process in front of a real llama-server, with the flag-off side the same server with its prompt cache off
(a front that sets ``cache_prompt: false``). A healthy flag-on side is never rolled back; one that answers some
requests from stale state is rolled back within the comparisons the power analysis predicts, signed by the service
key, the OFREP resolver and the webhook see it, and the proxy serves the flag-off side from then on. A killed proxy
leaves a ledger that verifies and a restart resumes the statistic; a flag-off side that is down or stuck costs the
live side nothing."""

from __future__ import annotations

import http.client
import json
import math
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from review_ledger import get, review
from served import free_port, llama_server
from trust import allowed_line, keys  # noqa: F401

from gatekeeper.gate.guard import Count, Rule
from gatekeeper.gate.stats.evalues import log_evalue, to_detect
from gatekeeper.ledger import Ledger

pytest_plugins = ["postgres"]

STAGES = {"router": "You route requests. Pick one tool and say which. ",
          "writer": "You write short answers for the support desk, politely. "}
USERS = ["Book a table for four at eight.", "What is the capital of Portugal?", "Summarise: the team ships Friday.",
         "Refund order 1182, it came broken.", "Translate 'good morning' into French.", "Which plan fits a team of 9?",
         "Reset my password, please.", "When does the store open on Sunday?", "Cancel the meeting at noon.",
         "How far is the airport from the station?", "Write a haiku about rain.", "List three prime numbers."]


# --- the rule ------------------------------------------------------------------------------------
def _integral(k: int, n: int, p0: float, steps: int = 20000) -> float:
    """The mixture statistic by the midpoint rule, to check the closed form against."""
    h = (1 - p0) / steps
    total = sum(((p0 + (i + 0.5) * h) / p0) ** k * ((1 - p0 - (i + 0.5) * h) / (1 - p0)) ** (n - k) for i in range(steps))
    return total * h / (1 - p0)


@pytest.mark.parametrize("k,n,p0", [(0, 50, 0.02), (3, 50, 0.02), (6, 40, 0.1), (1, 200, 0.001)])
def test_the_statistic_is_the_mixture_it_says(k, n, p0):
    assert math.isclose(math.exp(log_evalue(k, n, p0)), _integral(k, n, p0), rel_tol=1e-3)


def test_a_limit_of_zero_makes_one_mismatch_a_breach_and_min_comparisons_holds_it_back():
    rule = Rule(limit=0, alpha=0.05, min_comparisons=20)
    assert not rule.tests({"a": Count(19, 1)})[0].breached  # 19 < min_comparisons
    assert rule.tests({"a": Count(20, 1)})[0].breached
    assert not rule.tests({"a": Count(5000, 0)})[0].breached


def test_false_rollbacks_stay_under_alpha_and_a_defect_is_found_where_the_power_analysis_says():
    """Simulated live traffic whose mismatch rate sits exactly at the limit (the worst case H0 allows), looked at
    after every batch of 8 for 4,000 comparisons: rolled back in at most alpha of the runs. At four times the limit
    every run is rolled back, at a median near ``to_detect``'s prediction."""
    rng = random.Random(7)
    limit, alpha, runs = 0.02, 0.1, 400
    rule = Rule(limit=limit, alpha=alpha, min_comparisons=20)

    def first_breach(rate: float, n_max: int) -> int | None:
        k = 0
        for n in range(1, n_max + 1):
            k += rng.random() < rate
            if n % 8 == 0 and rule.tests({"s": Count(n, k)})[0].breached:
                return n
        return None

    false = sum(first_breach(limit, 4000) is not None for _ in range(runs))
    assert false / runs <= alpha, false
    found = [first_breach(4 * limit, 4000) for _ in range(60)]
    assert all(found)
    predicted = to_detect(4 * limit, limit, alpha)
    median = sorted(found)[len(found) // 2]
    assert predicted / 2 <= median <= predicted * 2, (median, predicted)


def test_stage_limits_are_tests_of_their_own_at_a_share_of_alpha():
    rule = Rule(limit=0.5, alpha=0.06, min_comparisons=10, stage_limits={"router": 0})
    tests = rule.tests({"router": Count(30, 1), "writer": Count(30, 0)})
    assert [(t.scope, t.breached) for t in tests] == [("*", False), ("router", True)]
    assert all(math.isclose(t.alpha, 0.03) for t in tests)


# --- a workspace with the flag on ---------------------------------------------------------------
# aa_rate 0: the one-sample rule, right for these one-slot llama-servers (batch-invariant: docs/guard.md)
GUARD = {"rate": 1, "limit": 0.02, "alpha": 0.05, "min_comparisons": 10, "batch": 4, "flush_s": 0.5, "timeout_s": 5,
         "aa_rate": 0}


def guarded_ws(workspace: Path, keys, guard: dict | None = None, on: bool = True) -> Path:  # noqa: F811
    """The init workspace, the service key ``ci`` in allowed_signers, the policy's ``guard:`` and the flag on (a
    flip written straight to the ledger: how it got there is the flip tests' subject)."""
    policy = workspace / "policies" / "prefix_cache.yaml"
    if guard is not None:
        policy.write_text(policy.read_text() + f"guard: {json.dumps(guard)}\n")
    (workspace / "policies" / "allowed_signers").write_text(allowed_line("guard", keys["ci"]) + allowed_line("ana", keys["ana"]))
    if on:
        from gatekeeper.ledger import checkpoint
        from gatekeeper.workspace import Workspace

        with Ledger(f"sqlite:///{workspace / 'ledger' / 'evidence.db'}") as lg:
            lg.add_flip("prefix_cache", "on", "ana", "passed and approved")
            checkpoint.after_flip(Workspace(workspace), lg, None)  # the policy wants one after every flip
    return workspace


def lg(ws: Path) -> Ledger:
    return Ledger(f"sqlite:///{ws / 'ledger' / 'evidence.db'}")


STARTED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _no_proxy_outlives_its_test():
    yield
    while STARTED:
        proc = STARTED.pop()
        if proc.poll() is None:
            stop(proc)  # SIGTERM first: a server the proxy started is stopped with it


def start(ws: Path, keys, upstream: str, other: str | None, *extra: str, log: Path, ledger: str | None = None):  # noqa: F811
    """``gatekeeper proxy --guard`` as its own process, once it listens: (host:port, process). ``other`` None: the
    flag-off side is in ``extra`` (--shadow-engine); ``ledger``: a ledger URL other than the workspace's."""
    port = free_port()
    out = open(log, "ab")
    proc = subprocess.Popen([sys.executable, "-m", "gatekeeper.cli", "--workspace", str(ws),
                             *(["--ledger", ledger] if ledger else []), "proxy", "--upstream", upstream,
                             "--listen", f"127.0.0.1:{port}", "--guard", "prefix_cache", *(["--shadow", other] if other else []),
                             "--sign", str(keys["ci"]), *extra], stdout=out, stderr=subprocess.STDOUT,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    STARTED.append(proc)
    out.close()
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, log.read_text()
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return f"127.0.0.1:{port}", proc
        except OSError:
            assert time.monotonic() < deadline, "the proxy did not start listening"
            time.sleep(0.1)


def stop(proc, sig=signal.SIGTERM) -> int:
    proc.send_signal(sig)
    try:
        return proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def ask(where: str, i: int, stream: bool = False, chat: bool = False, **decoding) -> tuple[int, str]:
    """Request ``i`` of the replayed traffic: greedy, a stage's fixed prefix and a user line, as a completion or
    a chat completion; (status, text)."""
    stage = list(STAGES)[i % 2]
    user = USERS[i % len(USERS)] + f" (#{i // len(USERS)})"
    body = {"max_tokens": 8, "temperature": 0, "stream": stream, **decoding}
    if chat:
        body["messages"] = [{"role": "system", "content": STAGES[stage]}, {"role": "user", "content": user}]
    else:
        body["prompt"] = STAGES[stage] + user
    conn = http.client.HTTPConnection(*where.split(":"), timeout=120)
    conn.request("POST", "/v1/chat/completions" if chat else "/v1/completions", json.dumps(body),
                 {"Content-Type": "application/json", "X-Gatekeeper-Stage": stage})
    r = conn.getresponse()
    data = r.read()
    conn.close()
    if r.status != 200:
        return r.status, data.decode(errors="replace")
    if stream:
        events = [json.loads(x[6:]) for x in data.split(b"\n") if x.startswith(b"data: {")]
        return 200, "".join(c.get("text") or (c.get("delta") or {}).get("content") or ""
                            for e in events for c in e.get("choices", []))
    choice = json.loads(data)["choices"][0]
    return 200, choice["message"]["content"] if chat else choice["text"]


def metrics(where: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{where}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line and not line.startswith("#")}


def wait(predicate, within: float = 60, what: str = ""):
    deadline = time.monotonic() + within
    while not (got := predicate()):
        assert time.monotonic() < deadline, f"waited {within} s for {what}"
        time.sleep(0.1)
    return got


@contextmanager
def loopback(handler, closing: threading.Event | None = None):
    """``handler`` served on a free loopback port until the block ends (``closing`` set first: held requests end)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        if closing is not None:
            closing.set()
        server.shutdown()
        server.server_close()


def reply(handler: BaseHTTPRequestHandler, status: int, payload: bytes, kind: str = "application/json") -> None:
    handler.send_response(status)
    handler.send_header("Content-Type", kind)
    handler.send_header("Content-Length", str(len(payload)))
    handler.end_headers()
    handler.wfile.write(payload)


@contextmanager
def front(upstream: str, mode: str):
    """Forwards to ``upstream``; POST /v1/completions per ``mode``: ``off`` (the prompt cache off: the flag-off
    deployment), ``stale`` (every fourth request whose prefix was seen answers with that earlier request's answer,
    as a cache restoring another request's state would), ``down`` (never answers until the front closes), ``500``
    and ``close`` (every fifth request answered with a server error, or its connection closed with no answer)."""
    seen: dict[str, bytes] = {}
    count = [0]
    closing = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
            if mode == "down":
                closing.wait(120)
                return
            if mode == "off":
                body["cache_prompt"] = False
            prefix = body.get("prompt", "")[:40]
            count[0] += 1
            if mode in ("500", "close") and count[0] % 5 == 0:
                if mode == "500":
                    return reply(self, 500, b'{"error": {"message": "planted failure", "code": 500}}')
                self.close_connection = True  # no status line: the client's connection ends with nothing
                return
            stale = mode == "stale" and count[0] % 4 == 0 and prefix in seen and not body.get("stream")
            if stale:
                status, payload, kind = 200, seen[prefix], "application/json"
            else:
                req = urllib.request.Request(upstream + self.path, data=json.dumps(body).encode(), method="POST",
                                             headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=60) as r:
                    status, payload, kind = r.status, r.read(), r.headers.get("Content-Type")
                if not body.get("stream"):
                    seen[prefix] = payload
            reply(self, status, payload, kind)

    with loopback(Handler, closing) as url:
        yield url


@pytest.fixture(scope="module")
def server(tiny_gguf, tmp_path_factory):
    with llama_server(tiny_gguf / "model.gguf", "-fa", "off", log=tmp_path_factory.mktemp("logs") / "server.log") as url:
        yield url


# --- bad input ---------------------------------------------------------------------------------
@pytest.mark.parametrize("guard,field", [({"rate": 1.5}, "rate"), ({"alpha": 0.7}, "alpha"), ({"stages": {"router": 2}}, "stages"),
                                         ({"min_comparisons": 0}, "min_comparisons"), ({"window": 3}, "window"),
                                         ({"min_success_rate": 1.5}, "min_success_rate"), ({"max_latency_s": 0}, "max_latency_s")])
def test_bad_guard_values_are_exit_2_naming_the_file_and_field(run_cli, workspace, keys, guard, field):  # noqa: F811
    ws = guarded_ws(workspace, keys, guard)
    before = lg(ws).entries()
    code, _, err = run_cli("--workspace", ws, "proxy", "--upstream", "http://127.0.0.1:9", "--guard", "prefix_cache",
                           "--shadow", "http://127.0.0.1:9", "--sign", keys["ci"])
    assert code == 2 and "prefix_cache.yaml" in err and field in err, err
    assert lg(ws).entries() == before


@pytest.mark.parametrize("case", ["no guard section", "flag off", "key not allowed", "no key", "no shadow"])
def test_a_guard_that_could_not_act_refuses_to_start(run_cli, workspace, keys, case):  # noqa: F811
    ws = guarded_ws(workspace, keys, None if case == "no guard section" else GUARD, on=case != "flag off")
    key = keys["mallory"] if case == "key not allowed" else keys["ci"]
    args = ["--workspace", ws, "proxy", "--upstream", "http://127.0.0.1:9", "--guard", "prefix_cache"]
    args += [] if case == "no shadow" else ["--shadow", "http://127.0.0.1:9"]
    args += [] if case == "no key" else ["--sign", key]
    code, _, err = run_cli(*args)
    expect = {"no guard section": "no 'guard:' section", "flag off": "prefix_cache is off", "key not allowed":
              "may not sign", "no key": "--sign KEY", "no shadow": "--shadow URL"}[case]
    assert code == 2 and expect in err, err


# --- real traffic ------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_healthy_flag_is_never_rolled_back_and_the_shadow_changes_no_answer(server, workspace, keys, tmp_path, run_cli):  # noqa: F811
    ws = guarded_ws(workspace, keys, GUARD)
    with front(server, "off") as off:
        direct = [ask(off.removeprefix("http://"), i, chat=i % 4 == 1)[1] for i in range(48)]
        where, proc = start(ws, keys, server, off, log=tmp_path / "proxy.log")
        got = [ask(where, i, stream=i % 3 == 0, chat=i % 4 == 1) for i in range(48)]
        assert got == [(200, text) for text in direct]  # through the guard: the server's own answers
        for i in range(4):  # sampled: paired by a seed both sides get, or not paired at all (counted, not compared)
            ask(where, i, temperature=0.9, **({"seed": 1000 + i} if i < 3 else {}))
        for stream in (False, True):  # llama.cpp's own /completion, whose stream ends without [DONE]
            conn = http.client.HTTPConnection(*where.split(":"), timeout=120)
            conn.request("POST", "/completion", json.dumps({"prompt": STAGES["router"] + "Hi.", "n_predict": 6,
                                                            "temperature": 0, "stream": stream}))
            r = conn.getresponse()
            assert r.status == 200 and r.read()
            conn.close()
        m = wait(lambda: (m := metrics(where))['gatekeeper_guard_compared_total{flag="prefix_cache"}'] == 53 and m,
                 what="every request compared")
        assert m['gatekeeper_guard_mismatches_total{flag="prefix_cache"}'] == 0
        assert m['gatekeeper_guard_unpaired_total{flag="prefix_cache",reason="sampled without a seed"}'] == 1
        assert m['gatekeeper_guard_flag_on{flag="prefix_cache"}'] == 1
        assert stop(proc) == 0, (tmp_path / "proxy.log").read_text()
    code, out, _ = run_cli("--workspace", ws, "ledger", "live", "prefix_cache", "--json")
    live = json.loads(out)
    assert code == 0 and live["compared"] == 53 and live["mismatches"] == 0 and set(STAGES) <= set(live["stages"])
    # the anytime bound after 53 clean comparisons: (1 - p)^53 = alpha / 54 (the uniform mixture's B(1, 54))
    assert math.isclose(live["tv_bound"], 1 - (0.05 / 54) ** (1 / 53), rel_tol=1e-3)
    assert not live["rolled_back"] and sum(live["shapes"].values()) == 53 and live["unpaired"] == {"sampled without a seed": 1}
    code, out, _ = run_cli("--workspace", ws, "status", "--json")
    assert next(f for f in json.loads(out)["flags"] if f["flag"] == "prefix_cache")["live"]["compared"] == 53
    code, out, _ = run_cli("--workspace", ws, "ledger", "list")
    assert "live evidence of prefix_cache" in out and "53 compared, 0 parted" in out
    assert lg(ws).flag_states()["prefix_cache"]["state"] == "on" and lg(ws).verify().ok


@pytest.mark.slow
def test_a_stale_flag_on_side_is_rolled_back_signed_and_everyone_sees_it(server, workspace, keys, tmp_path, run_cli):  # noqa: F811
    from gatekeeper.openfeature.resolve import Resolver

    ws = guarded_ws(workspace, keys, GUARD)
    hooks: list[dict] = []

    class Hook(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            hooks.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(204)
            self.end_headers()

    hook = ThreadingHTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=hook.serve_forever, daemon=True).start()
    with Resolver(ws) as resolver, front(server, "stale") as on, front(server, "off") as off:
        assert resolver.resolve("prefix_cache").value is True
        where, proc = start(ws, keys, on, off, "--webhook", f"http://127.0.0.1:{hook.server_address[1]}",
                            log=tmp_path / "proxy.log")
        # a quarter of the requests after the first of each prefix are stale: the rate the power analysis sizes
        predicted = to_detect(0.2, GUARD["limit"], GUARD["alpha"])
        sent = 0
        while metrics(where)['gatekeeper_guard_flag_on{flag="prefix_cache"}'] == 1:
            assert sent < 2 * predicted + GUARD["min_comparisons"], f"no rollback after {sent} requests"
            ask(where, sent)
            sent += 1
            if sent % GUARD["batch"] == 0:
                time.sleep(0.3)  # let the writer keep up, so the count of requests to detection is honest
        # from now on the flag-off side answers
        assert ask(where, 1000) == ask(off.removeprefix("http://"), 1000)
        state = wait(lambda: lg(ws).flag_states()["prefix_cache"], what="the rollback")
        assert state["state"] == "off" and state["signer"] == "guard" and state["operator"] == "guard"
        assert "guard rollback" in state["reason"] and "shadow batches" in state["reason"]
        assert resolver.resolve("prefix_cache").value is False  # OFREP and the provider: the next evaluation
        wait(lambda: hooks, what="the webhook")
        assert hooks[0]["event"] == "gatekeeper.rollback" and hooks[0]["state"] == "off"
        assert stop(proc) == 1  # the exit status says a rollback happened
    hook.shutdown()
    code, out, _ = run_cli("--workspace", ws, "ledger", "live", "prefix_cache", "--json")
    live = json.loads(out)
    assert live["rolled_back"] and live["ended_by"]["signer"] == "guard" and live["mismatches"] >= 1
    assert live["mismatched"] and all(item["answers"][0] != item["answers"][1] for item in live["mismatched"])
    assert lg(ws).verify().ok
    with review(ws) as u:  # the review app's live page, and the flag's row pointing at it
        status, _, body = get(u + "/live.json")
        (shown,) = json.loads(body)["live"]
        assert status == 200 and shown["rolled_back"] and shown["compared"] == live["compared"]
        assert "ROLLED BACK" in get(u + "/live")[2] and "rolled back by the guard" in get(u + "/flags")[2]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["500", "close", "500 unshadowed"])
def test_a_flag_on_side_that_fails_one_request_in_five_is_rolled_back(server, workspace, keys, tmp_path, run_cli, mode):  # noqa: F811
    """Failures are evidence (issue #61): each failed live request the flag-off side answers is a parting, counted by
    the rule and kept with its status and error; the healthy side's test above sees none. With no shadows at all,
    a success-rate floor counts every live request the proxy serves and rolls the same side back."""
    unshadowed = mode == "500 unshadowed"
    guard = {**GUARD, "stages": dict.fromkeys(STAGES, 0), "min_success_rate": 0.95} if unshadowed else GUARD
    ws = guarded_ws(workspace, keys, guard)
    with front(server, mode.split()[0]) as on, front(server, "off") as off:
        where, proc = start(ws, keys, on, off, log=tmp_path / "proxy.log")
        statuses = []  # a first rule's alpha/2, split between two tests where there is a floor
        predicted = to_detect(0.2, 0.05, GUARD["alpha"] / 4) if unshadowed else to_detect(0.2, GUARD["limit"], GUARD["alpha"] / 2)
        while metrics(where)['gatekeeper_guard_flag_on{flag="prefix_cache"}'] == 1:
            assert len(statuses) < 2 * predicted + GUARD["min_comparisons"], f"no rollback after {len(statuses)} requests"
            statuses.append(ask(where, len(statuses))[0])
            if len(statuses) % GUARD["batch"] == 0:
                time.sleep(0.3)
        assert stop(proc) == 1
    assert statuses.count(200) >= 4 * statuses.count(500 if mode != "close" else 502) > 0, statuses
    code, out, _ = run_cli("--workspace", ws, "ledger", "live", "prefix_cache", "--json")
    live = json.loads(out)
    if unshadowed:
        assert live["rolled_back"] and live["shadowed"] == 0 and live["served"]["failed"] >= 2, live
        assert "the live side's success rate:" in live["ended_by"]["reason"], live["ended_by"]
        return
    assert live["rolled_back"] and live["flag_on_failed"] >= 1 and live["mismatches"] >= live["flag_on_failed"], live
    failed = [i for i in live["mismatched"] if i.get("reason") == "flag_on_failed"]
    assert failed and failed[0]["answers"][0] is None and failed[0]["answers"][1], failed
    assert failed[0]["status"] == (500 if mode == "500" else 0) and failed[0]["error"], failed[0]


@pytest.mark.slow
def test_kill_9_loses_no_entry_and_a_restart_resumes_the_statistic(server, workspace, keys, tmp_path):  # noqa: F811
    ws = guarded_ws(workspace, keys, {**GUARD, "flush_s": 30})
    with front(server, "off") as off:
        where, proc = start(ws, keys, server, off, log=tmp_path / "proxy.log")
        for i in range(10):  # two batches of 4 written, 2 comparisons pending in memory
            ask(where, i)
        wait(lambda: len(lg(ws).shadows("prefix_cache")) == 2, what="two batches")
        proc.kill()
        proc.wait()
        assert lg(ws).verify().ok
        where, proc = start(ws, keys, server, off, log=tmp_path / "proxy.log")
        for i in range(4):
            ask(where, i)
        wait(lambda: len(lg(ws).shadows("prefix_cache")) == 3, what="the third batch")
        assert stop(proc) == 0
    third = lg(ws).shadows("prefix_cache")[2]["summary"]["tests"][0]
    assert third["compared"] == 12  # 8 resumed from the ledger + 4 since the restart


@pytest.mark.slow
def test_a_flag_off_side_that_is_down_or_stuck_costs_the_live_side_nothing(server, workspace, keys, tmp_path):  # noqa: F811
    ws = guarded_ws(workspace, keys, {**GUARD, "in_flight": 2, "timeout_s": 60})
    dead = f"http://127.0.0.1:{free_port()}"
    with front(server, "down") as stuck:
        for other, reason, n in ((dead, "flag-off side unreachable", 6), (stuck, "too many in flight", 4)):
            where, proc = start(ws, keys, server, other, log=tmp_path / "proxy.log")
            got = [ask(where, i) for i in range(6)]
            assert got == [ask(server.removeprefix("http://"), i) for i in range(6)]
            key = f'gatekeeper_guard_dropped_total{{flag="prefix_cache",reason="{reason}"}}'
            wait(lambda w=where, k=key, n=n: metrics(w).get(k, 0) >= n, what=reason)
            proc.kill()
            proc.wait()
    assert lg(ws).flag_states()["prefix_cache"]["state"] == "on"


@pytest.mark.slow
def test_the_flag_off_side_can_be_a_server_the_guard_starts_and_stops(server, tiny_gguf, workspace, keys, tmp_path):  # noqa: F811
    """``--shadow-engine NAME``: an http profile whose ``serve:`` starts the flag-off llama-server (its prompt cache off
    per request through the front is not needed here: the profile's server is the flag-off deployment)."""
    from gatekeeper.setup.llama_build import build_server

    ws = guarded_ws(workspace, keys, {**GUARD, "in_flight": 8})  # the new server is slower than a warm one: none dropped
    marker = str(random.randrange(3000, 4000))  # a context size of this run only: the started server, found by its command
    command = [str(build_server()), "-m", str(tiny_gguf / "model.gguf"), "--host", "{host}", "--port", "{port}", "-np", "1",
               "-c", marker, "-fa", "off"]
    (ws / "engines" / "offside.yaml").write_text(f"adapter: http\nserve: {{command: {json.dumps(command)}, ready: /health}}\n")
    where, proc = start(ws, keys, server, None, "--shadow-engine", "offside", log=tmp_path / "proxy.log")
    assert subprocess.run(["pgrep", "-f", "--", f"-c {marker}"], capture_output=True).returncode == 0
    assert [ask(where, i)[0] for i in range(6)] == [200] * 6
    wait(lambda: metrics(where)['gatekeeper_guard_compared_total{flag="prefix_cache"}'] == 6, what="six compared")
    assert metrics(where)['gatekeeper_guard_mismatches_total{flag="prefix_cache"}'] == 0
    assert stop(proc) == 0
    assert subprocess.run(["pgrep", "-f", "--", f"-c {marker}"], capture_output=True).returncode == 1  # stopped with the proxy


# --- the A/A baseline, end to end through a proxy (fake servers: no model) ------------------------------
@contextmanager
def noisy(parts: set[tuple[int, int]]):
    """A completion server whose answer to prompt ``p{i}`` is ``ok`` except on the calls ``(i, call)`` in ``parts``
    (the prompt's call-th request here), where batch noise gives another answer: fixed by prompt and call, so the
    counts do not depend on the order the proxy's shadows arrive in."""
    calls: dict[int, int] = {}
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            i = int(json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))["prompt"][1:])
            with lock:
                call = calls[i] = calls.get(i, -1) + 1
            text = "noise" if (i, call) in parts else "ok"
            payload = json.dumps({"choices": [{"text": text, "finish_reason": "stop"}], "usage": {"completion_tokens": 1}}).encode()
            reply(self, 200, payload)

    with loopback(Handler) as url:
        yield url


@pytest.mark.parametrize("second", ["the flag-off side again", "a flag-off replica"])
def test_batch_noise_on_both_sides_is_no_rollback_with_a_baseline_and_a_rollback_without_one(run_cli, workspace, keys, second):  # noqa: F811
    """The flag changes nothing; each side's answers part by batch noise at 20% (prompt i with i % 10 == 3 on the flag-on
    side, the first flag-off answer at 6, the second at 8: A/B and A/A each part at 20%, discordant either way alike).
    With every shadowed request compared A/A too the flag stays on, and /metrics and ``ledger live --json`` count the
    A/A comparisons; the same traffic under ``aa_rate: 0`` (the rule against zero) is rolled back."""
    from gatekeeper.signing import load_key
    from gatekeeper.traffic.live.guarded import Guarded
    from gatekeeper.traffic.live.proxy import running
    from gatekeeper.workspace import Workspace

    n = 40
    on_parts = {(i, 0) for i in range(n) if i % 10 == 3}
    off_parts = {(i, 0) for i in range(n) if i % 10 == 6}
    again_parts = {(i, 0 if second == "a flag-off replica" else 1) for i in range(n) if i % 10 == 8}
    guard = {**GUARD, "limit": 0, "aa_rate": 1, "flush_s": 0.2, "timeout_s": 60, "in_flight": 64}  # none dropped on a busy machine
    ws = guarded_ws(workspace, keys, guard)
    url = f"sqlite:///{ws / 'ledger' / 'evidence.db'}"
    with noisy(on_parts) as on, noisy(off_parts | (again_parts if second != "a flag-off replica" else set())) as off, \
            noisy(again_parts) as replica:
        watch = Guarded(Workspace(ws), url, "prefix_cache", off, load_key(keys["ci"]),
                        baseline=replica if second == "a flag-off replica" else None)
        with running(on, None, guard=watch) as proxy:
            where = proxy.removeprefix("http://")
            for i in range(n):
                conn = http.client.HTTPConnection(*where.split(":"), timeout=30)
                conn.request("POST", "/v1/completions", json.dumps({"prompt": f"p{i}", "max_tokens": 1, "temperature": 0}),
                             {"Content-Type": "application/json"})
                assert conn.getresponse().read()
                conn.close()
            key = 'gatekeeper_guard_{}{{flag="prefix_cache"}}'
            m = wait(lambda: (m := metrics(where))[key.format("aa_compared_total")] == n and m, what="every A/A comparison")
            assert (m[key.format("compared_total")], m[key.format("mismatches_total")], m[key.format("aa_mismatches_total")]) == (n, 8, 8)
            assert m['gatekeeper_guard_discordant_total{flag="prefix_cache",only="ab"}'] == 4
            assert m['gatekeeper_guard_discordant_total{flag="prefix_cache",only="aa"}'] == 4
            assert m[key.format("flag_on")] == 1
    assert watch.rollback is None and lg(ws).flag_states()["prefix_cache"]["state"] == "on"
    code, out, _ = run_cli("--workspace", ws, "ledger", "live", "prefix_cache", "--json")
    live = json.loads(out)
    assert code == 0 and (live["compared"], live["mismatches"], live["aa_compared"], live["aa_mismatches"]) == (n, 8, n, 8)
    assert (live["ab_only"], live["aa_only"]) == (4, 4) and live["rule"]["aa_rate"] == 1
    assert all(t["against"] == "baseline" and not t["breached"] for t in live["tests"])

    # the same traffic and the rule against zero: batch noise is a rollback
    (ws / "policies" / "prefix_cache.yaml").write_text((ws / "policies" / "prefix_cache.yaml").read_text().replace(
        '"aa_rate": 1', '"aa_rate": 0'))
    with noisy(on_parts) as on, noisy(off_parts) as off:
        watch = Guarded(Workspace(ws), url, "prefix_cache", off, load_key(keys["ci"]))
        with running(on, None, guard=watch) as proxy:
            where = proxy.removeprefix("http://")
            for i in range(n):
                conn = http.client.HTTPConnection(*where.split(":"), timeout=30)
                conn.request("POST", "/v1/completions", json.dumps({"prompt": f"p{i}", "max_tokens": 1, "temperature": 0}),
                             {"Content-Type": "application/json"})
                assert conn.getresponse().read()
                conn.close()
            wait(lambda: metrics(where)['gatekeeper_guard_flag_on{flag="prefix_cache"}'] == 0, what="the rollback")
    assert watch.rollback is not None and lg(ws).flag_states()["prefix_cache"]["state"] == "off"


def test_the_proxy_says_at_start_when_the_guard_has_no_baseline(workspace, keys, tmp_path):  # noqa: F811
    with noisy(set()) as on, noisy(set()) as off:
        for aa_rate, said in ((0, True), (0.1, False)):
            ws = guarded_ws(workspace, keys, {**GUARD, "aa_rate": aa_rate}, on=aa_rate == 0)
            log = tmp_path / f"proxy-{aa_rate}.log"
            _, proc = start(ws, keys, on, off, log=log)
            text = wait(lambda log=log: "Ctrl-C stops" in (t := log.read_text()) and t, within=30, what="the start line")
            assert ("no A/A baseline" in text and "VLLM_BATCH_INVARIANT=1" in text) == said, text
            assert ("10% of those twice for an A/A baseline" in text) == (not said), text
            assert stop(proc) == 0
            (ws / "policies" / "prefix_cache.yaml").write_text(
                "\n".join(x for x in (ws / "policies" / "prefix_cache.yaml").read_text().splitlines() if not x.startswith("guard:")) + "\n")


@pytest.mark.slow
def test_three_proxy_processes_on_one_postgresql_ledger_roll_back_once_and_all_serve_the_flag_off_side(
        workspace, keys, pg_url, tmp_path):  # noqa: F811
    """One test for a fleet (issue #61): three ``gatekeeper proxy --guard`` processes in front of three replicas, one
    team ledger on a real PostgreSQL server. Only the first replica parts (prompt i with i % 4 == 0, the flag-off side
    never): the fleet is rolled back once, by one proxy, and each of the others serves its very next request from the
    flag-off side (its metrics say the flag is off before it wrote anything more)."""
    guard = {**GUARD, "limit": 0.02, "min_comparisons": 10, "batch": 2, "flush_s": 0.2}
    ws = guarded_ws(workspace, keys, guard, on=False)
    from gatekeeper.ledger import checkpoint
    from gatekeeper.workspace import Workspace

    with Ledger(pg_url) as ledger:
        ledger.add_flip("prefix_cache", "on", "ana", "passed and approved")
        checkpoint.after_flip(Workspace(ws), ledger, None)
    bad = {(i, 0) for i in range(0, 400, 4)}
    with noisy(bad) as one, noisy(set()) as two, noisy(set()) as three, noisy(set()) as off:
        fleet = [start(ws, keys, up, off, "--name", f"replica-{n}", log=tmp_path / f"proxy-{n}.log", ledger=pg_url)
                 for n, up in enumerate((one, two, three))]
        key = 'gatekeeper_guard_flag_on{flag="prefix_cache"}'
        sent = 0
        while all(metrics(where)[key] == 1 for where, _ in fleet):
            assert sent < 300, "no rollback after 300 requests"
            for where, _ in fleet:
                conn = http.client.HTTPConnection(*where.split(":"), timeout=30)
                conn.request("POST", "/v1/completions", json.dumps({"prompt": f"p{sent}", "max_tokens": 1, "temperature": 0}),
                             {"Content-Type": "application/json"})
                assert conn.getresponse().read()
                conn.close()
                sent += 1
            time.sleep(0.05)
        with Ledger(pg_url) as ledger:  # the rollback written (the proxy that makes it stops shadowing first)
            wait(lambda: ledger.flag_states()["prefix_cache"]["state"] == "off", what="the rollback in the ledger")
        for where, _ in fleet:  # one more request each: every proxy now knows
            conn = http.client.HTTPConnection(*where.split(":"), timeout=30)
            conn.request("POST", "/v1/completions", json.dumps({"prompt": "p1", "max_tokens": 1, "temperature": 0}),
                         {"Content-Type": "application/json"})
            conn.getresponse().read()
            conn.close()
            assert metrics(where)[key] == 0, where
        codes = [stop(proc) for _, proc in fleet]
    with Ledger(pg_url) as ledger:
        flips = ledger.flips("prefix_cache")
        named = {b["summary"].get("proxy") for b in ledger.shadows("prefix_cache")}
    assert [f["state"] for f in flips] == ["on", "off"] and flips[1]["reason"].startswith("guard rollback"), flips
    assert sorted(codes) == [0, 0, 1], codes  # exit 1: the proxy that rolled the flag back
    assert named == {"replica-0", "replica-1", "replica-2"}, named
