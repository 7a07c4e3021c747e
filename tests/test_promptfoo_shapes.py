"""promptfoo configs in the shapes people write them: several prompts (each its own stage), ``---`` prompt
files, bare paths, globs, labels, chat files, ``assertionTemplates``, ``defaultTest``, remote sources
(refused), a config in its own folder, cost and latency (always left out), and no refusal hidden by --limit."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import evaluate, ledger

from gatekeeper.battery import suites as battery
from gatekeeper.battery.suites import all_suites
from gatekeeper.errors import GatekeeperError
from gatekeeper.workspace import Workspace


def _write(ws: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (ws / "assertions" / name).parent.mkdir(parents=True, exist_ok=True)
        (ws / "assertions" / name).write_text(text)
    return ws


def _suites(ws: Path, files: dict[str, str]) -> dict:
    return {k: v for k, v in all_suites(Workspace(_write(ws, files))).items() if k != "tiny"}


def _refusal(ws: Path, files: dict[str, str]) -> str:
    with pytest.raises(GatekeeperError) as e:
        battery.read(Workspace(_write(ws, files)))
    return str(e.value)


def _texts(suite) -> list[tuple[str, str]]:
    return [(s.role, s.text) for s in suite.prompt]


TESTS = "tests:\n  - vars: {q: one}\n    assert: [{type: contains, value: o}]\n  - vars: {q: two}\n"


# --- the silent misreads of issue #28 --------------------------------------------------------------


def test_a_dashed_prompt_file_is_two_prompts_trimmed_as_promptfoo_trims(tiny_ws):
    suites = _suites(tiny_ws, {"faq.promptfoo.yaml": "prompts: [file://prompts.txt]\n" + TESTS,
                               "prompts.txt": "\n  Answer: {{q}}  \n\n---\nAnswer briefly:\n{{q}}\n  ---  \n\n"})
    assert sorted(suites) == ["faq.prompts-1", "faq.prompts-2"]
    assert _texts(suites["faq.prompts-1"]) == [("user", "Answer: {q}")]
    assert _texts(suites["faq.prompts-2"]) == [("user", "Answer briefly:\n{q}")]
    assert [c.id for c in suites["faq.prompts-2"].cases] == ["test 1", "test 2"]  # every test runs on every prompt


def test_a_bare_path_is_the_file(tiny_ws):
    suites = _suites(tiny_ws, {"faq.promptfoo.yaml": "prompts: [prompts.txt]\n" + TESTS, "prompts.txt": "Say {{q}}\n"})
    assert _texts(suites["faq"]) == [("user", "Say {q}")]


@pytest.mark.parametrize("prompt, why", [
    ("Rate it 1/5: {{q}}", "there is no such file"),  # a '/' makes it a path for promptfoo (maybeFilePath)
    ("file://missing.txt", "there is no such file"),
    ("prompt.js", "running code"),
])
def test_what_promptfoo_reads_as_a_path_is_never_the_text(tiny_ws, prompt, why):
    assert why in _refusal(tiny_ws, {"faq.promptfoo.yaml": f"prompts: ['{prompt}']\n" + TESTS})


@pytest.mark.parametrize("where", ["defaultTest", "test"])
def test_assert_scoring_function_is_refused_wherever_it_is(tiny_ws, where):
    fn = "assertScoringFunction: file://score.js"
    config = (f"prompts: ['{{{{q}}}}']\ndefaultTest:\n  {fn}\n" + TESTS if where == "defaultTest"
              else f"prompts: ['{{{{q}}}}']\ntests:\n  - vars: {{q: one}}\n    {fn}\n")
    message = _refusal(tiny_ws, {"faq.promptfoo.yaml": config})
    assert re.search(r"faq.promptfoo.yaml(: defaultTest|, test 1): field 'assertScoringFunction': not supported", message), message


def test_limit_hides_no_refusal(tiny_ws, run_cli):
    _write(tiny_ws, {"faq.promptfoo.yaml": "prompts: ['{{q}}']\ntests:\n  - vars: {q: one}\n"
                                           "  - vars: {q: two}\n    assert: [{type: webhook, value: 'http://x'}]\n"})
    with pytest.raises(GatekeeperError, match=r"test 2: assertion 1 \(webhook"):
        battery.read(Workspace(tiny_ws), ["faq"], limit=1)
    code, out, _ = run_cli("--workspace", tiny_ws, "evaluate", "--flag", "prefix_cache", "--engine", "tiny",
                           "--suite", "faq", "--limit", "1", "--json")
    assert code == 2 and "webhook" in json.loads(out)["error"]
    assert not (tiny_ws / "ledger" / "evidence.db").exists()


# --- several prompts ------------------------------------------------------------------------------

THREE = """prompts:
  - "Answer: {{q}}"
  - {id: file://long.txt, label: long form}
  - file://chat.json
tests:
  - vars: {q: one}
    assert: [{type: not-contains, value: zebra}]
  - vars: {q: two}
"""
CHAT = '[{"role": "system", "content": "You are terse."}, {"role": "user", "content": "{{q}}"}]'


@pytest.mark.slow
def test_three_prompts_gate_three_stages(tiny_ws, run_cli):
    _write(tiny_ws, {"faq.promptfoo.yaml": THREE,
                     "long.txt": "Answer at length: {{q}}\n", "chat.json": CHAT})
    code, outcome = evaluate(run_cli, tiny_ws, "tiny", "--limit", "1")
    assert code in (0, 1) and outcome["verdict"] in ("PASS", "FAIL", "INCONCLUSIVE"), outcome
    with ledger(tiny_ws) as lg:
        cases = {r["case_id"] for r in lg.evaluation(outcome["evaluation_id"])["case_results"]}
    assert {c for c in cases if c.startswith("faq")} == {"faq.prompt-1/test 1", "faq.long-form/test 1", "faq.chat/test 1"}


def test_labels_globs_mappings_and_chat_files(tiny_ws):
    suites = _suites(tiny_ws, {"faq.promptfoo.yaml": THREE,
                               "long.txt": "Answer at length: {{q}}\n", "chat.json": CHAT})
    assert sorted(suites) == ["faq.chat", "faq.long-form", "faq.prompt-1"]
    assert _texts(suites["faq.chat"]) == [("system", "You are terse."), ("user", "{q}")]
    assert suites["faq.long-form"].stage == "faq.long-form" and _texts(suites["faq.long-form"]) == [("user", "Answer at length: {q}")]
    suites = _suites(tiny_ws, {"faq.promptfoo.yaml": "prompts:\n  file://p/a.txt: concise\n  file://p/b.txt: concise\n"
                                                     "  file://chat.yaml: chat\n" + TESTS,
                               "p/a.txt": "A {{q}}", "p/b.txt": "B {{q}}\n---\nC {{q}}",
                               "chat.yaml": "- {role: user, content: 'Y {{q}}'}\n"})
    assert sorted(suites) == ["faq.chat", "faq.concise", "faq.concise-1", "faq.concise-2"]  # unique, stable names
    assert _texts(suites["faq.concise-2"]) == [("user", "C {q}")] and _texts(suites["faq.chat"]) == [("user", "Y {q}")]
    (tiny_ws / "assertions" / "chat.yaml").unlink()  # no config reads it now: it would be a (bad) suite
    suites = _suites(tiny_ws, {"faq.promptfoo.yaml": "prompts: ['file://p/*.txt']\n" + TESTS})
    assert sorted(suites) == ["faq.a", "faq.b-1", "faq.b-2"]


def test_a_tests_prompts_filter_chooses_its_stages(tiny_ws):
    config = ("prompts:\n  - {id: 'Short {{q}}', label: short}\n  - {id: 'Long {{q}}', label: long}\n"
              "tests:\n  - vars: {q: one}\n    prompts: [short]\n  - vars: {q: two}\n")
    suites = _suites(tiny_ws, {"faq.promptfoo.yaml": config})
    assert [c.id for c in suites["faq.short"].cases] == ["test 1", "test 2"]
    assert [c.id for c in suites["faq.long"].cases] == ["test 2"]
    assert "names 'shrt', which is no prompt's label" in _refusal(tiny_ws, {"faq.promptfoo.yaml": config.replace("[short]", "[shrt]")})


# --- templates, defaultTest, top-level keys -------------------------------------------------------


def test_assertion_templates_by_ref(tiny_ws):
    config = """assertionTemplates:
  polite: {type: icontains, value: please}
  short: {type: not-contains, value: zebra}
prompts: ['{{q}}']
defaultTest:
  assert: [{$ref: '#/assertionTemplates/short'}]
tests:
  - vars: {q: one}
    assert:
      - $ref: '#/assertionTemplates/polite'
      - {$ref: '#/assertionTemplates/polite', metric: manners}
"""
    (case,) = _suites(tiny_ws, {"faq.promptfoo.yaml": config})["faq"].cases
    assert [(a.type, a.value, a.name) for a in case.assert_] == [
        ("not-contains", "zebra", None), ("icontains", "please", None), ("icontains", "please", "manners")]
    message = _refusal(tiny_ws, {"faq.promptfoo.yaml": config.replace("'#/assertionTemplates/short'", "'#/assertionTemplates/terse'")})
    assert "faq.promptfoo.yaml, line 6: $ref '#/assertionTemplates/terse': no such entry" in message


def test_a_refusal_from_default_test_says_so(tiny_ws):
    message = _refusal(tiny_ws, {"faq.promptfoo.yaml": "prompts: ['{{q}}']\ndefaultTest:\n  options: {prefix: 'Q: '}\n" + TESTS})
    assert "faq.promptfoo.yaml: defaultTest (applies to every test): field 'options.prefix': not supported" in message
    message = _refusal(tiny_ws, {"faq.promptfoo.yaml": "prompts: ['{{q}}']\ndefaultTest:\n  assert: [{type: sounds-right}]\n" + TESTS})
    assert "faq.promptfoo.yaml: defaultTest, assertion 1 (in test 1): unknown assertion type 'sounds-right'" in message


def test_ignored_keys_warn_once_on_stderr_and_refused_keys_stop(tiny_ws, capsys):
    config = "prompts: ['{{q}}']\nderivedMetrics: []\nsomethingElse: 1\nproviders: [echo]\n" + TESTS
    suites = _suites(tiny_ws, {"faq.promptfoo.yaml": config})
    all_suites(Workspace(tiny_ws))  # read again: no second warning
    err = capsys.readouterr()
    assert err.out == "" and err.err.count("warning:") == 2, err.err
    assert "field 'derivedMetrics' is ignored" in err.err and "field 'somethingElse' is ignored" in err.err
    assert "providers" not in err.err and [c.id for c in suites["faq"].cases] == ["test 1", "test 2"]
    assert "field 'redteam': not supported" in _refusal(tiny_ws, {"faq.promptfoo.yaml": config + "redteam: {}\n"})


@pytest.mark.parametrize("entry, field", [
    ("tests: https://example.com/tests.csv", "tests"),
    ("tests: ['https://docs.google.com/spreadsheets/d/abc/edit']", "tests.0"),
    ("tests: huggingface://datasets/org/name", "tests"),
    ("tests: [{path: 'hf://datasets/org/name'}]", "tests.0"),
])
def test_remote_tests_are_refused_with_the_fix(tiny_ws, entry, field):
    message = _refusal(tiny_ws, {"faq.promptfoo.yaml": f"prompts: ['{{{{q}}}}']\n{entry}\n"})
    assert f"field '{field}'" in message and "fetched over the network" in message and "point 'tests:' at it" in message


def test_remote_prompts_are_refused(tiny_ws):
    message = _refusal(tiny_ws, {"faq.promptfoo.yaml": "prompts: ['https://example.com/prompt.txt']\n" + TESTS})
    assert "field 'prompts.0'" in message and "remote prompt" in message


# --- where configs live ---------------------------------------------------------------------------


def test_a_config_in_its_own_folder(tiny_ws):
    suites = _suites(tiny_ws, {
        "myapp.yaml": "suite: myapp\npromptfoo: myapp/promptfooconfig.yaml\ndecoding: {max_tokens: 5}\n",
        "myapp/promptfooconfig.yaml": "prompts: [prompts.txt]\ntests: tests.csv\n",
        "myapp/prompts.txt": "Hi {{q}}\n---\nBye {{q}}\n",
        "myapp/tests.csv": "q,__expected\none,contains:o\n"})
    assert sorted(suites) == ["myapp.prompts-1", "myapp.prompts-2"]
    assert suites["myapp.prompts-1"].decoding.max_tokens == 5 and suites["myapp.prompts-1"].promptfoo == "myapp/promptfooconfig.yaml"
    assert [a.value for a in suites["myapp.prompts-2"].cases[0].assert_] == ["o"]
    message = _refusal(tiny_ws, {"myapp.yaml": "suite: myapp\nstage: x\npromptfoo: myapp/promptfooconfig.yaml\n"})
    assert "myapp.yaml: field 'stage'" in message


def test_files_beside_a_config_are_not_suites(tiny_ws):
    suites = _suites(tiny_ws, {"faq.promptfoo.yaml": "prompts: [file://prompt.yaml]\ntests: [file://tests.yaml]\n",
                               "prompt.yaml": "- {role: user, content: '{{q}}'}\n",
                               "tests.yaml": "- vars: {q: one}\n  assert: [{type: contains, value: o}]\n",
                               # a gatekeeper suite's own prompt over the tests of a config beside it
                               "chat.yaml": "suite: chat\nstage: chat\nprompt: [{role: user, static: false, text: '{q}'}]\n"
                                            "promptfoo: bare.yaml\n",
                               "bare.yaml": "tests: [{vars: {q: two}}]\n"})
    assert sorted(suites) == ["chat", "faq"] and suites["faq"].cases[0].vars == {"q": "one"}
    assert suites["chat"].cases[0].vars == {"q": "two"}


# --- cost and latency -----------------------------------------------------------------------------


def test_cost_and_latency_are_left_out_with_their_reason(tiny_ws):
    config = ("prompts: ['{{q}}']\ndefaultTest:\n  assert: [{type: latency, threshold: 5000}]\n"
              "tests:\n  - vars: {q: one}\n    assert: [{type: cost, threshold: 0.01}, {type: contains, value: o}]\n")
    items = battery.read(Workspace(_write(tiny_ws, {"faq.promptfoo.yaml": config})), ["faq"])  # no --skip-unsupported needed
    assert [a.type for a in items[0].case.assert_] == ["contains"]
    assert battery.skipped(items) == [
        "skipped: faq/test 1: assertion 1 (latency: how long the call took, not a property of the output, which is what gatekeeper compares)",
        "skipped: faq/test 1: assertion 2 (cost: what the call cost, not a property of the output, which is what gatekeeper compares)"]


def test_test_files_without_file_prefix_jsonl_and_refs_inside_them(tiny_ws):
    suites = _suites(tiny_ws, {"faq.promptfoo.yaml": "prompts: [file://p.md]\ntests: [t.jsonl, 't/*.yaml']\n",
                               "p.md": "# Ask\n{{q}}\n",
                               "t.jsonl": '{"vars": {"q": "one"}, "assert": [{"type": "contains", "value": "o"}]}\n\n',
                               "t/a.yaml": "- vars: {q: two}\n  assert: [{type: contains, value: w}]\n"
                                           "- vars: {q: three}\n  assert: [{$ref: '#/0/assert/0'}]\n"})
    assert _texts(suites["faq"]) == [("user", "# Ask\n{q}\n")]  # a .md prompt is not trimmed (promptfoo trims .txt only)
    assert [c.vars for c in suites["faq"].cases] == [{"q": "one"}, {"q": "two"}, {"q": "three"}]
    assert [(a.type, a.value) for a in suites["faq"].cases[2].assert_] == [("contains", "w")]  # the $ref within t/a.yaml
    message = _refusal(tiny_ws, {"t/a.yaml": "- vars: {q: two}\n  assert: [{$ref: 'other.yaml#/c'}]\n"})
    assert "t/a.yaml: $ref 'other.yaml#/c': gatekeeper resolves references within the file" in message


def test_a_folder_prompt_is_refused(tiny_ws):
    (tiny_ws / "assertions" / "p").mkdir()
    message = _refusal(tiny_ws, {"faq.promptfoo.yaml": "prompts: [p/]\n" + TESTS})
    assert "is a folder, which promptfoo would send as the prompt text" in message and "p/*.txt" in message


def test_a_csv_config_column_sets_its_assertions_threshold(tiny_ws):
    # promptfoo counts __config:__expected<N> over the non-empty __expected cells
    header = "q,__expected1,__expected2,__expected3,__config:__expected2:threshold,__config:__expected:threshold\n"
    (case,) = _suites(tiny_ws, {"t.promptfoo.yaml": "prompts: ['{{q}}']\ntests: file://t.csv\n",
                                "t.csv": header + "one,,levenshtein:one,rouge-n:one,0.8,2\n"})["t"].cases
    assert [(a.type, a.threshold) for a in case.assert_] == [("levenshtein", 2.0), ("rouge-n", 0.8)]


@pytest.mark.parametrize("column, value", [("__config:__expected0:threshold", "1"), ("__config:__expected:weight", "1"),
                                           ("__config:__expected:threshold", "high")])
def test_a_bad_csv_config_column_is_refused(tiny_ws, column, value):
    message = _refusal(tiny_ws, {"t.promptfoo.yaml": "prompts: ['{{q}}']\ntests: file://t.csv\n",
                                 "t.csv": f"q,__expected,{column}\none,contains:o,{value}\n"})
    assert f"t.csv, line 2: column {column}" in message


def test_a_file_rubric_prompt_is_read_beside_the_config(tiny_ws):
    (case,) = _suites(tiny_ws, {"g.promptfoo.yaml": "prompts: ['{{q}}']\ntests:\n  - vars: {q: hi}\n    assert:\n"
                                "      - {type: llm-rubric, value: polite, rubricPrompt: file://rubric.txt}\n",
                                "rubric.txt": "Grade {{ output }} against {{ rubric }}"})["g"].cases
    assert case.assert_[0].options["rubricPrompt"] == "Grade {{ output }} against {{ rubric }}"


def test_a_glob_var_gives_one_case_per_file(tiny_ws):
    """promptfoo's generateVarCombinations: a file:// var is globbed and each file is a test of its own."""
    config = "prompts: ['Sum up: {{article}}']\ntests:\n  - vars: {article: 'file://articles/*.txt', tone: [dry, warm]}\n"
    files = {"faq.promptfoo.yaml": config, "articles/b.txt": "  second\n", "articles/a.txt": "first\n"}
    cases = _suites(tiny_ws, files)["faq"].cases
    assert [(c.vars["article"], c.vars["tone"]) for c in cases] == [
        ("first", "dry"), ("first", "warm"), ("second", "dry"), ("second", "warm")]  # each file trimmed, as promptfoo reads it
    assert len({c.id for c in cases}) == 4
    no_expansion = config.replace("tone: [dry, warm]}", "tone: dry}\n    options: {disableVarExpansion: true}")
    assert "a glob only with var expansion on" in _refusal(tiny_ws, {"faq.promptfoo.yaml": no_expansion})
    assert "matches no file" in _refusal(tiny_ws, {"faq.promptfoo.yaml": config.replace("*.txt", "*.md")})
    assert "matches c.yaml" in _refusal(tiny_ws, {"faq.promptfoo.yaml": config.replace("*.txt", "*"), "articles/c.yaml": "x: 1\n"})


def test_vars_lose_one_trailing_newline_as_promptfoo_prepares_them(tiny_ws):
    """promptfoo's renderPrompt drops a var's trailing newline (a YAML block keeps one) and fills ``{{ name }}``
    inside a var, for the prompt and for the assertions that read the vars."""
    config = ("prompts: ['Say {{x}}!']\ntests:\n  - vars:\n      name: Ana\n      x: |\n        hello {{name}}\n"
              "    assert: [{type: javascript, value: \"context.vars.x === 'hello Ana'\"}]\n")
    (case,) = _suites(tiny_ws, {"faq.promptfoo.yaml": config})["faq"].cases
    assert case.vars["x"] == "hello Ana"
