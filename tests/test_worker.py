"""An engine under another Python environment (a profile's ``python``): the adapter runs in a worker process, behind
the same model and session contract. A second environment here is a virtual environment of the same base
interpreter that sees this one's packages (a .pth file): another interpreter, the same versions, so its verdict and
records must be the in-process ones."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import venv
from pathlib import Path

import pytest
from conftest import evaluate, ledger, profile, wide_suite

from gatekeeper.identity import child_env


@pytest.fixture(scope="session")
def second_python(tmp_path_factory) -> str:
    import site

    root = tmp_path_factory.mktemp("env2") / "venv"
    venv.EnvBuilder(with_pip=False).create(root)
    (next((root / "lib").glob("python*/site-packages")) / "parent.pth").write_text(site.getsitepackages()[0] + "\n")
    return str(root / "bin" / "python")


@pytest.fixture
def worker_ws(tiny_ws, tiny_llama, second_python):
    for name, adapter in (("worker", "torch"), ("worker_mlx", "mlx")):
        (tiny_ws / "engines" / f"{name}.yaml").write_text(profile(adapter, tiny_llama) + f"python: {second_python}\n")
    return tiny_ws


def runs(ws: Path, evaluation_id: int) -> dict:
    with ledger(ws) as lg:
        record = lg.evaluation(evaluation_id)
    return {(r["case_id"], r["config"], r["repeat"]): [(t["tokens"], t["text"], t["top2"], t["cached_tokens"])
                                                      for t in r["result"]["turns"]] for r in record["case_results"]}


@pytest.mark.parametrize("in_process, worker", [("tiny", "worker"), ("tiny_mlx", "worker_mlx")])
def test_a_worker_engine_gives_the_in_process_verdict_and_records(worker_ws, run_cli, second_python, in_process, worker):
    code, here = evaluate(run_cli, worker_ws, in_process)
    code_w, there = evaluate(run_cli, worker_ws, worker)
    assert (code, here["verdict"]) == (code_w, there["verdict"]) == (0, "PASS")
    assert runs(worker_ws, there["evaluation_id"]) == runs(worker_ws, here["evaluation_id"])  # tokens, logits, cache
    with ledger(worker_ws) as lg:
        a, b = (lg.evaluation(e)["identity"]["off"]["engine"] for e in (here["evaluation_id"], there["evaluation_id"]))
    assert b.pop("python") == {"executable": second_python, "version": sys.version.split()[0]}
    assert a == b  # the same packages: the same engine identity, besides the interpreter


@pytest.mark.slow  # four evaluations, two of them on mlx's CPU backend
def test_sampled_draws_cross_the_process(worker_ws, run_cli):
    """A sampled suite's draws go to the worker with their keys: the worker samples what the process samples, for
    torch and mlx alike (their records, draws and all, are the in-process ones)."""
    suite = worker_ws / "assertions" / "tiny.yaml"
    suite.write_text(suite.read_text().replace("decoding: {max_tokens: 12}",
                                               "decoding: {max_tokens: 12, temperature: 0.8, top_k: 40}"))
    draws = {}
    for engine in ("tiny", "worker", "tiny_mlx", "worker_mlx"):
        code, out = evaluate(run_cli, worker_ws, engine, "--limit", "2")
        assert out["verdict"] == "PASS" and out["sampling"]["steps"] > 0, out["reasons"]
        with ledger(worker_ws) as lg:
            draws[engine] = {(r["case_id"], r["config"], r["repeat"]): [t["tokens"] for t in r["result"]["turns"]]
                             for r in lg.evaluation(out["evaluation_id"])["case_results"]}
    assert draws["worker"] == draws["tiny"] and draws["worker_mlx"] == draws["tiny_mlx"]


def test_faults_and_early_stopping_cross_the_process(worker_ws, run_cli):
    """A calibration plants its faults in the worker and stops each flagged case early through it: the shares it
    finds are the in-process ones."""
    shares = {}
    for engine in ("tiny", "worker"):
        code, out, _ = run_cli("--workspace", worker_ws, "calibrate", "--flag", "prefix_cache", "--engine", engine,
                               "--operator", "ci", "--json")
        assert code == 0, out
        shares[engine] = [(f["spec"], f["flagged"], f["share"]) for f in json.loads(out)["faults"]]
    assert shares["worker"] == shares["tiny"] and any(flagged for _, flagged, _ in shares["tiny"])


def test_an_upgrade_is_a_declared_change_of_the_profiles_python(worker_ws, run_cli, second_python):
    (worker_ws / "policies" / "upgrade.yaml").write_text(
        f"flag: upgrade\ngate: byte_equivalence\nchange: {{profile: {{python: {second_python}}}}}\n")
    code, out, _ = run_cli("--workspace", worker_ws, "evaluate", "--flag", "upgrade", "--engine", "tiny", "--json")
    out = json.loads(out)
    assert code == 0 and out["verdict"] == "PASS", out
    with ledger(worker_ws) as lg:
        identity = lg.evaluation(out["evaluation_id"])["identity"]
    assert "python" not in identity["off"]["engine"] and identity["on"]["engine"]["python"]["executable"] == second_python
    assert identity["on"]["profile"]["python"] == second_python


def test_a_profile_naming_a_missing_interpreter_is_exit_2_and_writes_nothing(tiny_ws, tiny_llama, run_cli):
    (tiny_ws / "engines" / "gone.yaml").write_text(profile("torch", tiny_llama) + "python: /nonexistent/bin/python\n")
    code, out = evaluate(run_cli, tiny_ws, "gone")
    assert code == 2 and "field 'python'" in out["error"] and "runtime prepare" in out["error"], out
    assert not (tiny_ws / "ledger" / "evidence.db").exists()
    (tiny_ws / "engines" / "served.yaml").write_text("adapter: http\nurl: http://127.0.0.1:9\npython: python3\n")
    code, out = evaluate(run_cli, tiny_ws, "served")
    assert code == 2 and "python" in out["error"] and "in-process adapter" in out["error"], out


def children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_a_worker_killed_mid_run_aborts_the_evaluation_and_the_ledger_verifies(worker_ws):
    wide_suite(worker_ws, 40)
    proc = subprocess.Popen([sys.executable, "-m", "gatekeeper.cli", "--workspace", str(worker_ws), "evaluate", "--flag",
                             "prefix_cache", "--engine", "worker", "--json"], stdout=subprocess.PIPE, text=True,
                            env=child_env(PYTHONPATH=str(Path(__file__).parent)))
    try:
        deadline = time.monotonic() + 120
        while not (worker_ws / "ledger" / "evidence.db").exists() or not _results(worker_ws):
            assert time.monotonic() < deadline and proc.poll() is None, "the evaluation never got going"
            time.sleep(0.2)
        (worker,) = children(proc.pid)
        os.kill(worker, signal.SIGKILL)
        out = json.loads(proc.communicate(timeout=120)[0])
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 2 and "worker" in out["error"] and "died" in out["error"], out
    with ledger(worker_ws) as lg:
        (evaluation,) = lg.evaluations()
        assert evaluation["status"] == "aborted" and lg.verify().ok
        assert "died" in lg.evaluation(evaluation["id"])["aborted_record"]["reason"]


def _results(ws: Path) -> int:
    with ledger(ws) as lg:
        evaluations = lg.evaluations()
        return evaluations[0]["case_results"] if evaluations else 0


def test_runtime_prepare_refuses_bad_input_and_an_environment_that_cannot_run_the_worker(run_cli, tmp_path, monkeypatch):
    from gatekeeper.errors import GatekeeperError
    from gatekeeper.setup import runtimes

    monkeypatch.setenv("GATEKEEPER_HOME", str(tmp_path))
    code, out, _ = run_cli("runtime", "prepare", "bad/name", "transformers==5.0.0", "--json")
    assert code == 2 and "NAME" in json.loads(out)["error"]
    code, out, _ = run_cli("runtime", "prepare", "empty", "--json")
    assert code == 2
    with pytest.raises(GatekeeperError, match="cannot run gatekeeper's worker"):
        # an environment with no packages (the base interpreter may have some installed): no pydantic, no worker
        venv.create(tmp_path / "bare", with_pip=False)
        runtimes.prove(str(tmp_path / "bare" / "bin" / "python"))


