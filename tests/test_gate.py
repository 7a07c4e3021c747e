"""The gate end to end through the real CLI: it says PASS only when it should, and no otherwise."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import evaluate, ledger, profile, read_reference, wait_for_case_results, wide_suite

from gatekeeper.identity import child_env

TESTS = Path(__file__).resolve().parent


@pytest.mark.parametrize("engine", ["tiny", "tiny_mlx"])
def test_pass_on_tiny_model(run_cli, tiny_ws, engine):
    code, out = evaluate(run_cli, tiny_ws, engine)
    assert (code, out["verdict"]) == (0, "PASS"), out["reasons"]
    assert out["cases"] == 4 and out["assertions"] == 4 and out["differing_cases"] == []
    assert out["tokens"]["cached_on"] >= out["tokens"]["stable_prefix_bound"] > 0
    assert out["tokens"]["computed_on"] < out["tokens"]["prompt_off"]
    assert out["cacheable_share"]["partitioned"] > out["cacheable_share"]["as_written"]
    assert out["distance"] is None  # the fixture's policy says distance: false (below, the default reads it)
    assert out["strength"]["flips"] == {"pairs": 4, "harmful": 0, "beneficial": 0}  # figures beside the drift
    with ledger(tiny_ws) as lg:
        record = lg.evaluation(out["evaluation_id"])
        assert record["status"] == "PASS"
        assert len(record["case_results"]) == 4 * 3  # two flag-off runs and one flag-on run
        assert {c["detail"]["pair"] for c in record["comparisons"]} == {"off#0~off#1", "off#0~on#0"}
        assert record["identity"]["off"]["flags"] == {"prefix_cache": "off"}
        assert record["identity"]["on"]["engine"]["model_digest"]
        assert lg.verify().ok


def test_byte_equivalence_reads_the_distance_by_default_and_off_beside_a_bound_is_an_input_error(run_cli, tiny_ws):
    policy = tiny_ws / "policies" / "prefix_cache.yaml"
    written = policy.read_text().replace("distance: false\n", "")
    policy.write_text(written)
    code, out = evaluate(run_cli, tiny_ws, "tiny")
    assert (code, out["verdict"]) == (0, "PASS") and out["distance"]["distance"]["same_top1"] == 1, out
    assert out["distance"]["floor"]["kld"]["max"] == 0 and any(r.startswith("kld: mean") for r in out["reasons"])
    policy.write_text(written + "distance: false\nmax_kld: 0.01\n")
    code, out, _ = run_cli("--workspace", tiny_ws, "evaluate", "--flag", "prefix_cache", "--engine", "tiny", "--json")
    error = json.loads(out)["error"]
    assert code == 2 and "prefix_cache.yaml" in error and "max_kld" in error and "remove one" in error


def test_chained_turns_hit_the_previous_turn(run_cli, tiny_ws):
    code, out = evaluate(run_cli, tiny_ws, "tiny", "--suite", "tiny")
    with ledger(tiny_ws) as lg:
        results = lg.evaluation(out["evaluation_id"])["case_results"]
    loop_on = next(r for r in results if r["case_id"] == "tiny/loop" and r["config"] == "on")
    turns = loop_on["result"]["turns"]
    assert len(turns) == 3
    for turn in turns[1:]:  # a later turn recomputes only what the transcript added
        assert turn["cached_tokens"] > turns[0]["prompt_tokens"] - 2


def test_shifted_cache_fails_naming_the_cases(run_cli, tiny_ws):
    code, out = evaluate(run_cli, tiny_ws, "short")
    assert code == 1 and out["verdict"] == "FAIL"
    assert out["differing_cases"], out
    for cid in out["differing_cases"]:
        assert any(r.startswith(f"differs: {cid} ") for r in out["reasons"])
    with ledger(tiny_ws) as lg:
        record = lg.evaluation(out["evaluation_id"])
    bad = [c for c in record["comparisons"] if not c["equal"]]
    assert {c["case_id"] for c in bad} == set(out["differing_cases"])
    d = bad[0]["detail"]
    assert d["pair"] == "off#0~on#0" and d["first_divergent_position"] >= 0
    assert d["a"]["token"] != d["b"]["token"] and isinstance(d["a"]["margin"], float)
    assert isinstance(d["near_tie"], bool)
    # the assertion flips beside the drift, recounted from the raw outcomes of off#0 and on#0
    runs = {(r["config"], r["repeat"]): {} for r in record["case_results"]}
    for r in record["case_results"]:
        runs[(r["config"], r["repeat"])][r["case_id"]] = [o["pass"] for o in r["result"]["outcomes"]]
    pairs = [(x, y) for cid, off in runs[("off", 0)].items() for x, y in zip(off, runs[("on", 0)][cid])]
    assert out["strength"]["flips"] == {"pairs": len(pairs), "harmful": sum(x and not y for x, y in pairs),
                                        "beneficial": sum(y and not x for x, y in pairs)}


def test_cache_never_serving_is_inconclusive(run_cli, tiny_ws):
    code, out = evaluate(run_cli, tiny_ws, "never")
    assert code == 1 and out["verdict"] == "INCONCLUSIVE"
    assert out["reasons"][0].startswith("not_exercised:") and out["tokens"]["cached_on"] == 0


def test_a_cache_that_reports_nothing_is_not_observable_never_a_pass_on_zero(run_cli, tiny_ws):
    code, out = evaluate(run_cli, tiny_ws, "uncounted", "--limit", "2")
    assert code == 1 and out["verdict"] == "INCONCLUSIVE", out["reasons"]
    assert out["reasons"][0].startswith("not_observable:") and "accept_unobservable" in out["reasons"][0]
    assert out["tokens"]["cached_on"] is None and out["exercised_share"] == 0
    assert all(row["cached_tokens"] is None for side in out["telemetry"].values() for row in side.values())


def test_a_flag_off_side_served_from_a_cache_is_no_baseline(run_cli, tiny_ws):
    code, out = evaluate(run_cli, tiny_ws, "warm_off", "--limit", "2")
    assert code == 1 and out["verdict"] == "INCONCLUSIVE", out["reasons"]
    assert out["reasons"][0].startswith("baseline_cached:") and "engines/warm_off.yaml" in out["reasons"][0]


@pytest.mark.parametrize("floor, verdict", [(0.9, "INCONCLUSIVE"), (0.4, "PASS")])
def test_exercise_floor_from_policy(run_cli, tiny_ws, floor, verdict):
    policy = tiny_ws / "policies" / "prefix_cache.yaml"
    policy.write_text(policy.read_text().replace("min_cached_share: 0.5", f"min_cached_share: {floor}"))
    code, out = evaluate(run_cli, tiny_ws, "half", "--limit", "3")
    assert out["verdict"] == verdict, out["reasons"]
    assert 0.4 < out["exercised_share"] < 0.6
    if verdict == "INCONCLUSIVE":
        assert out["reasons"][0].startswith("not_exercised:") and f"< floor {floor}" in out["reasons"][0]


def test_unstable_baseline_is_inconclusive(run_cli, tiny_ws):
    read_reference(tiny_ws)
    code, out = evaluate(run_cli, tiny_ws, "unstable")
    assert code == 1 and out["verdict"] == "INCONCLUSIVE"
    assert out["reasons"][-1].startswith("reference: both arms agree")  # the arms' first runs agree with the reference
    out["reasons"].pop()
    assert all(r.startswith("baseline_unstable:") for r in out["reasons"]) and len(out["reasons"]) == 4
    # each names where the runs part and the likeliest cause it can see (an in-process engine: no server state)
    assert all("(off#0 vs off#1: turn " in r and "first divergent token at position" in r and "likeliest cause: " in r
               and "server state: the flag-off server served" not in r for r in out["reasons"]), out["reasons"]


def test_cases_run_side_by_side_up_to_the_engine_concurrency(run_cli, tiny_ws, tiny_llama):
    from fault_engines import Threaded

    (tiny_ws / "engines" / "threaded.yaml").write_text(profile("fault_engines:Threaded", tiny_llama))
    sequential = evaluate(run_cli, tiny_ws, "tiny")[1]
    code, out = evaluate(run_cli, tiny_ws, "threaded")
    assert code == 0 and out["verdict"] == "PASS" and Threaded.peak >= 2
    with ledger(tiny_ws) as lg:
        ev, before = lg.evaluation(out["evaluation_id"]), lg.evaluation(sequential["evaluation_id"])
        assert ev["config"]["concurrency"] == {"off": 3, "on": 3} and before["config"]["concurrency"] == {"off": 1, "on": 1}
        # recorded in battery order, and the same answers as one case at a time
        assert [r["case_id"] for r in ev["case_results"]] == [r["case_id"] for r in before["case_results"]]
        assert [r["result"]["text"] for r in ev["case_results"]] == [r["result"]["text"] for r in before["case_results"]]


def _start_evaluation(ws: Path, engine: str) -> subprocess.Popen:
    env = child_env(PYTHONPATH=f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return subprocess.Popen(
        [sys.executable, "-m", "gatekeeper.cli", "--workspace", str(ws), "evaluate", "--flag", "prefix_cache",
         "--engine", engine, "--json"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        # a child of a background job inherits SIGINT ignored, and Python keeps it so: restore the default
        preexec_fn=_default_sigint,
    )


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT, signal.SIGTERM])
def test_interrupted_run_is_aborted_never_a_verdict(tiny_ws, sig):
    wide_suite(tiny_ws, 40)  # far more cases than the two it waits for: the signal lands while the run goes on
    proc = _start_evaluation(tiny_ws, "tiny")
    try:
        eid = wait_for_case_results(tiny_ws, 2)
        proc.send_signal(sig)
        code = proc.wait(timeout=60)
    finally:
        proc.kill()
    assert code != 0
    with ledger(tiny_ws) as lg:
        record = lg.evaluation(eid)
        assert record["status"] == "aborted" and record["verdict"] is None
        assert lg.verify().ok
        if sig != signal.SIGKILL:  # a catchable signal leaves an explicit abort record
            assert record["aborted_record"] is not None
