"""The default assertion battery (assertions/*.yaml at the repository root), mined from the candidate
pool in bench/candidates/.

Fast: no model runs here. Prompts are rendered with the default model's tokenizer only, and the
assertions are scored against outputs recorded by bench/record_battery.py (the pool's too).
"""

import importlib.util
import json
from collections import defaultdict

import pytest
from conftest import ROOT

from gatekeeper.battery import checks, partition
from gatekeeper.battery import suites as battery
from gatekeeper.battery.suites import all_suites
from gatekeeper.workspace import Workspace

SUITES = {"router", "specialist", "synthesizer", "planner"}
RECORDED = ROOT / "tests" / "data" / "battery_outputs.json"
CANDIDATES = ROOT / "tests" / "data" / "candidate_outputs.json"
RECORD = "run: .venv/bin/python bench/record_battery.py"


def _recorder():
    spec = importlib.util.spec_from_file_location("record_battery", ROOT / "bench" / "record_battery.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def ws():
    return Workspace(ROOT)


@pytest.fixture(scope="module")
def items(ws):
    return battery.read(ws)


@pytest.fixture(scope="module")
def chat():
    """The default model's chat template and tokenizer (prepared once, under $GATEKEEPER_HOME)."""
    return _recorder().load_chat()


@pytest.fixture(scope="module")
def recorded():
    assert RECORDED.is_file(), f"{RECORDED} is missing; {RECORD}"
    return json.loads(RECORDED.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def pool():
    """The candidate pool's recorded outputs."""
    assert CANDIDATES.is_file(), f"{CANDIDATES} is missing; {RECORD} --candidates"
    return json.loads(CANDIDATES.read_text(encoding="utf-8"))


def _by_suite(items):
    out = defaultdict(list)
    for item in items:
        out[item.suite.suite].append(item)
    return out


def test_default_battery_is_mined_for_power(ws, items):
    assert {i.suite.suite for i in items} == SUITES
    assert all(len(its) >= 4 for its in _by_suite(items).values())
    assert all(len(i.case.assert_) >= 5 for i in items)
    # every case was chosen from the pool because planted faults change its outputs (test_shipped_power.py
    # measures it again on the model)
    for suite in all_suites(ws).values():
        assert suite.mined_on is not None and {"shift", "drop"} <= set(suite.mined_on.faults or []), suite.suite
        for case in suite.cases:
            assert case.mined.source.startswith(f"bench/candidates/{suite.suite}.yaml#"), case.mined.source
            assert {"shift", "drop"} <= set(case.mined.catches or []), case.id


def test_the_candidate_pool_is_recorded_and_current(pool, tmp_path):
    recorder = _recorder()
    cws = recorder.candidates_workspace(tmp_path)
    its = battery.read(cws)
    assert len(its) >= 64 and {i.suite.suite for i in its} == SUITES
    stale = [i.case_id for i in its if pool["prompts"].get(i.case_id) != recorder.case_digest(cws, i)]
    assert not stale, f"recorded candidate outputs are stale for {stale}; {RECORD} --candidates"


def test_every_suite_writes_dynamic_content_before_static(ws):
    for suite in all_suites(ws).values():
        assert not suite.prompt[0].static, suite.suite
        assert any(seg.static for seg in suite.prompt), suite.suite


def test_static_prefixes_are_long_and_only_partitioning_exposes_them(ws, items, chat):
    for name, its in _by_suite(items).items():
        seen = []
        for item in its:
            case = item.case
            pieces = partition.pieces(ws, item.suite, {**case.vars, **(case.turns[0] if case.turns else {})})
            written = partition.render(chat, pieces, "as_written")
            split = partition.render(chat, pieces, "partitioned")
            assert split.static_tokens >= 1000, f"{name}: partitioned static prefix {split.static_tokens} tokens"
            assert written.static_tokens < split.static_tokens, name
            seen.append(split.tokens[: split.static_tokens])
        # the prefix is byte-for-byte the same in every case of the suite: one pinnable prefix per stage
        assert all(s == seen[0] for s in seen), name


def test_planner_has_chained_turns(ws, items, chat):
    chained = [i for i in items if i.suite.suite == "planner" and len(i.case.turns) >= 2]
    assert len(chained) >= 2 and any(len(i.case.turns) >= 3 for i in chained)
    assert all_suites(ws)["planner"].prompt[-1].role == "user"
    # turn 2's prompt extends turn 1's transcript with the answer and the new user message
    item = chained[0]
    values = {**item.case.vars, **item.case.turns[0]}
    first = partition.render(chat, partition.pieces(ws, item.suite, values), "partitioned")
    history = [*first.messages, {"role": "assistant", "content": "Action: x()"}]
    values.update(item.case.turns[1])
    second = partition.render(chat, partition.pieces(ws, item.suite, values), "partitioned", history)
    assert second.text.startswith(first.text + "Action: x()")


def test_recorded_outputs_cover_every_case_and_are_current(ws, items, recorded):
    digest = _recorder().case_digest
    missing = [i.case_id for i in items if i.case_id not in recorded["outputs"]]
    assert not missing, f"no recorded output for {missing}; {RECORD}"
    stale = [i.case_id for i in items if recorded["prompts"].get(i.case_id) != digest(ws, i)]
    assert not stale, f"recorded outputs are stale (prompt, vars or decoding changed) for {stale}; {RECORD}"
    for item in items:
        if item.case.turns:
            assert len(recorded["turns"][item.case_id]) == len(item.case.turns), item.case_id


def test_no_assertion_is_vacuous(items, recorded, pool):
    """Each assertion fails on "" or on another recorded output of the same suite (shipped or in the pool)."""
    outputs = recorded["outputs"]
    vacuous = []
    for name, its in _by_suite(items).items():
        for item in its:
            others = [""] + [outputs.get(o.case_id, "") for o in its if o is not item] + [
                text for cid, text in pool["outputs"].items() if cid.startswith(f"{name}/") and cid != item.case_id]
            for n, a in enumerate(item.case.assert_, 1):
                if all(checks.check(a, text) for text in others):
                    vacuous.append(f"{item.case_id} #{n} {a.type} {a.value!r}")
    assert not vacuous, "assertions that nothing makes fail:\n" + "\n".join(vacuous)


def test_recorded_outputs_pass_most_assertions(items, recorded):
    """Calibrated on the default model: most assertions pass, the rest fail deterministically (the pool
    was written to pass 70% in every suite; the cases mined from it keep two in three)."""
    for name, its in _by_suite(items).items():
        results = [checks.check(a, recorded["outputs"].get(i.case_id, "")) for i in its for a in i.case.assert_]
        assert sum(results) / len(results) >= 2 / 3, f"{name}: {sum(results)}/{len(results)} pass"
