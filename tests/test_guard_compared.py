"""The comparison the gate makes, on shadowed requests (issue #61 item 2): a request whose messages are a suite case's
graded by the case's assertions on both answers (a lost pass counted by a test of its own, beside the mismatch rule),
and both sides' teacher-forced distributions of the flag-off answer read where the servers give them (a departure
beyond max_kld counted likewise). Real llama-servers, the proxy as its own process, a front that changes the flag-on
side's answers by construction."""

from __future__ import annotations

import http.client
import json
import math
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler

import pytest
from review_ledger import get, review
from served import llama_server
from test_guard import _no_proxy_outlives_its_test, guarded_ws, lg, loopback, metrics, reply, server, start, stop, wait  # noqa: F401
from trust import keys  # noqa: F401

from gatekeeper.gate.guard import ASSERTIONS, DISTANCE, Count, Judged, Rule
from gatekeeper.setup.models import find_gguf

SYSTEM = "You answer the support desk's questions in one short line."
QUESTIONS = ["Where is my parcel?", "Can I change my seat?", "Is the shop open today?", "How do I reset my password?"]
PLANTED = "[planted]"  # what the lossy flag-on side appends: the cases' assertion refuses it, the model never says it
SUITE = {"suite": "desk", "stage": "desk", "decoding": {"max_tokens": 8},
         "prompt": [{"role": "system", "static": True, "text": SYSTEM}, {"role": "user", "static": False, "text": "{q}"}],
         "cases": [{"id": f"q{i}", "vars": {"q": q}, "assert": [{"type": "not-contains", "value": PLANTED}]}
                   for i, q in enumerate(QUESTIONS)]}


# --- the rule ------------------------------------------------------------------------------------
def test_lost_passes_and_departures_are_tests_of_their_own_and_an_old_rule_keeps_its_digest():
    old = Rule(limit=0.1, alpha=0.06, min_comparisons=10)
    assert "assertion_limit" not in old.to_dict() and Rule.from_dict(old.to_dict()).digest() == old.digest()
    rule = Rule(limit=0.5, alpha=0.06, min_comparisons=10, assertion_limit=0, max_kld=0.01, kld_limit=0.1)
    assert Rule.from_dict(rule.to_dict()) == rule
    tests = rule.tests({"desk": Count(30, 20)}, judged=Judged(read=30, departed=2, graded=12, lost=1))
    assert [(t.scope, t.compared, t.mismatches, t.breached) for t in tests] == [
        ("*", 30, 20, False), (ASSERTIONS, 12, 1, True), (DISTANCE, 30, 2, False)]
    assert all(math.isclose(t.alpha, 0.02) for t in tests)  # three tests: alpha split three ways
    assert not rule.tests({}, judged=Judged(graded=9, lost=9))[1].breached  # min_comparisons holds it back
    many = rule.tests({}, judged=Judged(read=200, departed=60))[2]
    assert many.breached and "tv_bound" not in many.to_dict()  # a departure share well above 0.1


@pytest.mark.parametrize("guard,field", [({"max_kld": 0.1}, "max_kld"), ({"assertions": False, "assertion_limit": 0},
                                                                         "assertion_limit"), ({"distance": True}, "--shadow-engine")])
def test_a_comparison_the_guard_cannot_make_is_exit_2_naming_the_fix(run_cli, workspace, keys, guard, field):  # noqa: F811
    ws = guarded_ws(workspace, keys, {"rate": 1, **guard})
    code, _, err = run_cli("--workspace", ws, "proxy", "--upstream", "http://127.0.0.1:9", "--guard", "prefix_cache",
                           "--shadow", "http://127.0.0.1:9", "--sign", keys["ci"])
    assert code == 2 and field in err and "prefix_cache.yaml" in err, err
    assert not lg(ws).shadows("prefix_cache")


# --- real traffic --------------------------------------------------------------------------------
@contextmanager
def rewriting(upstream: str, suffix: str):
    """Forwards to ``upstream``, the answer's text with ``suffix`` appended (a flag-on side whose answers change by
    construction)."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            conn = http.client.HTTPConnection(*upstream.removeprefix("http://").split(":"), timeout=120)
            conn.request("POST", self.path, body, {"Content-Type": "application/json"})
            r = conn.getresponse()
            answer = json.loads(r.read())
            conn.close()
            for c in answer.get("choices", []):
                if "message" in c:
                    c["message"]["content"] += suffix
                else:
                    c["text"] += suffix
            reply(self, r.status, json.dumps(answer).encode())

    with loopback(Handler) as url:
        yield url


def chat(where: str, i: int) -> str:
    """Request ``i``: a suite case's messages, greedy, as the pipeline sends them (every third one a question of no
    case, which nothing grades)."""
    q = QUESTIONS[i % len(QUESTIONS)] if i % 3 else f"Tell me about order {i}."
    conn = http.client.HTTPConnection(*where.split(":"), timeout=120)
    conn.request("POST", "/v1/chat/completions", json.dumps({
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}], "max_tokens": 8,
        "temperature": 0}), {"Content-Type": "application/json", "X-Gatekeeper-Stage": "desk"})
    r = conn.getresponse()
    text = json.loads(r.read())["choices"][0]["message"]["content"]
    conn.close()
    return text


def live(run_cli, ws) -> dict:
    code, out, _ = run_cli("--workspace", ws, "ledger", "live", "prefix_cache", "--json")
    assert code == 0, out
    return json.loads(out)


# The text may part freely (limit 0.9: a lossy flag); a lost pass may not (assertion_limit 0)
LOSSY = {"rate": 1, "limit": 0.9, "assertion_limit": 0, "alpha": 0.05, "min_comparisons": 4, "batch": 2,
         "flush_s": 0.5, "timeout_s": 30, "aa_rate": 0}


@pytest.mark.slow
@pytest.mark.parametrize("suffix,rolled_back", [(" " + PLANTED, True), (" ok", False)])
def test_a_lost_pass_rolls_back_a_flag_whose_partings_the_mismatch_rule_tolerates(server, workspace, keys, tmp_path,  # noqa: F811
                                                                                   run_cli, suffix, rolled_back):
    ws = guarded_ws(workspace, keys, LOSSY)
    (ws / "assertions" / "desk.yaml").write_text(json.dumps(SUITE))
    with rewriting(server, suffix) as on:
        where, proc = start(ws, keys, on, server, log=tmp_path / "proxy.log")
        sent = 0
        while sent < 18 and metrics(where)['gatekeeper_guard_flag_on{flag="prefix_cache"}'] == 1:
            assert chat(where, sent).endswith(suffix)  # the client gets the flag-on side's answer
            sent += 1
            wait(lambda: metrics(where)['gatekeeper_guard_in_flight{flag="prefix_cache"}'] == 0, what="the shadow")
        assert stop(proc) == (1 if rolled_back else 0), (tmp_path / "proxy.log").read_text()
    got = live(run_cli, ws)
    n = got["compared"]  # the requests in turn; after a rollback nothing more is compared
    graded = sum(1 for i in range(n) if i % 3)
    assert n in (sent, sent - 1) and got["rolled_back"] is rolled_back and got["mismatches"] == n  # every text parted
    assert got["judged"] == {"read": 0, "departed": 0, "graded": graded, "lost": graded if rolled_back else 0}
    if rolled_back:
        reason = got["ended_by"]["reason"]
        assert sent < 18 and "the assertions: " in reason and "lost a pass" in reason, reason
        lost = [i for i in got["mismatched"] if i.get("lost_pass")]
        assert lost and all(i["compared_by"] == ["text", "assertions"] and i["case"].startswith("desk/q") for i in lost)
        code, out, _ = run_cli("--workspace", ws, "ledger", "live", "prefix_cache")
        assert code == 0 and f"{graded} of {graded} graded requests lost a pass" in out and "(lost a pass of desk/q" in out
        with review(ws) as u:  # the review app's Live page says which comparison parted each kept request
            page = get(u + "/live")[2]
            assert "text, assertions: lost a pass of desk/q" in page and "graded by a case" in page
    else:
        assert sent == 18 and lg(ws).flag_states()["prefix_cache"]["state"] == "on"
        assert not any(t["breached"] for t in got["tests"])
    assert lg(ws).verify().ok


@pytest.fixture(scope="module")
def default_servers(tmp_path_factory):
    """The default model on two llama-servers: the same deployment, and one with another RoPE scale (its distributions
    move at every position past the first by construction)."""
    logs = tmp_path_factory.mktemp("logs")
    with llama_server(find_gguf(), "-fa", "off", log=logs / "same.log") as same, \
            llama_server(find_gguf(), "-fa", "off", "--rope-freq-scale", "0.5", log=logs / "moved.log") as moved:
        yield same, moved


# max_kld: a request's mean KL over its three forced positions (llama-server's top 20, the rest lumped). Reading the
# same server with its prompt cache on and off moved it by at most 2e-3 here (the reuse's own numerics); another RoPE
# scale moves it by 0.1-0.4 (a change of the model itself, on any CPU). The bound sits between, ten times the first.
DISTANT = {"rate": 1, "limit": 0.9, "assertions": False, "distance": True, "max_kld": 0.02, "alpha": 0.05,
           "min_comparisons": 3, "batch": 2, "flush_s": 0.5, "timeout_s": 60, "aa_rate": 0}


@pytest.mark.slow
@pytest.mark.parametrize("moved", [True, False])
def test_the_distance_read_on_both_sides_rolls_back_a_moved_deployment(default_servers, workspace, keys, tmp_path,  # noqa: F811
                                                                       run_cli, moved):
    same, other = default_servers
    ws = guarded_ws(workspace, keys, DISTANT)
    (ws / "engines" / "desk.yaml").write_text(f"adapter: http\nurl: {same}\ncache_switch: cache_prompt\ntimeout: 600\n")
    where, proc = start(ws, keys, other if moved else same, None, "--shadow-engine", "desk", log=tmp_path / "proxy.log")
    sent = 0
    while sent < 8 and metrics(where)['gatekeeper_guard_flag_on{flag="prefix_cache"}'] == 1:
        chat(where, sent)
        sent += 1
        wait(lambda: metrics(where)['gatekeeper_guard_in_flight{flag="prefix_cache"}'] == 0, what="the shadow")
    assert stop(proc) == (1 if moved else 0), (tmp_path / "proxy.log").read_text()
    got = live(run_cli, ws)
    assert got["judged"]["read"] == got["compared"] in (sent, sent - 1) and got["judged"]["graded"] == 0
    if moved:
        reason = got["ended_by"]["reason"]
        assert got["rolled_back"] and "the distance: " in reason and "beyond the rule's max_kld" in reason, reason
        assert got["judged"]["departed"] >= DISTANT["min_comparisons"]
        kept = [i for i in got["mismatched"] if "kld" in i]
        assert kept and all(i["kld"] > DISTANT["max_kld"] and "distance" in i["compared_by"] for i in kept)
    else:
        assert not got["rolled_back"] and sent == 8 and got["judged"]["departed"] == 0 and got["mismatches"] == 0
    assert lg(ws).verify().ok


def test_the_judge_grades_a_cases_messages_and_a_grading_error_leaves_the_text_comparison(workspace, monkeypatch):
    from gatekeeper.battery import checks
    from gatekeeper.traffic.live.judge import Judge
    from gatekeeper.workspace import Workspace

    (workspace / "assertions" / "desk.yaml").write_text(json.dumps(SUITE))
    judge = Judge(Workspace(workspace))
    case = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[1]}]}
    j = judge.judge(case, "Yes. " + PLANTED, "Yes.")
    assert (j.case, j.lost, j.comparisons()) == ("desk/q1", True, ["text", "assertions"])
    assert judge.judge(case, "Yes.", "Yes. " + PLANTED).lost is False  # the flag-on side passing more is no loss
    other = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Not a case."}]}
    assert judge.judge(other, PLANTED, "ok").comparisons() == ["text"]

    def broken(*args, **kwargs):
        raise RuntimeError("the grader's script died")

    monkeypatch.setattr(checks, "outcomes", broken)
    j = judge.judge(case, "Yes. " + PLANTED, "Yes.")
    assert j.lost is None and j.comparisons() == ["text"] and "script died" in j.record()["ungraded"]
