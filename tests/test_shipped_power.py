"""The shipped battery can say no: on the default model (torch, float32, the shipped prefill plan) it
meets the shipped policy's own ``min_power``, and the planted faults it was mined against (``shift``,
``drop``) change the outputs of every case, as its provenance says."""

from __future__ import annotations

import shutil

import pytest
from conftest import ROOT

from gatekeeper.battery.suites import all_suites
from gatekeeper.engines.faults import parse
from gatekeeper.gate.power import calibrate, mine
from gatekeeper.gate.run import runs
from gatekeeper.gate.state import flags, pipeline
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


@pytest.fixture(scope="module")
def battery(shipped):
    """The shipped battery's plan on the default model, its engine loaded, and ONE flag-off run of its 20 cases: the
    reference that both the calibration and mining's fault probes below compare with (the same decode either command
    makes first; made once here, it saves two minutes of one core; the commands' own paths are tested on tiny models
    in test_calibrate.py and test_mine.py)."""
    ws = Workspace(shipped)
    plan = calibrate.plan(ws, "prefix_cache", "torch", None, None, force=pipeline.in_force(ws, None), evaluation=None,
                          ledger=None)
    models = runs.open_engines(plan)
    try:
        yield plan, models, calibrate.reference_run(plan, models)
    finally:
        runs.close_engines(models)


def test_the_shipped_battery_meets_its_own_min_power(battery):
    plan, models, reference = battery
    policy = plan.policy
    assert policy.min_power is not None
    # the faults the assertions read (the policy's min_power is judged on noise 1e-3); noise:0 runs first anyway
    result = calibrate.run(plan, models, reference, faults=[parse("noise:1e-3"), parse("other_prefix")]).to_dict()
    rows = {r["spec"]: r for r in result["faults"]}
    assert rows["noise:0"]["flagged"] == 0  # an exact copy flags nothing
    assert flags.power_problems(policy.min_power, "prefix_cache", 0, [{"result": result}]) == []
    assert rows["noise:0.001"]["share"] >= 0.75 and rows["other_prefix"]["share"] >= 0.75, rows


def test_every_shipped_case_catches_the_faults_it_was_mined_against(battery):
    plan, models, reference = battery
    suites = all_suites(plan.ws)
    probed = {f for s in suites.values() for f in (s.mined_on.faults if s.mined_on else [])}
    assert {"shift", "drop"} <= probed
    claimed = {f"{s.suite}/{c.id}": c.mined.catches for s in suites.values() for c in s.cases}
    assert all(set(c or []) >= {"shift", "drop"} for c in claimed.values()), claimed
    # Measured again as mining measures it: every case's outputs part under each fault, at the length the suite decodes.
    scored = [mine.Scored(mine.Candidate(i, i.case_id), [], []) for i in plan.items]
    mine.probe(models["on"], plan.ws, plan.configs["off"].render, scored, plan.items, [reference[i.case_id] for i in plan.items],
               [parse("shift"), parse("drop")], lambda label: None)
    caught = {s.candidate.source: set(s.catches()) for s in scored}
    assert caught.keys() == claimed.keys()
    assert all(c >= {"shift", "drop"} for c in caught.values()), caught


def test_the_demo_reads_no_note_about_the_shipped_battery():
    """``make demo`` evaluates the repository's own workspace with the ``auto`` profile: the shipped suites were
    mined on the engine it runs (the default model as ``make model`` prepares it), so its verdict carries no
    ``mined_elsewhere:`` advice to re-mine the project's own files."""
    from gatekeeper.gate import decide, planning

    ws = Workspace(ROOT)
    plan = planning.plan(ws, "prefix_cache", "auto", force=pipeline.in_force(ws, None))
    assert {i.suite.suite for i in plan.items if i.suite.mined_on} == {"router", "planner", "specialist", "synthesizer"}
    models = runs.open_engines(plan)
    try:
        assert decide._mined_elsewhere(plan, models["off"]) == []
    finally:
        runs.close_engines(models)
