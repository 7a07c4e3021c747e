"""Turning a flag on is bound to current, passing evidence and distinct approvers; off is always allowed."""

import json
import shutil
import time

import pytest
from conftest import evaluate, ledger, profile


def flip(run_cli, ws, state, *extra, operator="ops"):
    code, out, _ = run_cli("--workspace", ws, "flip", "prefix_cache", state, "--operator", operator,
                           "--reason", "test", *extra, "--json")
    return code, json.loads(out)


def state_of(run_cli, ws):
    code, out, _ = run_cli("--workspace", ws, "status", "--json")
    assert code == 0
    return next(f for f in json.loads(out)["flags"] if f["flag"] == "prefix_cache")


def set_policy(ws, old, new):
    path = ws / "policies" / "prefix_cache.yaml"
    assert old in path.read_text()
    path.write_text(path.read_text().replace(old, new))


def passing(run_cli, ws, engine="tiny"):
    code, out = evaluate(run_cli, ws, engine, "--limit", "1")
    assert out["verdict"] == "PASS", out
    return out["evaluation_id"]


def assert_refused(run_cli, ws, result, code, prefix):
    assert code == 1 and result["action"] == "refused" and result["state"] == "off"
    assert any(r.startswith(prefix) for r in result["reasons"]), result["reasons"]
    assert state_of(run_cli, ws)["state"] == "off"
    with ledger(ws) as lg:
        assert lg.refusals("prefix_cache")[-1]["reasons"] == result["reasons"]
        assert lg.flag_states().get("prefix_cache", {}).get("state", "off") == "off"
        assert lg.verify().ok


def test_pass_then_flip_on_then_off(run_cli, tiny_ws):
    eid = passing(run_cli, tiny_ws)
    code, result = flip(run_cli, tiny_ws, "on", "--evaluation", eid)
    assert code == 0 and result["state"] == "on" and result["action"] == "flipped", result
    st = state_of(run_cli, tiny_ws)
    assert (st["state"], st["evaluation_id"], st["operator"], st["evidence_current"]) == ("on", eid, "ops", True)
    code, result = flip(run_cli, tiny_ws, "off")  # no evaluation needed to turn off
    assert code == 0 and state_of(run_cli, tiny_ws)["state"] == "off"
    with ledger(tiny_ws) as lg:
        assert [f["state"] for f in lg.flips("prefix_cache")] == ["on", "off"]
        assert len(lg.approvals("prefix_cache", eid)) == 1


def test_refused_without_evaluation(run_cli, tiny_ws):
    code, result = flip(run_cli, tiny_ws, "on")
    assert_refused(run_cli, tiny_ws, result, code, "no_evaluation:")
    code, result = flip(run_cli, tiny_ws, "on", "--evaluation", 42)
    assert_refused(run_cli, tiny_ws, result, code, "no_evaluation:")


def test_refused_on_failed_evaluation(run_cli, tiny_ws):
    code, out = evaluate(run_cli, tiny_ws, "short")
    assert out["verdict"] == "FAIL"
    code, result = flip(run_cli, tiny_ws, "on", "--evaluation", out["evaluation_id"])
    assert_refused(run_cli, tiny_ws, result, code, "not_passed:")


def test_refused_on_evaluation_of_another_flag(run_cli, tiny_ws):
    (tiny_ws / "policies" / "other_cache.yaml").write_text(
        "flag: other_cache\ngate: byte_equivalence\nchange: {profile: {cache: {max_entries: 8}}}\n")
    code, out, _ = run_cli("--workspace", tiny_ws, "evaluate", "--flag", "other_cache", "--engine", "tiny",
                           "--limit", "1", "--operator", "ci", "--json")
    assert json.loads(out)["verdict"] == "PASS"
    code, result = flip(run_cli, tiny_ws, "on", "--evaluation", json.loads(out)["evaluation_id"])
    assert_refused(run_cli, tiny_ws, result, code, "wrong_flag:")


def test_refused_when_the_model_changed(run_cli, tiny_ws, tiny_llama, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    (tiny_ws / "engines" / "mine.yaml").write_text(profile("torch", model))
    eid = passing(run_cli, tiny_ws, "mine")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))
    code, result = flip(run_cli, tiny_ws, "on", "--evaluation", eid)
    assert_refused(run_cli, tiny_ws, result, code, "stale:")
    assert "model_digest" in result["reasons"][0]


def test_refused_when_the_battery_changed(run_cli, tiny_ws):
    eid = passing(run_cli, tiny_ws)
    suite = tiny_ws / "assertions" / "tiny.yaml"
    suite.write_text(suite.read_text().replace("max_tokens: 12", "max_tokens: 13"))
    code, result = flip(run_cli, tiny_ws, "on", "--evaluation", eid)
    assert_refused(run_cli, tiny_ws, result, code, "stale:")


def test_refused_when_evidence_expired(run_cli, tiny_ws):
    set_policy(tiny_ws, "max_age_hours: 720", "max_age_hours: 0.0002")  # under a second
    eid = passing(run_cli, tiny_ws)
    time.sleep(1.0)
    code, result = flip(run_cli, tiny_ws, "on", "--evaluation", eid)
    assert_refused(run_cli, tiny_ws, result, code, "expired:")


def test_self_approval_refused_when_forbidden(run_cli, tiny_ws):
    eid = passing(run_cli, tiny_ws)  # run by operator "ci"
    code, result = flip(run_cli, tiny_ws, "on", "--evaluation", eid, operator="ci")
    assert_refused(run_cli, tiny_ws, result, code, "self_approval:")


def test_self_approval_allowed_when_policy_says_so(run_cli, tiny_ws):
    set_policy(tiny_ws, "evaluator_may_approve: false", "evaluator_may_approve: true")
    eid = passing(run_cli, tiny_ws)
    code, result = flip(run_cli, tiny_ws, "on", "--evaluation", eid, operator="ci")
    assert code == 0 and result["state"] == "on"


def test_two_distinct_approvers_needed(run_cli, tiny_ws):
    set_policy(tiny_ws, "required: 1", "required: 2")
    eid = passing(run_cli, tiny_ws)
    code, result = flip(run_cli, tiny_ws, "on", "--evaluation", eid, operator="ana")
    assert code == 0 and (result["action"], result["state"], result["approvals"]) == ("approved", "off", 1)
    assert state_of(run_cli, tiny_ws)["state"] == "off"
    code, result = flip(run_cli, tiny_ws, "on", "--evaluation", eid, operator="ana")
    assert_refused(run_cli, tiny_ws, result, code, "duplicate_approval:")
    code, result = flip(run_cli, tiny_ws, "on", "--evaluation", eid, operator="ben")
    assert code == 0 and (result["action"], result["state"], result["approvals"]) == ("flipped", "on", 2)
    with ledger(tiny_ws) as lg:
        assert len(lg.flips("prefix_cache")[-1]["approval_ids"]) == 2


def test_status_reports_stale_evidence_for_a_flag_that_is_on(run_cli, tiny_ws):
    eid = passing(run_cli, tiny_ws)
    flip(run_cli, tiny_ws, "on", "--evaluation", eid)
    suite = tiny_ws / "assertions" / "tiny.yaml"
    suite.write_text(suite.read_text().replace("max_tokens: 12", "max_tokens: 11"))
    st = state_of(run_cli, tiny_ws)
    assert st["state"] == "on" and st["evidence_current"] is False
    assert st["evidence_problems"][0].startswith("stale:")


@pytest.mark.parametrize("args, expected", [
    (("flip", "turbo", "on", "--reason", "x"), "unknown flag 'turbo'"),
    (("flip", "prefix_cache", "sideways", "--reason", "x"), "state must be 'on' or 'off'"),
    (("flip", "prefix_cache", "off"), "--reason is required"),
])
def test_bad_flip_input_exits_2_and_writes_nothing(run_cli, tiny_ws, args, expected):
    code, out, _ = run_cli("--workspace", tiny_ws, *args, "--json")
    assert code == 2 and expected in json.loads(out)["error"]
    assert not (tiny_ws / "ledger" / "evidence.db").exists()


def test_hash_changes_on_every_flip(run_cli, tiny_ws):
    def current():
        code, out, _ = run_cli("--workspace", tiny_ws, "hash", "--engine", "tiny", "--json")
        assert code == 0
        return json.loads(out)

    before = current()
    assert before["parts"]["flags"] == {"prefix_cache": "off"}
    eid = passing(run_cli, tiny_ws)
    flip(run_cli, tiny_ws, "on", "--evaluation", eid)
    on = current()
    assert on["parts"]["flags"] == {"prefix_cache": "on"} and on["pipeline_hash"] != before["pipeline_hash"]
    flip(run_cli, tiny_ws, "off")
    assert current()["pipeline_hash"] == before["pipeline_hash"]
