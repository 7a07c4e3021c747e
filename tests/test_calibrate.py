"""Calibration: planted faults of graded size in the flag-on run, the share of cases the gate flags,
recorded in the ledger; a policy's ``min_power`` refuses a flip on evidence without that power."""

import json

import pytest
from conftest import SUITE, evaluate, ledger

from gatekeeper.engines.greedy import FaultSession
from gatekeeper.gate.state import flags
from gatekeeper.workspace import MinPower


def calibrate(run_cli, ws, *extra):
    code, out, _ = run_cli("--workspace", ws, "calibrate", *extra, "--operator", "cal", "--json")
    return code, json.loads(out)


def rows(result):
    return {r["spec"]: r for r in result["faults"]}


def passing(run_cli, ws, engine):
    code, out = evaluate(run_cli, ws, engine)
    assert out["verdict"] == "PASS", out
    return out["evaluation_id"]


def test_torch_detection_curve_and_its_record(run_cli, tiny_ws, monkeypatch):
    # A real evaluation never opens a fault session: one that did would fail here.
    monkeypatch.setattr(FaultSession, "__init__", lambda *a, **k: pytest.fail("a fault session in a real run"))
    eid = passing(run_cli, tiny_ws, "tiny")
    monkeypatch.undo()
    with ledger(tiny_ws) as lg:
        assert "fault" not in json.dumps(lg.evaluation(eid)["identity"])
    code, result = calibrate(run_cli, tiny_ws, "--evaluation", eid)
    assert code == 0, result
    r = rows(result)
    assert r["noise:0"]["flagged"] == 0  # an exact copy: no false alarm
    assert r["noise:0.1"]["share"] >= 0.5 and r["noise:0.1"]["cached_tokens"] > 0
    assert r["shift"]["flagged"] > 0 and r["drop"]["flagged"] > 0
    assert [x["size"] for x in result["faults"] if x["kind"] == "noise"] == sorted(x["size"] for x in result["faults"] if x["kind"] == "noise")
    assert result["seconds"]["per_flag_on_run"] > 1
    with ledger(tiny_ws) as lg:
        [cal] = lg.calibrations(eid)
        assert cal["result"]["faults"] == result["faults"] and cal["flag"] == "prefix_cache" and cal["operator"] == "cal"
        assert lg.evaluation(eid)["calibrations"][0]["id"] == result["calibration_id"]
        assert lg.verify().ok
    # The review export carries the table and the detection curve.
    code, md, _ = run_cli("--workspace", tiny_ws, "ledger", "export", eid, "--format", "md")
    assert "## Calibrations (1)" in md and f"| noise:0.1 | {r['noise:0.1']['flagged']} / 4 |" in md
    code, page, _ = run_cli("--workspace", tiny_ws, "ledger", "export", eid, "--format", "html")
    assert "<title>Detection curve" in page and "<polyline" in page


def test_only_the_faults_asked_for_run_after_the_unfaulted_one(run_cli, tiny_ws):
    code, result = calibrate(run_cli, tiny_ws, "--engine", "tiny", "--faults", "other_prefix,noise:1e-3,noise:0")
    assert code == 0, result
    assert [r["spec"] for r in result["faults"]] == ["noise:0", "other_prefix", "noise:0.001"]
    assert rows(result)["noise:0"]["flagged"] == 0 and rows(result)["other_prefix"]["flagged"] > 0
    code, out = calibrate(run_cli, tiny_ws, "--engine", "tiny", "--faults", "noise,shift")
    assert code == 2 and out["error"].startswith("--faults 'noise': ") and "noise:SIZE" in out["error"], out
    with ledger(tiny_ws) as lg:
        assert len(lg.calibrations()) == 1  # the refused one wrote nothing


def test_mlx_detection(run_cli, tiny_ws):
    (tiny_ws / "assertions" / "tiny.yaml").write_text(SUITE.replace("max_tokens: 12", "max_tokens: 6"))
    code, result = calibrate(run_cli, tiny_ws, "--engine", "tiny_mlx", "--limit", "2")
    assert code == 0, result
    r = rows(result)
    assert r["noise:0"]["flagged"] == 0 and r["noise:0.1"]["flagged"] >= 1 and r["shift"]["flagged"] >= 1
    assert result["evaluation_id"] is None and "reference" in result["seconds"]


def test_min_power_refuses_a_flip_until_a_strong_calibration(run_cli, tiny_ws):
    path = tiny_ws / "policies" / "prefix_cache.yaml"
    # A drift bound far above what noise does to the logits: faint noise can then be seen only by outputs.
    path.write_text(path.read_text() + "min_power: {noise: 0.1, share: 0.5}\nmax_drift: 1000\n")
    eid = passing(run_cli, tiny_ws, "tiny")

    def flip():
        code, out, _ = run_cli("--workspace", tiny_ws, "flip", "prefix_cache", "on", "--evaluation", eid,
                               "--operator", "ops", "--reason", "passed", "--json")
        return code, json.loads(out)

    code, out = flip()
    assert code == 1 and out["reasons"][0].startswith("underpowered:") and "no calibration" in out["reasons"][0], out
    assert f"calibrate --flag prefix_cache --evaluation {eid}" in out["reasons"][0]
    code, result = calibrate(run_cli, tiny_ws, "--evaluation", eid)
    # The same record is too weak for a policy that wants faint noise caught.
    with ledger(tiny_ws) as lg:
        cals = lg.calibrations(eid)
    weak = flags.power_problems(MinPower(noise=1e-5, share=0.5), "prefix_cache", eid, cals)
    assert len(weak) == 1 and weak[0].startswith("underpowered:") and "at most 0%" in weak[0]
    code, out = flip()
    assert code == 0 and out["state"] == "on", out


def test_calibration_needs_a_cache_flag_and_an_in_process_engine(run_cli, tiny_ws):
    (tiny_ws / "engines" / "served.yaml").write_text("adapter: http\nurl: http://127.0.0.1:9\ncache_switch: cache_prompt\n")
    code, out = calibrate(run_cli, tiny_ws, "--engine", "served")
    assert code == 2 and "cannot plant faults" in out["error"] and "in-process engine" in out["error"], out
    (tiny_ws / "policies" / "half.yaml").write_text("flag: half\ngate: byte_equivalence\nchange: {profile: {chunk: 64}}\n")
    code, out = calibrate(run_cli, tiny_ws, "--flag", "half", "--engine", "tiny")
    assert code == 2 and "does not turn the cache on" in out["error"]
    code, out = calibrate(run_cli, tiny_ws, "--evaluation", "99", "--engine", "tiny")
    assert code == 2 and "no evaluation 99" in out["error"]
    assert not (tiny_ws / "ledger" / "evidence.db").exists()


@pytest.mark.slow
def test_llamacpp_positional_faults(run_cli, tiny_ws):
    (tiny_ws / "engines" / "gguf.yaml").write_text("adapter: llamacpp\nmodel: default\nprefill: monolithic\n"
                                                 "options: {n_ctx: 2048, n_threads: 1}\n")
    code, result = calibrate(run_cli, tiny_ws, "--engine", "gguf")
    assert code == 0, result
    r = rows(result)
    assert not r["noise:0.1"]["supported"] and not r["other_prefix"]["supported"]
    assert r["shift"]["flagged"] >= 1 and r["drop"]["flagged"] >= 1
