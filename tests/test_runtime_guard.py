"""The guard in process (issue #61): ``Runtime(ws, guard=FLAG)`` replays a share of its calls under the flag-off
configuration on a background worker, with the proxy's batches, rule and signed rollback."""

from __future__ import annotations

import json
import threading

import pytest
from test_guard import guarded_ws, lg, wait
from trust import keys  # noqa: F401

from gatekeeper.errors import GatekeeperError
from gatekeeper.runtime import Runtime

GUARD = {"rate": 1, "limit": 0, "alpha": 0.05, "min_comparisons": 4, "batch": 2, "flush_s": 0.2, "timeout_s": 60,
         "in_flight": 64, "aa_rate": 0}
CALLS = [{"session": f"user={u}", "query": q} for u in ("ana", "ben", "cy") for q in
         ("What is 2+2?", "Book the flight.", "Cancel my order.", "Where is my parcel?")]


def runtime(ws, keys, engine: str) -> Runtime:  # noqa: F811
    return Runtime(ws, engine=engine, response_cache=False, guard="prefix_cache", sign=keys["ci"])


def test_a_planted_stale_state_in_process_is_rolled_back_and_the_flag_off_pipeline_answers_after(tiny_ws, keys):  # noqa: F811
    """ShortRestore restores the pinned prefix one position short (tests/fault_engines.py): with the flag on every call
    reads a stale state, the flag-off replay reads none. The guard rolls back, signed by the service key, and the
    next call is answered by the flag-off pipeline."""
    ws = guarded_ws(tiny_ws, keys, GUARD)
    with runtime(ws, keys, "short") as rt, Runtime(ws, engine="short", response_cache=False,
                                                  flags={"prefix_cache": "off"}) as off:
        assert rt.session.cache and rt.guard is not None
        parted = [c for c in CALLS if rt.complete("tiny", c).text != off.complete("tiny", c).text]
        assert len(parted) >= 2, "the planted fault must move answers on these calls"
        wait(lambda: rt.guard.guarded.rollback, within=120, what="rollback")
        after = rt.complete("tiny", parted[0])
        assert after.text == off.complete("tiny", parted[0]).text and not after.from_response_cache
        assert after.pipeline_hash == off.pipeline_hash  # the flag-off pipeline answered it
        metrics = rt.guard.metrics()
    flips = lg(ws).flips("prefix_cache")
    assert [f["state"] for f in flips] == ["on", "off"] and flips[-1]["reason"].startswith("guard rollback")
    state = lg(ws).flag_states()["prefix_cache"]
    assert state["state"] == "off" and state["operator"] == "guard" and state["signer"] == "guard", state
    batches = lg(ws).shadows("prefix_cache")
    assert sum(r["mismatches"] for b in batches for r in b["summary"]["stages"].values()) >= 1
    assert 'gatekeeper_guard_flag_on{flag="prefix_cache"} 0' in metrics


def test_a_healthy_cache_in_process_is_compared_and_kept_on(tiny_ws, keys):  # noqa: F811
    """Every call compared; the calls whose values are one-turn cases of the tiny suite are graded by their
    assertions on both answers too (traffic/live/judge.py), and lose no pass."""
    ws = guarded_ws(tiny_ws, keys, {**GUARD, "assertion_limit": 0})
    cases = [{"session": "user=ana", "query": "What is 2+2?"}, {"session": "user=ben", "query": "Book the cheapest flight to Porto."},
             {"session": "user=cat", "query": "Summarise the meeting notes."}]
    with runtime(ws, keys, "tiny") as rt:
        for c in CALLS + cases:
            rt.complete("tiny", c)
        wait(lambda: rt.guard.guarded.totals["compared"] == len(CALLS) + 3, within=120, what="comparison of every call")
        assert rt.guard.guarded.totals["mismatches"] == 0 and rt.guard.guarded.on
        # four calls are one-turn cases: the three above and the first of CALLS (case a)
        assert (rt.guard.guarded.totals["judged_graded"], rt.guard.guarded.totals["judged_lost"]) == (4, 0)
    assert lg(ws).flag_states()["prefix_cache"]["state"] == "on"
    batches = lg(ws).shadows("prefix_cache")
    assert sum(r["compared"] for b in batches for r in b["summary"]["stages"].values()) == len(CALLS) + 3
    assert sum(b["summary"].get("judged", {}).get("graded", 0) for b in batches) == 4


def test_the_caller_never_waits_on_a_replay(tiny_ws, keys):  # noqa: F811
    """Replays run on the guard's worker: with the flag-off side held, every call still returns, and the replays queued
    behind it run (on the worker's thread, never the caller's) once it is let go."""
    ws = guarded_ws(tiny_ws, keys, GUARD)
    held, threads = threading.Event(), set()
    with runtime(ws, keys, "tiny") as rt:
        replay = rt.guard.off

        def slow_off(*args):
            threads.add(threading.current_thread().name)
            held.wait(60)
            return replay(*args)

        rt.guard.off = slow_off
        for c in CALLS[:4]:
            rt.complete("tiny", c)  # returns although no replay can finish
        assert rt.guard.guarded.totals["compared"] == 0 and rt.guard.guarded.in_flight == 4
        held.set()
        wait(lambda: rt.guard.guarded.totals["compared"] == 4, within=120, what="the held replays")
    assert threads == {"gatekeeper-guard-replay"}


def test_a_failing_flag_on_call_is_raised_to_the_caller_and_counted_as_a_parting(tiny_ws, keys):  # noqa: F811
    ws = guarded_ws(tiny_ws, keys, GUARD)
    with runtime(ws, keys, "tiny") as rt:
        def broken(*args, **kwargs):
            raise RuntimeError("engine lost")

        rt.session.generate = broken
        with pytest.raises(RuntimeError, match="engine lost"):
            rt.complete("tiny", CALLS[0])
        wait(lambda: rt.guard.guarded.totals["flag_on_failed"] == 1, within=120, what="the failed call's parting")
        assert rt.guard.guarded.totals["failed"] == 1
    kept = [m for b in lg(ws).shadows("prefix_cache") for m in b["items"]]
    assert kept and kept[0]["reason"] == "flag_on_failed" and "engine lost" in kept[0]["error"], kept


def test_the_runtime_guard_refuses_without_a_key_or_with_the_flag_off(tiny_ws, keys, monkeypatch):  # noqa: F811
    monkeypatch.delenv("GATEKEEPER_SIGNING_KEY", raising=False)
    ws = guarded_ws(tiny_ws, keys, GUARD, on=False)
    with pytest.raises(GatekeeperError, match="needs a service key"):
        Runtime(ws, engine="tiny", guard="prefix_cache")
    with pytest.raises(GatekeeperError, match="prefix_cache is off"):
        Runtime(ws, engine="tiny", guard="prefix_cache", sign=keys["ci"])
    assert json.dumps(lg(ws).shadows("prefix_cache")) == "[]"


def test_a_rollout_in_process_serves_the_flag_on_pipeline_to_its_share_of_keys(tiny_ws, keys):  # noqa: F811
    from gatekeeper.gate.state.rollout import bucket

    ws = guarded_ws(tiny_ws, keys, GUARD)
    policy = ws / "policies" / "prefix_cache.yaml"
    policy.write_text(policy.read_text() + 'rollout: {"steps": [0.5, 1.0], "min_comparisons_per_step": 1000}\n')
    with runtime(ws, keys, "tiny") as rt:
        hashes = {c["session"]: rt.complete("tiny", c, key=c["session"]).pipeline_hash for c in CALLS[::4]}
        assert {k: h == rt.pipeline_hash for k, h in hashes.items()} == {k: bucket("prefix_cache", k) < 0.5 for k in hashes}
        wait(lambda: rt.guard.guarded.in_flight == 0, within=120, what="the replays")
        assert rt.guard.guarded.totals["compared"] == sum(bucket("prefix_cache", k) < 0.5 for k in hashes)
