"""A flag rolled out by steps (issue #61): the proxy serves the flag-on side to the step's share of request keys, the
guard raises the step while its test holds (each raise signed by the service key), a defect met at a later step
rolls the flag back, and the OFREP answer for a key is stable at a step."""

from __future__ import annotations

import http.client
import json
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler

import pytest
from review_ledger import get, review
from test_guard import GUARD, guarded_ws, lg, loopback, reply, wait
from trust import keys  # noqa: F401

from gatekeeper.gate.state.rollout import bucket, message
from gatekeeper.signing import verify

FLAG = "prefix_cache"
ROLLOUT = {"steps": [0.1, 0.5, 1.0], "min_comparisons_per_step": 8, "hold_s": 0}
RULE = {**GUARD, "limit": 0, "min_comparisons": 4, "batch": 2, "flush_s": 0.2, "in_flight": 64, "timeout_s": 30}


def rolled_ws(workspace, keys, rollout=ROLLOUT):  # noqa: F811
    ws = guarded_ws(workspace, keys, RULE)
    policy = ws / "policies" / f"{FLAG}.yaml"
    policy.write_text(policy.read_text() + f"rollout: {json.dumps(rollout)}\n")
    return ws


@contextmanager
def server(parts=lambda key: False):
    """A completion server that records the keys it answered and answers ``noise`` to the keys ``parts`` picks."""
    seen: list[str] = []
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
            if self.path != "/v1/completions":  # the capturing proxy's /tokenize: not llama-server, so no token ids
                return reply(self, 404, b"{}")
            key = body["prompt"]
            with lock:
                seen.append(key)
            text = "noise" if parts(key) else "ok"
            reply(self, 200, json.dumps({"choices": [{"text": text, "finish_reason": "stop"}],
                                         "usage": {"completion_tokens": 1}}).encode())

    with loopback(Handler) as url:
        yield url, seen


def send(where: str, key: str, user: str | None = None) -> None:
    """A completion whose rollout key is ``key`` (the X-Gatekeeper-Key header), or, with ``user``, the request's user
    (its stream, as a replayed capture's requests carry it)."""
    conn = http.client.HTTPConnection(*where.split(":"), timeout=30)
    body = {"prompt": key, "max_tokens": 1, "temperature": 0, **({"user": user} if user else {})}
    conn.request("POST", "/v1/completions", json.dumps(body),
                 {"Content-Type": "application/json", **({} if user else {"X-Gatekeeper-Key": key})})
    assert conn.getresponse().read()
    conn.close()


def captured(tmp_path, n: int) -> list[dict]:
    """``n`` requests of as many users through the capturing proxy: the capture file's lines, as a replay reads them."""
    from gatekeeper.traffic.live.proxy import running

    capture = tmp_path / "capture.jsonl"
    with server() as (upstream, _), running(upstream, capture) as proxy:
        for i in range(n):
            send(proxy.removeprefix("http://"), f"request {i}", user=f"user-{i}")
    # a line is written once the proxy has rendered its prompt, after the answer: a replay orders them by ``t``
    lines = sorted((json.loads(line) for line in capture.read_text().splitlines()), key=lambda line: line["t"])
    assert len(lines) == n and all(line["text"] == f"request {i}" for i, line in enumerate(lines))
    return lines


def watch_of(ws, keys, off):  # noqa: F811
    from gatekeeper.signing import load_key
    from gatekeeper.traffic.live.guarded import Guarded
    from gatekeeper.workspace import Workspace

    return Guarded(Workspace(ws), f"sqlite:///{ws / 'ledger' / 'evidence.db'}", FLAG, off, load_key(keys["ci"]))


def test_a_healthy_rollout_is_raised_step_by_step_each_raise_signed_and_each_key_on_its_steps_side(workspace, keys,  # noqa: F811
                                                                                                     tmp_path):
    """A capture of 400 users' requests, replayed through the guarding proxy: each request's key is its user."""
    from gatekeeper.traffic.live.proxy import running

    ws = rolled_ws(workspace, keys)
    shares: list[float] = []
    with server() as (on, on_seen), server() as (off, off_seen):
        watch = watch_of(ws, keys, off)
        with running(on, None, guard=watch) as proxy:
            where = proxy.removeprefix("http://")
            for line in captured(tmp_path, 400):
                share = watch.share
                key = line["stream"]
                before = len(on_seen)
                send(where, line["text"], user=key)
                # the flag-on side served this key exactly when it falls within the step's share (which the writer may
                # raise while the request runs: within the share before or after)
                after = watch.share
                assert bucket(FLAG, key) < after if len(on_seen) > before else bucket(FLAG, key) >= share, (key, share)
                shares.append(share)
                if len(shares) % 2:
                    wait(lambda: watch.in_flight == 0, what="the shadows")
                if share == 1.0:
                    break
            wait(lambda: watch.in_flight == 0, what="the last shadows")
    assert sorted(set(shares)) == [0.1, 0.5, 1.0] and shares == sorted(shares), "raised in order, never lowered"
    assert lg(ws).flag_states()[FLAG]["state"] == "on" and watch.rollback is None
    raises = [(b["id"], b["summary"]["raised"]) for b in lg(ws).shadows(FLAG) if "raised" in b["summary"]]
    assert [r["share"] for _, r in raises] == [0.5, 1.0]
    flip_id = lg(ws).flag_states()[FLAG]["id"]
    for _, r in raises:
        assert r["signer"] == "guard" and r["compared"] >= ROLLOUT["min_comparisons_per_step"]
        signed = verify(r["signature"], message(FLAG, flip_id, r["step"], r["share"], r["batches"]))
        assert signed.fingerprint == watch.key.fingerprint
    # the first step's keys: always on (the servers see the prompts: "request i" is user-i's)
    assert not any(p not in on_seen for p in off_seen if bucket(FLAG, "user-" + p.split()[-1]) < 0.1)


def test_a_defect_met_at_the_ten_percent_step_rolls_the_flag_back_to_off(workspace, keys, run_cli):  # noqa: F811
    """The flag-on side parts only on the keys that fall between 1% and 10%: the first step never serves them on, the
    second does, and the guard rolls the flag back there; every request after goes to the flag-off side."""
    from gatekeeper.traffic.live.proxy import running

    ws = rolled_ws(workspace, keys, {"steps": [0.01, 0.1, 1.0], "min_comparisons_per_step": 4, "hold_s": 0})
    with server(lambda key: 0.01 <= bucket(FLAG, key) < 0.1) as (on, on_seen), server() as (off, _):
        watch = watch_of(ws, keys, off)
        with running(on, None, guard=watch) as proxy:
            where = proxy.removeprefix("http://")
            i = 0
            while watch.rollback is None:
                assert i < 3000, f"no rollback after {i} requests (share {watch.share})"
                send(where, f"user-{i}")
                wait(lambda: watch.in_flight == 0, what="the shadow")
                i += 1
            served = len(on_seen)
            for j in range(20):
                send(where, f"after-{j}")
            assert len(on_seen) == served  # rolled back: the flag-off side serves every request
    state = lg(ws).flag_states()[FLAG]
    assert state["state"] == "off" and state["reason"].startswith("guard rollback"), state
    raised = [b["summary"]["raised"]["share"] for b in lg(ws).shadows(FLAG) if "raised" in b["summary"]]
    assert raised == [0.1], raised  # rolled back at the 10% step, never raised past it
    code, out, _ = run_cli("--workspace", ws, "ledger", "live", FLAG, "--json")
    live = json.loads(out)
    assert code == 0 and live["rolled_back"] and live["rollout"]["step"] == 1 and live["rollout"]["next"] == "ended"
    assert [(r["share"], r["signer"]) for r in live["rollout"]["raises"]] == [(0.1, "guard")]
    with review(ws) as u:  # the review app's Live page reads the same from the ledger alone
        status, _, page = get(u + "/live")
        assert status == 200 and "ROLLED BACK" in page and "Step 2 of 3" in page and "Next: ended" in page, page


def test_the_ofrep_answer_for_a_key_is_stable_at_a_step_and_follows_the_proxys_split(workspace, keys):  # noqa: F811
    from gatekeeper.ledger import Ledger
    from gatekeeper.openfeature.resolve import Resolver

    ws = rolled_ws(workspace, keys)
    flip_id = lg(ws).flag_states()[FLAG]["id"]
    with Ledger(f"sqlite:///{ws / 'ledger' / 'evidence.db'}") as ledger:  # the guard's batch that raised to 50%
        ledger.add_shadow(FLAG, flip_id, "guard", {"stages": {}, "raised": {"step": 1, "share": 0.5}}, [])
    with Resolver(ws) as resolver:
        r = resolver.resolve(FLAG)
        assert r.share == 0.5
        answers = {k: r.for_key(k) for k in (f"user-{i}" for i in range(400))}
        assert all(resolver.resolve(FLAG).for_key(k).value == a.value for k, a in list(answers.items())[:50])
        assert {a.reason for a in answers.values()} == {"SPLIT"} and all(a.metadata["rolloutShare"] == 0.5 for a in answers.values())
        assert all(a.value == (bucket(FLAG, k) < 0.5) for k, a in answers.items())  # as the proxy and the Runtime split
        assert 0.4 < sum(a.value for a in answers.values()) / len(answers) < 0.6
        assert r.for_key(None).value is False  # no targeting key: the flag-off side until the rollout is complete


@pytest.mark.parametrize("rollout, words", [
    ({"steps": [0.5, 0.1, 1.0]}, "must rise"), ({"steps": [0.1, 0.5]}, "last step is 1.0"), ({"steps": [0, 1.0]}, "above 0"),
    ({"steps": [0.1, 1.0], "min_comparisons_per_step": 0}, "min_comparisons_per_step"),
    ({"steps": [0.1, 1.0], "hold_s": -1}, "hold_s"), ({"steps": [0.1, 1.0], "share": 2}, "share")])
def test_bad_rollout_values_are_exit_2_naming_the_file_and_field(run_cli, workspace, keys, rollout, words):  # noqa: F811
    ws = rolled_ws(workspace, keys, rollout)
    before = lg(ws).entries()
    code, _, err = run_cli("--workspace", ws, "proxy", "--upstream", "http://127.0.0.1:9", "--guard", FLAG,
                           "--shadow", "http://127.0.0.1:9", "--sign", keys["ci"])
    assert code == 2 and f"{FLAG}.yaml" in err and "rollout" in err and words in err, err
    assert lg(ws).entries() == before


def test_a_rollout_without_a_guard_is_exit_2(run_cli, workspace, keys):  # noqa: F811
    ws = guarded_ws(workspace, keys, None)
    policy = ws / "policies" / f"{FLAG}.yaml"
    policy.write_text(policy.read_text() + f"rollout: {json.dumps(ROLLOUT)}\n")
    code, _, err = run_cli("--workspace", ws, "status")
    assert code == 2 and "no 'guard:' section" in err, err


def test_the_ofrep_server_answers_each_targeting_key_by_the_step_single_and_bulk(workspace, keys):  # noqa: F811
    import asyncio

    from aiohttp.test_utils import TestClient, TestServer

    from gatekeeper.ledger import Ledger
    from gatekeeper.openfeature.ofrep import Ofrep
    from gatekeeper.openfeature.resolve import Resolver

    ws = rolled_ws(workspace, keys)
    with Ledger(f"sqlite:///{ws / 'ledger' / 'evidence.db'}") as ledger:
        ledger.add_shadow(FLAG, ledger.flag_states()[FLAG]["id"], "guard", {"stages": {}, "raised": {"step": 1, "share": 0.5}}, [])
    users = [f"user-{i}" for i in range(12)]

    async def go():
        with Resolver(ws) as resolver:
            async with TestClient(TestServer(Ofrep(resolver).app())) as client:
                single = {}
                for user in users * 2:  # each key twice: the same answer
                    r = await client.post(f"/ofrep/v1/evaluate/flags/{FLAG}", json={"context": {"targetingKey": user}})
                    body = await r.json()
                    assert r.status == 200 and body["reason"] == "SPLIT" and single.setdefault(user, body["value"]) == body["value"]
                bulk = {}
                for user in users[:4]:
                    r = await client.post("/ofrep/v1/evaluate/flags", json={"context": {"targetingKey": user}})
                    bulk[user] = next(f["value"] for f in (await r.json())["flags"] if f["key"] == FLAG)
                    again = await client.post("/ofrep/v1/evaluate/flags", json={"context": {"targetingKey": user}},
                                              headers={"If-None-Match": r.headers["ETag"]})
                    assert again.status == 304
                return single, bulk

    single, bulk = asyncio.run(go())
    assert single == {u: bucket(FLAG, u) < 0.5 for u in users} and len(set(single.values())) == 2
    assert bulk == {u: single[u] for u in users[:4]}
