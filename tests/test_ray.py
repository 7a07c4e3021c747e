"""``executor: ray``: the cases on Ray actors give the evidence a run in this process gives, the gate still
says no, and a lost actor or an actor with another model is never a verdict."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import evaluate, ledger, profile, wait_for_case_results

from gatekeeper.identity import child_env

TESTS = Path(__file__).resolve().parent
RAY = "executor: ray\nray: {actors: 2}\n"


def test_the_cli_and_the_gate_do_not_import_ray():
    code = "import sys, gatekeeper.cli, gatekeeper.gate.evaluator; assert 'ray' not in sys.modules, 'ray imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("text, field", [
    ("adapter: http\nurl: http://127.0.0.1:9\nurl_on: http://127.0.0.1:10\nexecutor: ray\n", "executor"),
    ("adapter: torch\nray: {actors: 3}\n", "ray"),
    ("adapter: torch\nexecutor: ray\nray: {address: 'not an address'}\n", "ray.address"),
    ("adapter: torch\nexecutor: ray\nray: {actors: 0}\n", "ray.actors"),
])
def test_bad_executor_settings_are_exit_2_naming_file_and_field(run_cli, workspace, text, field):
    (workspace / "engines" / "bad.yaml").write_text(text)
    code, out, _ = run_cli("--workspace", workspace, "evaluate", "--flag", "prefix_cache", "--engine", "bad", "--json")
    error = json.loads(out)["error"]
    assert code == 2 and "engines/bad.yaml" in error and f"field '{field}'" in error, error
    assert not (workspace / "ledger" / "evidence.db").exists()


def test_shards_keep_a_stage_together_and_even():
    from gatekeeper.gate.run.ray_executor import shards

    assert shards(4, 2) == [range(0, 2), range(2, 4)]
    assert shards(5, 3) == [range(0, 2), range(2, 4), range(4, 5)]
    assert shards(1, 2) == [range(0, 1), range(1, 1)]


@pytest.mark.slow
def test_sigterm_aborts_and_takes_the_actors_and_the_local_cluster_down(tiny_ws, tiny_llama):
    """The profile's null address: the evaluation starts a local cluster in its own process."""
    pytest.importorskip("ray")
    (tiny_ws / "engines" / "tiny_ray.yaml").write_text(profile("torch", tiny_llama) + RAY)
    env = child_env(PYTHONPATH=f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.Popen([sys.executable, "-m", "gatekeeper.cli", "--workspace", str(tiny_ws), "evaluate", "--flag",
                             "prefix_cache", "--engine", "tiny_ray", "--json"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        eid = wait_for_case_results(tiny_ws, 2, timeout=180)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
    finally:
        proc.kill()
    assert code == 130, proc.stderr.read().decode()  # as without Ray: Ray's own SIGTERM handler is not left in
    with ledger(tiny_ws) as lg:
        record = lg.evaluation(eid)
        assert record["status"] == "aborted" and record["verdict"] is None
        assert record["aborted_record"]["reason"].startswith("KeyboardInterrupt")
        assert record["config"]["executor"]["actors"] == 2
        assert lg.verify().ok
    deadline = time.time() + 30
    while _ray_processes(proc.pid) and time.time() < deadline:
        time.sleep(0.5)
    assert not _ray_processes(proc.pid)


@pytest.fixture(scope="module")
def cluster():
    """One local cluster for this module's in-process evaluations; each evaluation starts and stops its actors."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    yield
    ray.shutdown()


@pytest.mark.slow
def test_two_actors_give_the_verdict_and_results_of_one_process(run_cli, tiny_ws, tiny_llama, cluster):
    (tiny_ws / "engines" / "tiny_ray.yaml").write_text(profile("torch", tiny_llama) + RAY)
    here = evaluate(run_cli, tiny_ws, "tiny")[1]
    code, out = evaluate(run_cli, tiny_ws, "tiny_ray")
    assert (code, out["verdict"]) == (0, here["verdict"]) == (0, "PASS"), out["reasons"]
    assert out["cases"] == 4 and out["tokens"]["cached_on"] >= out["tokens"]["stable_prefix_bound"] > 0
    with ledger(tiny_ws) as lg:
        local, actors = lg.evaluation(here["evaluation_id"]), lg.evaluation(out["evaluation_id"])
        assert lg.verify().ok
    # the executor moves the model, not what it computes: the same identity, and the config says how it ran
    assert actors["identity"] == local["identity"]
    assert actors["config"]["executor"]["actors"] == 2 and "executor" not in local["config"]
    assert _outputs(actors) == _outputs(local) and len(_outputs(local)) == 4 * 3
    # cases c and loop ran on the second actor, whose session never saw a or b: c reuses only the pinned prefix
    cached = {r: {x["case_id"]: x["result"]["turns"][0]["cached_tokens"] for x in r_["case_results"] if x["config"] == "on"}
              for r, r_ in (("local", local), ("actors", actors))}
    assert cached["actors"]["tiny/a"] == cached["local"]["tiny/a"] and cached["actors"]["tiny/c"] < cached["local"]["tiny/c"]


@pytest.mark.slow
def test_a_planted_fault_fails_on_ray_too(run_cli, tiny_ws, tiny_llama, cluster):
    (tiny_ws / "engines" / "short_ray.yaml").write_text(profile("fault_engines:ShortRestore", tiny_llama) + RAY)
    code, out = evaluate(run_cli, tiny_ws, "short_ray")
    assert code == 1 and out["verdict"] == "FAIL" and out["differing_cases"], out["reasons"]
    assert all(any(r.startswith(f"differs: {cid} ") for r in out["reasons"]) for cid in out["differing_cases"])


@pytest.mark.slow
def test_a_lost_actor_aborts_the_evaluation_and_the_ledger_verifies(run_cli, tiny_ws, tiny_llama, cluster):
    # the actor holding cases a and b dies on the flag-on run's call for b ("... to Porto")
    (tiny_ws / "engines" / "dies.yaml").write_text(
        profile("fault_engines:OnRayActors", tiny_llama) + "options: {die_at: Porto}\n" + RAY)
    code, out, _ = run_cli("--workspace", tiny_ws, "evaluate", "--flag", "prefix_cache", "--engine", "dies", "--json")
    error = json.loads(out)["error"]
    assert code not in (0, 1) and "Ray actor 0 of 2" in error and "was lost in run on#0" in error, error
    with ledger(tiny_ws) as lg:
        [summary] = lg.evaluations()
        record = lg.evaluation(summary["id"])
    assert record["status"] == "aborted" and record["verdict"] is None and "was lost" in record["aborted_record"]["reason"]
    assert len([r for r in record["case_results"] if r["config"] == "off"]) == 8
    assert len([r for r in record["case_results"] if r["config"] == "on"]) < 4
    assert run_cli("--workspace", tiny_ws, "ledger", "verify")[0] == 0


@pytest.mark.slow
@pytest.mark.parametrize("elsewhere", ["other weights", "no weights"])
def test_an_actor_with_other_weights_is_refused_before_anything_is_written(run_cli, tiny_ws, tiny_llama, tmp_path,
                                                                           cluster, elsewhere):
    from tiny_models import build_tiny_llama

    other = build_tiny_llama(tmp_path / "other", seed=1) if elsewhere == "other weights" else tmp_path / "missing"
    (tiny_ws / "engines" / "elsewhere.yaml").write_text(
        profile("fault_engines:OnRayActors", tiny_llama) + f"options: {{actor_model: '{other}'}}\n" + RAY)
    code, out, _ = run_cli("--workspace", tiny_ws, "evaluate", "--flag", "prefix_cache", "--engine", "elsewhere", "--json")
    error = json.loads(out)["error"]
    assert code == 2 and "engines/elsewhere.yaml" in error, error
    if elsewhere == "other weights":
        assert "field 'executor'" in error and "model_digest" in error, error
        assert "Ray actor 0 of 2 (node " in error and "Ray actor 1 of 2 (node " in error
    else:
        assert "could not load the models" in error and "missing" in error, error
    with ledger(tiny_ws) as lg:
        assert lg.evaluations() == []


def _outputs(record: dict) -> dict:
    """What a case said, per run: token ids and text of every turn, and the assertion outcomes."""
    return {(r["case_id"], r["config"], r["repeat"]): ([(t["tokens"], t["text"]) for t in r["result"]["turns"]],
                                                      r["result"]["outcomes"])
            for r in record["case_results"]}


def _ray_processes(driver_pid: int) -> list[str]:
    """Ray's processes of the cluster ``driver_pid`` started (its session folder names the pid), and any actor."""
    out = []
    for proc in Path("/proc").iterdir():
        try:
            args = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if f"_{driver_pid}/" in args or args.startswith("ray::Worker"):
            out.append(args[:120])
    return out
