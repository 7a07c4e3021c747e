"""``battery mine``: every candidate run once flag off, scored by its near-ties per second, the best kept
with every stage represented and written as suites that load, with provenance. Shown on a tiny model
with a near-tie planted in one case on purpose: mining prefers that case, and the suite it writes
catches a planted fault that the case it passed over misses."""

from __future__ import annotations

import json

import pytest
import yaml
from conftest import ROOT, SUITE, evaluate
from planted import plant_near_tie

from gatekeeper.battery import partition
from gatekeeper.battery.suites import all_suites, read
from gatekeeper.engines.registry import build_engine
from gatekeeper.workspace import Workspace

pytestmark = pytest.mark.slow
PAIR = SUITE.split("  - id: c")[0].replace("suite: tiny", "suite: pair").replace("stage: tiny", "stage: pair")


def profile(model) -> str:
    return f"adapter: torch\nmodel: {model}\ndtype: float32\ndevice: cpu\nprefill: aligned\n"


@pytest.fixture
def planted(tiny_ws, tiny_llama, tmp_path):
    """The workspace with suite ``pair`` (cases a and b) and engine ``tied``: the tiny llama with a
    near-tie planted at case a's first step."""
    (tiny_ws / "assertions" / "pair.yaml").write_text(PAIR)
    (tiny_ws / "engines" / "plain.yaml").write_text(profile(tiny_llama))
    ws = Workspace(tiny_ws)
    items = {i.case_id: i for i in read(ws)}
    with build_engine(ws.engine("plain"), workspace_root=ws.root) as model:
        rendered = {cid: partition.render(model, partition.pieces(ws, i.suite, {**i.case.vars, **(i.case.turns[0] if i.case.turns else {})}),
                                          "partitioned") for cid, i in items.items()}
        vocab = len(model.tok.hf)
    used = {t for r in rendered.values() for t in r.tokens} | set(range(16))  # every prompt's ids, the specials
    plant_near_tie(tiny_llama, tmp_path / "tied", rendered["pair/a"].tokens, set(range(vocab)) - used)
    (tiny_ws / "engines" / "tied.yaml").write_text(profile(tmp_path / "tied"))
    return tiny_ws


def mine(run_cli, ws, *extra):
    code, out, _ = run_cli("--workspace", ws, "battery", "mine", *extra, "--json")
    report = json.loads(out)
    assert code == 0, report
    return report


def test_mining_prefers_the_planted_near_tie(run_cli, planted, tmp_path):
    report = mine(run_cli, planted, "--suite", "pair", "--engine", "tied", "--cases", "1", "--out", tmp_path / "mined")
    assert report["candidates"] == 2 and report["chosen"] == 1
    [case] = report["suites"]["pair"]["cases"]
    assert case["id"] == "a" and case["min_margin"] < 1e-3 and case["near_ties"] >= 1 and case["source"] == "assertions/pair.yaml#a"
    doc = yaml.safe_load((tmp_path / "mined" / "pair.yaml").read_text())
    assert [c["id"] for c in doc["cases"]] == ["a"] and doc["cases"][0]["mined"]["score"] == case["score"]
    assert doc["mined_on"]["engine"] == "tied" and doc["decoding"]["max_tokens"] == 12
    # What it wrote is a suite the gate loads.
    (planted / "assertions" / "pair.yaml").write_text((tmp_path / "mined" / "pair.yaml").read_text())
    suite = all_suites(Workspace(planted))["pair"]
    assert suite.mined_on.engine == "tied" and suite.cases[0].mined.source == "assertions/pair.yaml#a"


def test_every_stage_is_represented_and_longer_answers_are_priced(run_cli, planted, tmp_path):
    report = mine(run_cli, planted, "--engine", "tied", "--cases", "2", "--max-tokens", "32", "--out", tmp_path / "mined")
    assert set(report["suites"]) == {"pair", "tiny"}  # the best of each stage first, whatever the budget
    for st in report["suites"].values():
        assert 12 <= st["max_tokens"] <= 32
        assert (st["power_per_token"] is None) == (st["max_tokens"] == 12)
    code, out, _ = run_cli("--workspace", planted, "battery", "mine", "--cases", "2", "--seconds", "5", "--json")
    assert code == 2 and "one budget" in json.loads(out)["error"]


def calibrate(run_cli, ws, suite):
    code, out, _ = run_cli("--workspace", ws, "calibrate", "--engine", "tied", "--suite", suite, "--full",
                           "--operator", "cal", "--json")
    result = json.loads(out)
    assert code == 0, result
    return {r["spec"]: r for r in result["faults"]}


def test_the_mined_suite_catches_a_fault_the_passed_over_case_misses(run_cli, planted, tmp_path):
    # Outputs alone: a drift bound far above anything planted noise does to the logits.
    path = planted / "policies" / "prefix_cache.yaml"
    path.write_text(path.read_text() + "max_drift: 1000\n")
    mine(run_cli, planted, "--suite", "pair", "--engine", "tied", "--cases", "1", "--out", tmp_path / "mined")
    mined = yaml.safe_load((tmp_path / "mined" / "pair.yaml").read_text())
    passed_over = {**mined, "suite": "passed_over", "stage": "passed_over",
                   "cases": [c for c in yaml.safe_load(PAIR)["cases"] if c["id"] == "b"]}
    (planted / "assertions" / "mined.yaml").write_text(yaml.safe_dump({**mined, "suite": "mined", "stage": "mined"}))
    (planted / "assertions" / "passed_over.yaml").write_text(yaml.safe_dump(passed_over))
    faint = ("noise:1e-05", "noise:0.0001", "noise:0.001")
    caught, missed = calibrate(run_cli, planted, "mined"), calibrate(run_cli, planted, "passed_over")
    assert caught["noise:0"]["flagged"] == 0 and missed["noise:0"]["flagged"] == 0
    assert sum(caught[f]["by_outputs"] for f in faint) >= 1
    assert sum(missed[f]["by_outputs"] for f in faint) == 0
    code, out = evaluate(run_cli, planted, "tied", "--suite", "mined")
    assert code == 0 and out["verdict"] == "PASS"  # the unfaulted cache keeps even a 1e-5 near-tie
    assert not any(r.startswith("mined_elsewhere:") for r in out["reasons"])
    code, out = evaluate(run_cli, planted, "plain", "--suite", "mined")
    assert any(r.startswith("mined_elsewhere: suite mined was mined on tied") for r in out["reasons"]), out["reasons"]


def test_planted_faults_measure_each_candidate_and_come_first(run_cli, planted, tmp_path):
    report = mine(run_cli, planted, "--suite", "pair", "--engine", "tied", "--cases", "2", "--faults", "noise:1e-3,shift",
                  "--out", tmp_path / "mined")
    assert report["faults"] == ["noise:0.001", "shift"]
    catches = {c["id"]: c["catches"] for c in report["suites"]["pair"]["cases"]}
    assert "noise:0.001" in catches["a"] and "noise:0.001" not in catches["b"]  # only the planted near-tie flips
    doc = yaml.safe_load((tmp_path / "mined" / "pair.yaml").read_text())
    assert doc["mined_on"]["faults"] == ["noise:0.001", "shift"]
    assert {c["id"]: c["mined"]["catches"] for c in doc["cases"]} == catches
    code, out, _ = run_cli("--workspace", planted, "battery", "mine", "--cases", "1", "--faults", "noise", "--json")
    assert code == 2 and "noise:SIZE" in json.loads(out)["error"]


def test_a_case_a_fault_catches_outranks_a_better_score():
    from gatekeeper.battery.suites import Item
    from gatekeeper.gate.power import mine as mining

    [item] = [i for i in read(Workspace(ROOT)) if i.suite.suite == "router"][:1]
    ties = mining.Scored(mining.Candidate(item, "ties"), [[0.001] * 4], [100], (0.001, 0.01))
    caught = mining.Scored(mining.Candidate(Item(item.suite, item.case.model_copy(update={"id": "caught"})), "caught"),
                           [[5.0] * 4], [100], (0.001, 0.01), {"drop": (0, 2)})
    ties.departs = {"drop": None}
    mined = mining.select([ties, caught], cases=1, identity={}, engine="torch")
    assert [s.candidate.source for s in mined.chosen] == ["caught"] and mined.faults == ["drop"]
    assert caught.catches(2) == [] and caught.catches(3) == ["drop"]  # a departure past the length is not caught


def test_mining_keeps_a_single_turn_case_for_the_cache_probes():
    from gatekeeper.battery.suites import Item
    from gatekeeper.gate.power import mine as mining

    [item] = [i for i in read(Workspace(ROOT)) if i.suite.suite == "router"][:1]
    stream = Item(item.suite, item.case.model_copy(update={"id": "stream", "turns": [{"query": "a"}, {"query": "b"}]}))
    best = mining.Scored(mining.Candidate(stream, "stream"), [[0.001] * 4, [0.001] * 4], [100, 120], (0.001, 0.01))
    single = mining.Scored(mining.Candidate(item, "single"), [[5.0] * 4], [100], (0.001, 0.01))
    mined = mining.select([best, single], cases=1, identity={}, engine="torch")
    assert [s.candidate.source for s in mined.chosen] == ["stream", "single"]
