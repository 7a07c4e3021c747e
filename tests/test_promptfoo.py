"""promptfoo configs as suites: inline and file:// tests, CSV __expected columns, defaultTest, unsupported types."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gatekeeper.battery import checks
from gatekeeper.battery import suites as battery
from gatekeeper.battery.suites import all_suites
from gatekeeper.errors import GatekeeperError
from gatekeeper.workspace import Workspace

CONFIG = """description: FAQ bot, as a promptfoo user wrote it
providers: [echo]
prompts:
  - "Answer briefly: {{question}}"
defaultTest:
  vars: {topic: general}
  assert:
    - {type: not-contains, value: zebra}
tests:
  - description: arithmetic
    vars: {question: "What is 2+2?"}
    assert:
      - {type: contains-any, value: "4, four"}
      - {type: moderation}
  - file://faq.csv
  - description: expands
    vars: {question: [one, two]}
    assert:
      - {type: icontains, value: "{{ question }}"}
"""
CSV = 'question,__expected1,__expected2,__description\n"Capital of France?",icontains:paris,"contains-any:Paris,France",capital\n' \
      '"Name a colour",not-contains:zebra,,colour\n'


@pytest.fixture
def pf_ws(tiny_ws: Path) -> Path:
    (tiny_ws / "assertions" / "faq.promptfoo.yaml").write_text(CONFIG)
    (tiny_ws / "assertions" / "faq.csv").write_text(CSV)
    return tiny_ws


def test_config_reads_as_a_suite(pf_ws):
    suite = all_suites(Workspace(pf_ws))["faq"]
    assert suite.stage == "faq" and suite.promptfoo == "faq.promptfoo.yaml"
    assert [(s.role, s.static, s.text) for s in suite.prompt] == [("user", False, "Answer briefly: {question}")]
    assert [c.id for c in suite.cases] == ["arithmetic", "capital", "colour", "expands [1]", "expands [2]"]
    arithmetic, capital, colour, one, two = suite.cases
    assert arithmetic.vars == {"topic": "general", "question": "What is 2+2?"}
    # defaultTest's assertions come first; the comma-separated value splits as promptfoo splits it
    assert [(a.type, a.value) for a in arithmetic.assert_] == [("not-contains", "zebra"), ("contains-any", "4, four")]
    assert checks.check(arithmetic.assert_[1], "four") and not checks.check(arithmetic.assert_[1], "five")
    assert [(a.type, a.value) for a in capital.assert_] == [("not-contains", "zebra"), ("icontains", "paris"),
                                                             ("contains-any", ["Paris", "France"])]
    assert len(colour.assert_) == 2
    assert one.vars["question"] == "one" and one.assert_[1].value == "one" and two.assert_[1].value == "two"  # templated
    assert suite.skipped == ("arithmetic: assertion 3 (moderation: not deterministic or not implemented in gatekeeper)",)


def test_unsupported_is_refused_unless_skipped(pf_ws):
    ws = Workspace(pf_ws)
    with pytest.raises(GatekeeperError, match=r"faq.promptfoo.yaml: arithmetic: assertion 3 \(moderation") as e:
        battery.read(ws, ["faq"])
    assert "--skip-unsupported" in str(e.value)
    items = battery.read(ws, ["faq"], skip_unsupported=True)
    assert battery.skipped(items) == ["skipped: faq/arithmetic: assertion 3 (moderation: not deterministic or not implemented in gatekeeper)"]
    assert battery.skipped(battery.read(ws, ["faq"], limit=1, skip_unsupported=True)[:0]) == []


def test_evaluate_exits_2_then_lists_the_skipped_in_its_reasons(run_cli, pf_ws):
    args = ("--workspace", pf_ws, "evaluate", "--flag", "prefix_cache", "--engine", "tiny", "--suite", "faq", "--json")
    code, out, _ = run_cli(*args)
    assert code == 2 and "arithmetic: assertion 3 (moderation" in json.loads(out)["error"]
    assert not (pf_ws / "ledger" / "evidence.db").exists()
    code, out, _ = run_cli(*args, "--skip-unsupported")
    outcome = json.loads(out)
    assert code in (0, 1) and outcome["verdict"] in ("PASS", "FAIL", "INCONCLUSIVE"), out
    assert "skipped: faq/arithmetic: assertion 3 (moderation: not deterministic or not implemented in gatekeeper)" in outcome["reasons"]
    code, out, _ = run_cli("--workspace", pf_ws, "ledger", "show", str(outcome["evaluation_id"]), "--json")
    assert "skipped: faq/arithmetic" in out  # the reasons are the ledger's, not only the command's


def test_a_gatekeeper_suite_takes_its_cases_from_a_promptfoo_key(tiny_ws):
    (tiny_ws / "evals").mkdir()  # outside assertions/, where every *.yaml is a suite
    (tiny_ws / "evals" / "tests.yaml").write_text(
        "tests:\n  - vars: {query: hi}\n    assert: [{type: equals, value: 4}, {type: contains-all, value: 'a, b'}]\n")
    (tiny_ws / "assertions" / "chat.yaml").write_text(
        "suite: chat\nstage: chat\nprompt:\n  - {role: user, static: false, text: '{query}'}\npromptfoo: evals/tests.yaml\n")
    (suite,) = [s for s in all_suites(Workspace(tiny_ws)).values() if s.suite == "chat"]
    (case,) = suite.cases
    assert case.id == "test 1" and [a.value for a in case.assert_] == [4, "a, b"]
    assert checks.check(case.assert_[0], "4") and checks.check(case.assert_[1], "b a")


def _bad(ws: Path, files: dict[str, str]) -> str:
    for name, text in files.items():
        (ws / "assertions" / name).write_text(text)
    with pytest.raises(GatekeeperError) as e:
        battery.read(Workspace(ws))
    return str(e.value)


@pytest.mark.parametrize("files, expected", [
    ({"faq.promptfoo.yaml": "prompts: ['{{q}}']\ntests:\n  - vars: {q: [\n"}, r"faq.promptfoo.yaml: not valid YAML \(line 4, column 1\)"),
    ({"faq.promptfoo.yaml": "prompts: ['{{q}}']\ntests:\n  - file://nowhere.csv\n"}, r"faq.promptfoo.yaml, line 3: file://nowhere.csv not found"),
    ({"faq.promptfoo.yaml": "prompts: ['{{q}}']\ntests: file://t.csv\n", "t.csv": 'q,__expected\nhi,icontains:hi\nho,"contains-any:""a,b"\n'},
     r"t.csv, line 3: __expected 'contains-any:\"a,b' is malformed: .* unterminated quoted field"),
    ({"faq.promptfoo.yaml": "prompts: ['{{q}}']\ntests: file://t.csv\n", "t.csv": "q,__expected\nhi,contains:\n"},
     r"t.csv, line 2, assertion 1: 'value' must be a non-empty string or a number"),
    ({"faq.promptfoo.yaml": "prompts: ['{{q}}']\ntests: [{vars: {q: x}, assert: [{type: max-length, value: 3}]}]\n"},
     r"type 'max-length' is gatekeeper's own, not promptfoo's"),
    ({"faq.promptfoo.yaml": "prompts: ['{{q}}']\ntests: [{vars: {q: x}, assert: [{type: sounds-right}]}]\n"},
     r"faq.promptfoo.yaml, test 1, assertion 1: unknown assertion type 'sounds-right'"),
    ({"faq.promptfoo.yaml": "prompts: ['{{q}}']\ntests: [{vars: {q: x}, assert: [{type: contains, value: true}]}]\n"},
     r"test 1, assertion 1: 'value' must be a non-empty string or a number"),
    ({"faq.promptfoo.yaml": "prompts: ['{{q}}']\ntests: [{vars: {q: x}, assert: [{type: regex, value: '(?i)x'}]}]\n"},
     r"'value' is not a valid regular expression"),
    ({"faq.promptfoo.yaml": "prompts: ['{{q}}', {id: 'x', lable: y}]\ntests: [{vars: {q: x}}]\n"}, r"field 'prompts.1.lable': not a promptfoo prompt key"),
    ({"faq.promptfoo.yaml": "prompts: ['{{q | shout}}']\ntests: [{vars: {q: x}}]\n"}, r"faq.promptfoo.yaml: field 'prompts.0'.*shout"),
    ({"faq.promptfoo.yaml": "prompts: ['{{q}}']\nscenarios: []\ntests: [{vars: {q: x}}]\n"}, r"field 'scenarios': not supported"),
    ({"faq.promptfoo.yaml": "prompts: ['{{q}}']\ntests: [{vars: {q: x}, options: {suffix: '!'}}]\n"}, r"options.suffix"),
])
def test_bad_configs_name_the_file_and_line(tiny_ws, files, expected):
    import re

    assert re.search(expected, _bad(tiny_ws, files)), _bad(tiny_ws, files)


@pytest.mark.parametrize("bad", ['prompts: ["{{q}}"]\ntests: [\n', 'prompts: ["{{q}}"]\ntests: [file://none.yaml]\n'])
def test_bad_configs_exit_2_and_write_nothing(run_cli, tiny_ws, bad):
    (tiny_ws / "assertions" / "faq.promptfoo.yaml").write_text(bad)
    before = sorted(p.relative_to(tiny_ws) for p in tiny_ws.rglob("*"))
    code, out, _ = run_cli("--workspace", tiny_ws, "evaluate", "--flag", "prefix_cache", "--engine", "tiny", "--json")
    assert code == 2 and "faq.promptfoo.yaml" in json.loads(out)["error"] and "line" in json.loads(out)["error"]
    assert sorted(p.relative_to(tiny_ws) for p in tiny_ws.rglob("*")) == before


def test_native_suites_template_values_from_their_vars(tiny_ws):
    text = (tiny_ws / "assertions" / "tiny.yaml").read_text()
    (tiny_ws / "assertions" / "tiny.yaml").write_text(
        text.replace("assert: [{type: max-length, value: 10000}]\n  - id: b", "assert: [{type: contains, value: '{{ session }}'}]\n  - id: b", 1))
    item = battery.read(Workspace(tiny_ws), ["tiny"])[0]
    assert item.case.assert_[0].value == "user=ana"


def test_file_values_and_vars(tiny_ws):
    folder = tiny_ws / "assertions"
    (folder / "word.txt").write_text("  cat\n")
    (folder / "words.json").write_text('["dog", "cow"]')
    (folder / "faq.promptfoo.yaml").write_text(
        "prompts: ['Say {{q}}']\ntests:\n  - vars: {q: file://word.txt}\n    assert:\n"
        "      - {type: contains, value: '{{ q }}s'}\n      - {type: contains-any, value: file://words.json}\n"
        "      - {type: equals, value: file://word.txt}\n")
    suite = all_suites(Workspace(tiny_ws))["faq"]
    (case,) = suite.cases
    assert case.vars == {"q": "cat"}
    assert [a.value for a in case.assert_] == ["cats", ["dog", "cow"], "cat"]
    assert suite.skipped == ()


def test_test_files_by_glob_json_and_yaml(tiny_ws):
    folder = tiny_ws / "evals"
    folder.mkdir()
    (folder / "a.yaml").write_text("- vars: {q: one}\n  assert: [{type: starts-with, value: 'o'}]\n")
    (folder / "b.json").write_text('[{"description": "two", "vars": {"q": "two"}, "assert": [{"type": "not-equals", "value": "x"}]}]')
    (tiny_ws / "assertions" / "faq.promptfoo.yaml").write_text("prompts: ['{{q}}']\ntests: [file://../evals/*]\n")
    suite = all_suites(Workspace(tiny_ws))["faq"]
    assert [c.id for c in suite.cases] == ["Row #1", "two"]
    assert [c.assert_[0].type for c in suite.cases] == ["starts-with", "not-equals"]
