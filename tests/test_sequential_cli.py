"""Sequential evaluation through the real CLI on the tiny engine: ``evaluate --max-cases/--max-seconds`` runs the
cases in a seeded random order and stops when the anytime-valid rule (gate/stats/sequential.py) decides or at the budget.

The planted change is ``fault_engines:Lossy`` (every answer ends with ' zebra'): a case asserting not-contains
zebra loses that assertion with the flag on, every other assertion is kept. Margin 0.3 at alpha 0.2 lets the rule
decide on a handful of cases, so each test runs in seconds."""

import json

import pytest
from conftest import ledger, wide_suite

from gatekeeper.gate.stats import sequential

CASES = 24
LOSSY = "{profile: {adapter: 'fault_engines:Lossy'}}"


def policy(ws, gate="non_inferiority", extra="margin: 0.3\nalpha: 0.2\n", flag="lossy"):
    (ws / "policies" / f"{flag}.yaml").write_text(
        f"flag: {flag}\ngate: {gate}\nchange: {LOSSY}\nprobes: off\ndistance: false\n{extra}")


def evaluate(run_cli, ws, *extra, flag="lossy"):
    code, out, _ = run_cli("--workspace", ws, "evaluate", "--flag", flag, "--engine", "tiny", "--operator", "ci",
                           "--suite", "wide", *extra, "--json")
    return code, json.loads(out)


def within(i):
    """Every case keeps its length check; every eighth also asserts not-contains zebra, which the change breaks:
    a loss per case of 1/16 on average, well within the margin."""
    keep = [{"type": "max-length", "value": 10000}]
    return keep + ([{"type": "not-contains", "value": "zebra"}] if i % 8 == 0 else [])


def ran_only(ws, out):
    """The record counts the cases that ran and nothing else: case results (three runs each), comparisons."""
    seq = out["sequential"]
    with ledger(ws) as lg:
        ev = lg.evaluation(out["evaluation_id"])
        assert lg.verify().ok
    cases = {r["case_id"] for r in ev["case_results"]}
    assert len(cases) == seq["cases"] == out["cases"] and len(ev["case_results"]) == 3 * seq["cases"]
    assert {c["case_id"] for c in ev["comparisons"]} == cases
    assert ev["config"]["sequential"] == {"seed": 3, "max_cases": seq["max_cases"], "max_seconds": seq["max_seconds"]}
    assert ev["verdict_record"]["summary"]["sequential"] == seq  # the rule and where it stopped, with the verdict
    return ev


def test_a_change_within_the_margin_stops_early_with_pass(run_cli, tiny_ws):
    wide_suite(tiny_ws, CASES, within)
    policy(tiny_ws)
    code, out = evaluate(run_cli, tiny_ws, "--sequential", "--seed", "3")
    assert code == 0 and out["verdict"] == "PASS", out
    seq = out["sequential"]
    assert seq["decision"] == "pass" and seq["stopped"] == "decided" and seq["cases"] < CASES, seq
    assert seq["upper"] <= 0.3 and (seq["rule"], seq["test"], seq["alpha"], seq["margin"], seq["seed"]) == (
        "betting_confidence_sequence", "non_inferiority", 0.1, 0.3, 3)  # look 1 of the change: alpha 0.2 / 2 (gate/stats/looks.py)
    assert out["paired"] is None  # a fixed-n bound at a stop the data chose has no level: not recorded
    reason = next(r for r in out["reasons"] if r.startswith("non_inferior: sequential:"))
    assert f"{seq['cases']} of {CASES} cases run in a random order (seed 3)" in reason and "<= margin 0.3" in reason
    ev = ran_only(tiny_ws, out)
    # the order seed 3 draws, not the battery's: the same seed gives the same cases in the same order
    ran = [r["case_id"] for r in ev["case_results"] if r["config"] == "on"]
    battery = [f"wide/w{i}" for i in range(CASES)]
    assert ran == [battery[i] for i in sequential.order(battery, 3)][:len(ran)] != battery[:len(ran)]
    # a sequential PASS is evidence like any other: it reads in the ledger's views and enables a flip
    code, md, _ = run_cli("--workspace", tiny_ws, "ledger", "export", str(out["evaluation_id"]), "--format", "md")
    assert code == 0 and reason.split(";")[0] in md
    assert "## Sequential evaluation (anytime-valid)" in md and f"| {seq['cases']} of {CASES} | 3 |" in md, md
    from gatekeeper.ledger.intoto import predicate  # the in-toto predicate carries the rule where it stopped

    with ledger(tiny_ws) as lg:
        claim = predicate(lg, lg.evaluation(out["evaluation_id"]), {}, {})
    assert claim["sequential"] == seq and "paired" not in claim
    code, flipped, _ = run_cli("--workspace", tiny_ws, "flip", "lossy", "on", "--evaluation", str(out["evaluation_id"]),
                               "--operator", "ops", "--reason", "sequential evidence passed", "--json")
    assert code == 0 and json.loads(flipped)["state"] == "on", flipped


def test_a_lossy_change_stops_early_with_fail(run_cli, tiny_ws):
    wide_suite(tiny_ws, CASES, lambda i: [{"type": "not-contains", "value": "zebra"}])
    policy(tiny_ws)
    code, out = evaluate(run_cli, tiny_ws, "--max-cases", "20", "--seed", "3")
    assert code == 1 and out["verdict"] == "FAIL", out
    seq = out["sequential"]
    assert seq["decision"] == "fail" and seq["stopped"] == "decided" and seq["cases"] < 20, seq
    assert seq["harmful"] == seq["pairs"] == seq["cases"] and seq["lower"] > 0.3
    assert any(r.startswith("inferior: sequential:") for r in out["reasons"])
    assert any(r.startswith("regressed: wide/") for r in out["reasons"])
    ran_only(tiny_ws, out)


@pytest.mark.parametrize("budget, option", [(["--max-cases", "2"], "--max-cases 2"),
                                            (["--max-seconds", "0.001"], "--max-seconds 0.001")])
def test_a_tight_budget_is_inconclusive_naming_it(run_cli, tiny_ws, budget, option):
    wide_suite(tiny_ws, CASES, within)
    policy(tiny_ws)
    code, out = evaluate(run_cli, tiny_ws, *budget, "--seed", "3")
    assert code == 1 and out["verdict"] == "INCONCLUSIVE", out
    seq = out["sequential"]
    assert seq["decision"] == "continue" and seq["stopped"] == option.split()[0][2:].replace("-", "_")
    assert seq["cases"] == (2 if "cases" in option else 1)  # a time budget is read after each round (one case here)
    under = next(r for r in out["reasons"] if r.startswith("underpowered: sequential:"))
    assert f"the budget {option}" in under and "before the rule decided" in under, under
    ran_only(tiny_ws, out)


def test_equivalence_with_a_margin_runs_sequentially(run_cli, tiny_ws):
    wide_suite(tiny_ws, CASES, lambda i: [{"type": "max-length", "value": 10000}])
    policy(tiny_ws, "assertion_equivalence")
    code, out = evaluate(run_cli, tiny_ws, "--max-cases", "20", "--seed", "3")
    assert code == 0 and out["verdict"] == "PASS", out
    seq = out["sequential"]
    assert seq["test"] == "equivalence" and seq["cases"] < 20 and -0.3 <= seq["lower"] and seq["upper"] <= 0.3, seq
    assert any(r.startswith("equivalent: sequential:") for r in out["reasons"])


@pytest.mark.parametrize("setup, options, words", [
    ("byte", ["--max-cases", "5"], ["byte_equivalence", "nothing to stop early on"]),
    ("margin0", ["--sequential"], ["margin 0", "set field 'margin' above 0"]),
    ("margin0eq", ["--sequential"], ["margin 0", "identical assertion outcomes"]),
    ("margins", ["--sequential"], ["field 'margins'", "one margin over the battery"]),
    ("ok", ["--max-cases", "0"], ["--max-cases 0", "at least 1"]),
    ("ok", ["--max-seconds", "-1"], ["--max-seconds -1", "above 0"]),
    ("ok", ["--seed", "4"], ["--seed orders a sequential evaluation", "add --sequential"]),
])
def test_sequential_options_where_they_cannot_apply_are_exit_2(run_cli, tiny_ws, setup, options, words):
    wide_suite(tiny_ws, 4)
    if setup == "byte":
        (tiny_ws / "policies" / "lossy.yaml").write_text(f"flag: lossy\ngate: byte_equivalence\nchange: {LOSSY}\n")
    else:
        gate = "assertion_equivalence" if setup == "margin0eq" else "non_inferiority"
        extra = {"margin0": "", "margin0eq": "", "margins": "margin: 0.3\nmargins: {wide: 0.2}\n"}.get(setup, "margin: 0.3\n")
        policy(tiny_ws, gate, extra)
    code, out = evaluate(run_cli, tiny_ws, *options)
    assert code == 2, out
    for w in words:
        assert w in out["error"], out["error"]
    assert not (tiny_ws / "ledger" / "evidence.db").exists()  # nothing written


def test_an_interrupted_sequential_run_is_aborted_and_the_ledger_valid(run_cli, tiny_ws):
    (tiny_ws / "engines" / "interrupts.yaml").write_text(
        (tiny_ws / "engines" / "tiny.yaml").read_text().replace("adapter: torch", "adapter: fault_engines:InterruptsOn"))
    wide_suite(tiny_ws, CASES, within)
    (tiny_ws / "policies" / "lossy.yaml").write_text(
        "flag: lossy\ngate: non_inferiority\nchange: {engine: interrupts}\nprobes: off\ndistance: false\nmargin: 0.3\n")
    code, out, err = run_cli("--workspace", tiny_ws, "evaluate", "--flag", "lossy", "--engine", "tiny", "--operator",
                             "ci", "--suite", "wide", "--sequential", "--seed", "3", "--json")
    assert code == 130 and "recorded as aborted" in err
    with ledger(tiny_ws) as lg:
        ev = lg.evaluations()[0]
        record = lg.evaluation(ev["id"])
        assert record["status"] == "aborted" and record["verdict"] is None and lg.verify().ok
        assert record["case_results"]  # the cases that ran before the interruption are kept
