"""The shipped battery can say no: on the default model (torch, float32, the shipped prefill plan) it
meets the shipped policy's own ``min_power``, and the planted faults it was mined against (``shift``,
``drop``) change the outputs of every case, as its provenance says."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import ROOT

from gatekeeper.battery.suites import all_suites
from gatekeeper.gate import flags
from gatekeeper.workspace import Workspace

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    """The repository's workspace, copied, on the CPU in float32 (what the shipped curve was measured on)."""
    ws = tmp_path_factory.mktemp("shipped")
    for folder in ("engines", "assertions", "prompts", "policies"):
        shutil.copytree(ROOT / folder, ws / folder, ignore=shutil.ignore_patterns("examples"))
    profile = ws / "engines" / "torch.yaml"
    profile.write_text(profile.read_text().replace("dtype: auto", "dtype: float32").replace("device: auto", "device: cpu"))
    return ws


def cli(run_cli, ws, *args):
    code, out, _ = run_cli("--workspace", ws, *args, "--json")
    result = json.loads(out)
    assert code == 0, result
    return result


def test_the_shipped_battery_meets_its_own_min_power(run_cli, shipped):
    policy = Workspace(shipped).policy("prefix_cache")
    assert policy.min_power is not None
    # the faults the assertions read (the policy's min_power is judged on noise 1e-3); noise:0 runs first anyway
    result = cli(run_cli, shipped, "calibrate", "--flag", "prefix_cache", "--engine", "torch", "--operator", "ci",
                 "--faults", "noise:1e-3,other_prefix")
    rows = {r["spec"]: r for r in result["faults"]}
    assert rows["noise:0"]["flagged"] == 0  # an exact copy flags nothing
    assert flags.power_problems(policy.min_power, "prefix_cache", 0, [{"result": result}]) == []
    assert rows["noise:0.001"]["share"] >= 0.75 and rows["other_prefix"]["share"] >= 0.75, rows


def test_every_shipped_case_catches_the_faults_it_was_mined_against(run_cli, shipped, tmp_path):
    suites = all_suites(Workspace(shipped))
    probed = {f for s in suites.values() for f in (s.mined_on.faults if s.mined_on else [])}
    assert {"shift", "drop"} <= probed
    claimed = {f"{s.suite}/{c.id}": c.mined.catches for s in suites.values() for c in s.cases}
    assert all(set(c or []) >= {"shift", "drop"} for c in claimed.values()), claimed
    # Measured again: every case's outputs part under each fault, at the length the suite decodes.
    report = cli(run_cli, shipped, "battery", "mine", "--engine", "torch", "--cases", str(len(claimed)),
                 "--faults", "shift,drop", "--out", tmp_path / "again")
    caught = {f"{name}/{c['id']}": set(c["catches"]) for name, st in report["suites"].items() for c in st["cases"]}
    assert caught.keys() == claimed.keys()
    assert all(c >= {"shift", "drop"} for c in caught.values()), caught


def test_the_demo_reads_no_note_about_the_shipped_battery():
    """``make demo`` evaluates the repository's own workspace with the ``auto`` profile: the shipped suites were
    mined on the engine it runs (the default model as ``make model`` prepares it), so its verdict carries no
    ``mined_elsewhere:`` advice to re-mine the project's own files."""
    from gatekeeper.gate import evaluator, pipeline, runs

    ws = Workspace(ROOT)
    plan = evaluator.plan(ws, "prefix_cache", "auto", force=pipeline.in_force(ws, None))
    assert {i.suite.suite for i in plan.items if i.suite.mined_on} == {"router", "planner", "specialist", "synthesizer"}
    models = runs.open_engines(plan)
    try:
        assert evaluator._mined_elsewhere(plan, models["off"]) == []
    finally:
        runs.close_engines(models)
