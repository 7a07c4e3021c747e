"""Drift as evidence: a policy's ``max_drift`` bounds the top-2 logit drift a PASS may carry, and
calibration counts a planted fault as flagged by outputs or by drift (beyond the policy's bound, any
drift under ``require: bit_exact``, else beyond 10x the unfaulted run's), stopping each case of a
fault run at its first flag without changing what is flagged."""

from __future__ import annotations

import json

import pytest
from conftest import evaluate, profile

pytestmark = pytest.mark.slow


def policy(ws, extra: str) -> None:
    path = ws / "policies" / "prefix_cache.yaml"
    path.write_text(path.read_text() + extra)


def calibrate(run_cli, ws, *extra):
    code, out, _ = run_cli("--workspace", ws, "calibrate", *extra, "--operator", "cal", "--json")
    result = json.loads(out)
    assert code == 0, result
    return result


def rows(result):
    return {r["spec"]: r for r in result["faults"]}


def test_max_drift_refuses_a_drift_the_outputs_hide(run_cli, tiny_ws, tiny_llama):
    (tiny_ws / "engines" / "drifting.yaml").write_text(profile("fault_engines:Drifting", tiny_llama))
    policy(tiny_ws, "max_drift: 0.0001\n")
    code, out = evaluate(run_cli, tiny_ws, "drifting")
    assert code == 1 and out["verdict"] == "INCONCLUSIVE", out
    why = out["reasons"][0]
    assert why.startswith("drift: top-2 logits moved by 0.001 at tiny/") and "above the policy's max_drift 0.0001" in why
    assert out["reasons"][1].startswith("equal: all 4 cases identical")  # the outputs alone would have passed


def test_max_drift_passes_drift_within_it(run_cli, tiny_ws, tiny_llama):
    (tiny_ws / "engines" / "drifting.yaml").write_text(profile("fault_engines:Drifting", tiny_llama))
    policy(tiny_ws, "max_drift: 0.01\n")
    code, out = evaluate(run_cli, tiny_ws, "drifting")
    assert code == 0 and out["verdict"] == "PASS", out
    assert 0.001 <= out["strength"]["max_drift"] <= 0.0011
    # The unfaulted monolithic run: whatever its drift on this CPU (float32: a few ULPs, or none), it is within.
    code, out = evaluate(run_cli, tiny_ws, "tiny")
    assert code == 0 and out["verdict"] == "PASS", out
    assert out["strength"]["max_drift"] is not None and out["strength"]["max_drift"] <= 0.01


@pytest.mark.parametrize("body, field", [
    ("max_drift: 0\n", "max_drift"),
    ("require: bit_exact\nmax_drift: 0.1\n", "max_drift"),
])
def test_bad_drift_bounds_name_the_field(run_cli, tiny_ws, body, field):
    policy(tiny_ws, body)
    code, out, _ = run_cli("--workspace", tiny_ws, "evaluate", "--flag", "prefix_cache", "--engine", "tiny", "--json")
    assert code == 2 and "policies/prefix_cache.yaml" in json.loads(out)["error"] and field in json.loads(out)["error"]


def aligned(ws, model):
    (ws / "engines" / "aligned.yaml").write_text(profile("torch", model).replace("prefill: monolithic", "prefill: aligned"))


def test_bit_exact_calibration_flags_faint_noise_by_drift(run_cli, tiny_ws, tiny_llama):
    aligned(tiny_ws, tiny_llama)
    policy(tiny_ws, "require: bit_exact\n")
    result = calibrate(run_cli, tiny_ws, "--engine", "aligned")
    r = rows(result)
    assert result["drift_rule"]["kind"] == "bit_exact" and result["mode"] == "early"
    assert r["noise:0"]["flagged"] == 0  # the aligned plan is bit-exact: no false alarm
    assert r["noise:1e-07"]["share_drift"] == 1.0 and r["noise:1e-07"]["share"] == 1.0
    assert r["noise:1e-07"]["share_outputs"] < 1.0  # faint noise flips no answer here: outputs alone miss it
    assert r["noise:1e-07"]["stopped_early"] == 4


@pytest.mark.parametrize("extra", ["", "max_drift: 0.001\n"])
def test_early_stopping_flags_what_a_full_calibration_flags(run_cli, tiny_ws, extra):
    policy(tiny_ws, extra)
    early, full = calibrate(run_cli, tiny_ws, "--engine", "tiny"), calibrate(run_cli, tiny_ws, "--engine", "tiny", "--full")
    assert early["mode"] == "early" and full["mode"] == "full"
    e, f = rows(early), rows(full)
    assert e.keys() == f.keys()
    for spec in e:
        assert sorted(e[spec]["flagged_cases"]) == sorted(f[spec]["flagged_cases"]), spec
        assert e[spec]["by_drift"] == f[spec]["by_drift"] and e[spec]["by_outputs"] <= f[spec]["by_outputs"], spec
        assert f[spec]["stopped_early"] == 0
    assert sum(r["stopped_early"] for r in e.values()) > 0  # the big faults' cases stopped at their first flag
    assert e["noise:0"]["stopped_early"] == 0  # the unfaulted run is the drift baseline: decoded whole
