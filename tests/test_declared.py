"""Declared enablements: a flag says what it changes (``change:``), the gate compares the pipeline
in force with and without it, and a flag that is on applies its change everywhere."""

import json
import xml.etree.ElementTree as ET

import pytest
from conftest import ledger, profile, wide_suite

from gatekeeper.errors import GatekeeperError
from gatekeeper.runtime import Runtime


def policy(ws, flag, change, gate="byte_equivalence", extra=""):
    # the reference arm reads every answer again: it is tested where it is the subject (test_reference.py)
    (ws / "policies" / f"{flag}.yaml").write_text(f"flag: {flag}\ngate: {gate}\nchange: {change}\nreference: false\n{extra}")


def cli(run_cli, ws, *args):
    code, out, _ = run_cli("--workspace", ws, *args, "--json")
    return code, json.loads(out)


def evaluate(run_cli, ws, flag, engine="tiny", operator="ci", *extra):
    return cli(run_cli, ws, "evaluate", "--flag", flag, "--engine", engine, "--operator", operator, *extra)


def flip_on(run_cli, ws, flag, evaluation_id, operator="ops"):
    return cli(run_cli, ws, "flip", flag, "on", "--evaluation", str(evaluation_id), "--operator", operator,
               "--reason", "evidence passed")


def status(run_cli, ws, flag):
    code, out = cli(run_cli, ws, "status")
    assert code == 0
    return next(f for f in out["flags"] if f["flag"] == flag)


def test_flag_without_change_is_refused(run_cli, tiny_ws):
    (tiny_ws / "policies" / "kv_q8.yaml").write_text("flag: kv_q8\ngate: byte_equivalence\n")
    code, out = evaluate(run_cli, tiny_ws, "kv_q8")
    assert code == 2 and "kv_q8.yaml" in out["error"] and "field 'change'" in out["error"]
    assert "change: {profile:" in out["error"] and "change: {engine: NAME}" in out["error"]  # the fix
    assert not (tiny_ws / "ledger" / "evidence.db").exists()  # nothing written
    (tiny_ws / "policies" / "kv_q8.yaml").unlink()
    (tiny_ws / "policies" / "prefix_cache.yaml").write_text(
        (tiny_ws / "policies" / "prefix_cache.yaml").read_text() + "change: {profile: {dtype: float16}}\n")
    code, out = evaluate(run_cli, tiny_ws, "prefix_cache")
    assert code == 2 and "built in" in out["error"] and "prefix_cache.yaml" in out["error"]


@pytest.mark.parametrize("change, words", [
    ("{profile: {colour: red}}", ["'colour' is not an engine profile field"]),
    ("{profile: {dtype: float8}}", ["dtype"]),
    ("{profile: {options: {type_k: q8_0}}}", ["engines/tiny.yaml as changed by policies/kvq.yaml", "options.type_k",
                                              "torch adapter does not understand", "draft_model"]),
    ("{engine: nowhere}", ["no engine profile 'nowhere'"]),
])
def test_bad_change_is_exit_2_naming_what_and_how(run_cli, tiny_ws, change, words):
    policy(tiny_ws, "kvq", change)
    code, out = evaluate(run_cli, tiny_ws, "kvq")
    assert code == 2, out
    for w in words:
        assert w in out["error"], out["error"]
    assert not (tiny_ws / "ledger" / "evidence.db").exists()


def test_dtype_change_follows_the_outputs_and_runs_when_on(run_cli, tiny_ws):
    policy(tiny_ws, "half", "{profile: {dtype: float16}}")
    code, out = evaluate(run_cli, tiny_ws, "half")
    assert out["verdict"] in ("PASS", "FAIL")
    with ledger(tiny_ws) as lg:
        ev = lg.evaluation(out["evaluation_id"])
    assert ev["identity"]["off"]["engine"]["dtype"] == "float32" and ev["identity"]["on"]["engine"]["dtype"] == "float16"
    assert ev["identity"]["on"]["change"] == {"profile": {"dtype": "float16"}}
    # The verdict follows the outputs: PASS exactly when every case's tokens agree off and on.
    results = {(r["case_id"], r["config"], r["repeat"]): r["result"] for r in ev["case_results"]}
    same = all([t["tokens"] for t in results[(c, "off", 0)]["turns"]] == [t["tokens"] for t in results[(c, "on", 0)]["turns"]]
               for c in {k[0] for k in results})
    assert (out["verdict"] == "PASS") == same
    assert out["differing_cases"] == [] if same else out["differing_cases"]
    # Whether float16 keeps float32's tokens is the CPU's rounding at the tiny model's near-ties (it does on the CPUs
    # seen so far): where it does not, the FAIL must refuse the flip, and the rest has nothing to run.
    code, before = cli(run_cli, tiny_ws, "hash", "--engine", "tiny")
    code, result = flip_on(run_cli, tiny_ws, "half", out["evaluation_id"])
    if out["verdict"] != "PASS":
        assert code == 1 and result["action"] == "refused", result
        return
    assert code == 0 and result["state"] == "on", result
    code, after = cli(run_cli, tiny_ws, "hash", "--engine", "tiny")
    assert after["pipeline_hash"] != before["pipeline_hash"]
    assert after["parts"]["flags"]["half"] == {"state": "on", "change": {"profile": {"dtype": "float16"}}}
    with Runtime(tiny_ws, engine="tiny", response_cache=False) as rt:
        assert rt.model.identity()["dtype"] == "float16" and str(rt.model.dtype) == "torch.float16"
        assert rt.pipeline_hash == after["pipeline_hash"]


def test_planted_token_change_is_caught(run_cli, tiny_ws):
    policy(tiny_ws, "planted", "{profile: {adapter: 'fault_engines:OneTokenOff'}}")
    code, out = evaluate(run_cli, tiny_ws, "planted")
    assert code == 1 and out["verdict"] == "FAIL", out
    assert set(out["differing_cases"]) == {"tiny/a", "tiny/b", "tiny/c", "tiny/loop"}
    with ledger(tiny_ws) as lg:
        ev = lg.evaluation(out["evaluation_id"])
    diff = next(c["detail"] for c in ev["comparisons"] if c["case_id"] == "tiny/a" and c["detail"]["pair"] == "off#0~on#0")
    assert diff["first_divergent_position"] == 2 and diff["b"]["token"] == (diff["a"]["token"] + 1) % 256
    assert diff["a"]["margin"] is not None and diff["a"]["margin"] >= 0
    assert any(r.startswith("differs: tiny/a turn 1 first divergent token at position 2") for r in out["reasons"])


def test_an_exact_gate_counts_the_flips_beside_its_drift(run_cli, tiny_ws):
    # byte equivalence FAILs on any difference; the assertions the change broke are counted too, as figures
    wide_suite(tiny_ws, 6, lambda i: [{"type": "max-length", "value": 10000}] +
               ([{"type": "not-contains", "value": "zebra"}] if i < 2 else []))
    policy(tiny_ws, "lossy", "{profile: {adapter: 'fault_engines:Lossy'}}", extra="probes: off\n")
    code, out = evaluate(run_cli, tiny_ws, "lossy", "tiny", "ci", "--suite", "wide")
    assert (code, out["verdict"]) == (1, "FAIL") and out["paired"] is None, out["reasons"]
    assert out["strength"]["flips"] == {"pairs": 8, "harmful": 2, "beneficial": 0}
    code, text, _ = run_cli("--workspace", tiny_ws, "evaluate", "--flag", "lossy", "--engine", "tiny", "--operator", "ci",
                            "--suite", "wide")
    flat = " ".join(w for w in text.split() if w != "│")  # the table's row, read across its wrapped lines
    assert code == 1 and "steps at risk; 2 harmful / 0 beneficial flips of 8 assertions" in flat, text
    code, md, _ = run_cli("--workspace", tiny_ws, "ledger", "export", str(out["evaluation_id"]), "--format", "md")
    assert code == 0 and "- assertion flips (harmful / beneficial of pairs): 2 / 0 of 8" in md, md


@pytest.mark.parametrize("broken, verdict", [(2, "PASS"), (30, "FAIL")])
def test_lossy_change_within_and_beyond_the_margin(run_cli, tiny_ws, broken, verdict, tmp_path):
    # 60 cases; the first ``broken`` also assert not-contains zebra, which the change breaks (every answer ends
    # with ' zebra'): 2 lost of 62 assertions is within a 0.2 margin at alpha 0.025, 30 of 90 is beyond it.
    wide_suite(tiny_ws, 60, lambda i: [{"type": "max-length", "value": 10000}] +
               ([{"type": "not-contains", "value": "zebra"}] if i < broken else []))
    policy(tiny_ws, "lossy", "{profile: {adapter: 'fault_engines:Lossy'}}", "non_inferiority", "margin: 0.2\nprobes: off\n")
    code, out = evaluate(run_cli, tiny_ws, "lossy", "tiny", "ci", "--suite", "wide", "--junit", tmp_path / "j.xml")
    assert out["verdict"] == verdict and code == (0 if verdict == "PASS" else 1), out
    assert out["passes"]["on"] == out["passes"]["off"] - broken
    assert "regressed: wide/w0 assertion '#2 not-contains' passes without lossy, fails with lossy" in out["reasons"]
    stats = out["paired"]  # judged at the first look's share of the policy's alpha 0.05 (gate/stats/looks.py)
    assert (stats["n"], stats["harmful"], stats["beneficial"], stats["margin"], stats["alpha"]) == (60 + broken, broken, 0, 0.2, 0.025)
    assert out["looks"]["index"] == 1 and out["looks"]["alpha"] == 0.05
    assert stats["upper"] <= 0.2 if verdict == "PASS" else stats["lower"] > 0.2, stats
    assert any(r.startswith("non_inferior:" if verdict == "PASS" else "inferior:") for r in out["reasons"])
    # the change only appends text: read teacher-forced, the model itself did not move
    assert out["distance"]["distance"]["kld"]["max"] == 0 and out["distance"]["distance"]["same_top1"] == 1
    with ledger(tiny_ws) as lg:  # recorded with the verdict
        assert lg.evaluation(out["evaluation_id"])["verdict_record"]["summary"]["paired"] == stats
    # and in JUnit: the flips and the bound as the suite's properties, each case's flips beside its assertions
    suite = ET.parse(tmp_path / "j.xml").getroot().find("testsuite")
    props = {p.get("name"): p.get("value") for p in suite.iter("property")}
    assert (props["harmful_flips"], props["beneficial_flips"], props["margin"]) == (str(broken), "0", "0.2"), props
    assert props["loss_bounds"] == f"[{stats['lower']:.4g}, {stats['upper']:.4g}]" and "kld_mean" in props
    outs = {tc.get("name"): tc.find("system-out").text for tc in suite.iter("testcase")}
    assert outs["w0"].endswith("flips: harmful 1, beneficial 0") and outs["w59"].endswith("flips: harmful 0, beneficial 0")
    code, md, _ = run_cli("--workspace", tiny_ws, "ledger", "export", str(out["evaluation_id"]), "--format", "md")
    row = f"| all | {60 + broken} | 60 | {broken} | 0 | {stats['loss']:.3f} | [{stats['lower']:.3f}, {stats['upper']:.3f}] | 0.2 |"
    assert code == 0 and "## Paired outcomes (flag off vs on)" in md and row in md, md


def test_ledger_diff_shows_each_cases_flips(run_cli, tiny_ws):
    policy(tiny_ws, "lossy", "{profile: {adapter: 'fault_engines:Lossy'}}", "non_inferiority", "margin: 0.2\nprobes: off\n")
    ids = []
    for broken in (2, 5):  # the same change on a battery where 2, then 5, cases assert what it breaks
        wide_suite(tiny_ws, 12, lambda i, b=broken: [{"type": "max-length", "value": 10000}] +
                   ([{"type": "not-contains", "value": "zebra"}] if i < b else []))
        ids.append(evaluate(run_cli, tiny_ws, "lossy", "tiny", "ci", "--suite", "wide")[1]["evaluation_id"])
    code, d = cli(run_cli, tiny_ws, "ledger", "diff", *map(str, ids))
    assert code == 0 and d["a"]["flips"]["harmful"] == 2 and d["b"]["flips"]["harmful"] == 5, d["a"]
    rows = {r["case_id"]: r for r in d["cases"]}
    assert rows["wide/w0"]["a"]["flips"] == rows["wide/w0"]["b"]["flips"] == [1, 0] and not rows["wide/w0"]["changed"]
    assert rows["wide/w3"]["a"]["flips"] == [0, 0] and rows["wide/w3"]["b"]["flips"] == [1, 0]
    assert d["changed_cases"] == ["wide/w2", "wide/w3", "wide/w4"], d["changed_cases"]
    code, md, _ = run_cli("--workspace", tiny_ws, "ledger", "diff", *map(str, ids), "--format", "md")
    w3 = next(line for line in md.splitlines() if line.startswith("| **`wide/w3`**"))
    assert w3.endswith("| 0 / 0 | 1 / 0 |") and "| flips | 2 harmful / 0 beneficial;" in md, md
    code, text, _ = run_cli("--workspace", tiny_ws, "ledger", "diff", *map(str, ids))
    assert code == 0 and f"flips {ids[1]}: 5 harmful / 0 beneficial; loss " in text and "(harmful /" in text, text


def test_a_lossy_change_on_too_few_cases_is_never_a_pass(run_cli, tiny_ws):
    """The tiny suite's 4 assertions cannot rule out any margin below 0.4: INCONCLUSIVE, with the cases it needs."""
    policy(tiny_ws, "lossy", "{profile: {adapter: 'fault_engines:Lossy'}}", "non_inferiority", "margin: 0.34\nprobes: off\n")
    code, out = evaluate(run_cli, tiny_ws, "lossy")
    assert code == 1 and out["verdict"] == "INCONCLUSIVE", out
    assert "regressed: tiny/c assertion '#1 not-contains' passes without lossy, fails with lossy" in out["reasons"]
    under = next(r for r in out["reasons"] if r.startswith("underpowered:"))
    assert "with 4 assertion pairs" in under and out["paired"]["needed"] > 4, under


def passing(run_cli, ws, flag):
    code, out = evaluate(run_cli, ws, flag, "tiny", "ci", "--limit", "1")
    assert out["verdict"] == "PASS", out
    return out["evaluation_id"]


def test_two_flags_on_changing_one_field(run_cli, tiny_ws):
    policy(tiny_ws, "chunk_a", "{profile: {chunk: 64}}")
    policy(tiny_ws, "chunk_b", "{profile: {chunk: 32, cache: {max_entries: 8}}}")
    code, result = flip_on(run_cli, tiny_ws, "chunk_a", passing(run_cli, tiny_ws, "chunk_a"))
    assert result["state"] == "on", result
    for args in (("evaluate", "--flag", "chunk_b", "--engine", "tiny"), ):
        code, out = cli(run_cli, tiny_ws, *args)
        assert code == 2 and "chunk_a" in out["error"] and "chunk_b" in out["error"] and "'chunk'" in out["error"], out
    with pytest.raises(GatekeeperError, match="chunk_a and chunk_b are both on"):
        Runtime(tiny_ws, engine="tiny", flags={"chunk_b": "on"}, response_cache=False)
    # Distinct fields combine, in a stable order: both changes are in force.
    policy(tiny_ws, "chunk_b", "{profile: {cache: {max_entries: 8}}}")
    with Runtime(tiny_ws, engine="tiny", flags={"chunk_b": "on"}, response_cache=False) as rt:
        assert (rt.model.profile.chunk, rt.model.profile.cache.max_entries) == (64, 8)
        assert rt.model.profile.changed_by == ("chunk_a", "chunk_b")


def test_editing_a_flipped_change_makes_its_evidence_stale(run_cli, tiny_ws):
    policy(tiny_ws, "chunky", "{profile: {chunk: 64}}")
    eid = passing(run_cli, tiny_ws, "chunky")
    code, result = flip_on(run_cli, tiny_ws, "chunky", eid)
    assert result["state"] == "on"
    assert status(run_cli, tiny_ws, "chunky")["evidence_current"] is True
    policy(tiny_ws, "chunky", "{profile: {chunk: 32}}")
    st = status(run_cli, tiny_ws, "chunky")
    assert st["evidence_current"] is False
    assert any(p.startswith("stale:") and "change" in p and "chunk" in p for p in st["evidence_problems"]), st
    # The running pipeline keeps what was approved, not the edit.
    with Runtime(tiny_ws, engine="tiny", response_cache=False) as rt:
        assert rt.model.profile.chunk == 64
    code, result = flip_on(run_cli, tiny_ws, "chunky", eid, operator="ops2")
    assert code == 1 and result["action"] == "refused" and result["reasons"][0].startswith("stale:"), result


def test_runtime_migration_to_a_blind_engine_is_called_out(run_cli, tiny_ws, tiny_llama):
    (tiny_ws / "engines" / "blind.yaml").write_text(profile("fault_engines:Blind", tiny_llama))
    policy(tiny_ws, "migrate", "{engine: blind}", "non_inferiority")
    code, out = evaluate(run_cli, tiny_ws, "migrate")
    # the same weights: nothing regresses, but four assertions cannot show it (never a PASS on too little)
    assert out["verdict"] == "INCONCLUSIVE" and any(r.startswith("underpowered:") for r in out["reasons"]), out
    blind = [r for r in out["reasons"] if r.startswith("telemetry_blind:")]
    assert len(blind) == 1 and "flag-on engine" in blind[0] and "engines/blind.yaml" in blind[0], out["reasons"]
    assert set(out["telemetry"]["off"]) == set(out["telemetry"]["on"]) == {"tiny"}
    assert out["telemetry"]["off"]["tiny"]["calls"] == 6 and out["telemetry"]["off"]["tiny"]["prompt_tokens"] > 0
    with ledger(tiny_ws) as lg:
        ev = lg.evaluation(out["evaluation_id"])
    assert ev["identity"]["on"]["profile"]["adapter"] == "fault_engines:Blind"
    assert ev["identity"]["off"]["profile"]["adapter"] == "torch"
