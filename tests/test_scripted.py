"""javascript and python assertions: the suite's own code, run in a worker as promptfoo runs it.

Inline and file forms, each kind of result (boolean, number against threshold, GradingResult), errors,
the context the code sees, how promptfoo configs and CSV columns name them, and a timeout: a refusal
that aborts the evaluation (exit 2, no verdict), never an outcome.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from conftest import evaluate, ledger

from gatekeeper.battery import checks, scripted
from gatekeeper.battery import suites as battery
from gatekeeper.battery.suites import all_suites
from gatekeeper.errors import GatekeeperError
from gatekeeper.workspace import Assertion, Workspace

CONTEXT = checks.Context(vars={"city": "Porto"}, prompt="Where is Porto?")

JS_FILE = """
module.exports = (output, context) => output.includes(context.vars.city);
module.exports.score = (output) => output.length / 10;
module.exports.graded = (output) => ({pass: output.startsWith('P'), score: 0.5, reason: 'starts with ' + output[0]});
module.exports.boom = () => { throw new Error('no luck'); };
module.exports.text = () => 'yes';
"""
PY_FILE = """
def get_assert(output, context):
    return context["vars"]["city"] in output

def score(output, context):
    return len(output) / 10

def graded(output, context):
    return {"pass_": output.startswith("P"), "score": 0.5, "reason": "starts with " + output[:1]}

def boom(output, context):
    raise ValueError("no luck")

async def later(output, context):
    return True
"""


@pytest.fixture(scope="module")
def scripts(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("scripts")
    (folder / "check.js").write_text(JS_FILE)
    (folder / "check.py").write_text(PY_FILE)
    return folder


def outcome(kind: str, value, output: str, threshold: float | None = None) -> dict:
    a = Assertion(type=kind, value=value, threshold=threshold)
    checks.prepare(a)
    return checks.evaluate(a, output, CONTEXT)


INLINE = [
    # (type, value, threshold, output, pass)
    ("javascript", "output.includes(context.vars.city)", None, "Porto is in Portugal", True),
    ("javascript", "output.includes(context.vars.city)", None, "Lisbon", False),
    ("not-javascript", "output.includes('x')", None, "abc", True),
    ("javascript", "const n = output.length; n > 3", None, "abcd", True),  # declarations, then the value
    ("javascript", "if (context.prompt.startsWith('Where')) {\n  return 1;\n}\nreturn 0;\n", None, "", True),
    ("javascript", "output.length / 10", None, "", False),  # 0: a number passes only above 0
    ("javascript", "output.length / 10", 0.5, "abcd", False),
    ("javascript", "output.length / 10", 0.5, "abcde", True),
    ("javascript", "({pass: output === 'ok', score: 0.1, reason: 'checked'})", 0.5, "ok", True),  # no threshold on JS objects
    ("javascript", "({pass: true})", None, "ok", False),  # not a GradingResult: no score, no reason
    ("javascript", "Promise.resolve(output === 'ok')", None, "ok", True),
    ("python", "context['vars']['city'] in output", None, "Porto!", True),
    ("python", "output == 'Porto'", None, "porto", False),
    ("not-python", "output == 'Porto'", None, "porto", True),
    ("python", "len(output) / 10", 0.5, "abcde", True),
    ("python", "len(output) / 10", 0.5, "abcd", False),
    ("python", "'0.7'", None, "", True),  # a string is read as JavaScript's parseFloat reads it
    ("python", "'TRUE'", None, "", True),
    ("python", "if output:\n    return {'pass': True, 'score': 0.4, 'reason': 'fine'}\nreturn False", 0.5, "x", False),
    ("python", "if output:\n    return {'pass': True, 'score': 0.6, 'reason': 'fine'}\nreturn False", 0.5, "x", True),
    ("python", "json.dumps(context['vars'])", None, "", False),  # '{"city": ...}': JSON, but no GradingResult
]


@pytest.mark.parametrize("kind,value,threshold,output,passed", INLINE)
def test_inline_code(kind, value, threshold, output, passed):
    assert outcome(kind, value, output, threshold)["pass"] is passed


@pytest.mark.parametrize("language,suffix", [("javascript", "js"), ("python", "py")])
def test_files_and_their_functions(scripts, language, suffix):
    f = f"file://{scripts / f'check.{suffix}'}"
    assert outcome(language, f, "Porto")["pass"] and not outcome(language, f, "Lisbon")["pass"]  # default export / get_assert
    assert outcome(language, f"{f}:score", "abcdef", 0.5) == {"pass": True, "score": 0.6, "reason": "Assertion passed"}
    assert not outcome(language, f"{f}:score", "abcd", 0.5)["pass"]
    graded = outcome(language, f"{f}:graded", "Porto")
    assert graded == {"pass": True, "score": 0.5, "reason": "starts with P"}
    assert not outcome(language, f"{f}:graded", "Lisbon")["pass"]
    assert outcome(f"not-{language}", f"{f}:graded", "Lisbon")["pass"]


def test_typescript_files_run_as_promptfoo_runs_them(tmp_path):
    """node 22 strips the types: a .ts assertion with annotations and an ES default export runs."""
    ts = tmp_path / "check.ts"
    ts.write_text("export default function (output: string, context: {vars: Record<string, string>}): boolean {\n"
                  "  const wanted: string = context.vars.city;\n  return output.includes(wanted);\n}\n")
    assert outcome("javascript", f"file://{ts}", "Porto!")["pass"]
    assert not outcome("javascript", f"file://{ts}", "Lisbon")["pass"]


def test_python_grading_result_below_threshold_fails(scripts):
    got = outcome("python", f"file://{scripts / 'check.py'}:graded", "Porto", threshold=0.8)
    assert got["pass"] is False and got["reason"] == "Python score 0.5 is less than threshold 0.8: starts with P"
    assert outcome("python", f"file://{scripts / 'check.py'}:later", "x")["pass"]  # a coroutine runs to its end


@pytest.mark.parametrize("kind,value,reason", [
    ("javascript", "{file}.js:boom", "Custom function threw error: no luck"),
    ("javascript", "{file}.js:text", "Custom function threw error: Javascript assertion script must return a boolean"),
    ("javascript", "JSON.parse(output).x", "Custom function threw error: Unexpected token"),
    ("javascript", "undefinedName > 1", "Custom function threw error: undefinedName is not defined"),
    ("python", "{file}.py:boom", "Python code execution failed: ValueError: no luck"),
    ("python", "1 / 0", "Python code execution failed: ZeroDivisionError: division by zero"),
    ("python", "None", "Python code execution failed: Python assertion must return a boolean, number"),
    ("python", "float('nan')", "Python code execution failed: ValueError: Out of range float values"),
    ("python", "output ==", "Python code execution failed: SyntaxError"),
])
def test_an_error_fails_the_assertion_with_its_reason_and_not_inverts_nothing(scripts, kind, value, reason):
    value = value.format(file=f"file://{scripts / 'check'}")
    for k in (kind, f"not-{kind}"):  # promptfoo fails an assertion whose code errs, not- or not
        got = outcome(k, value, "not json")
        assert got["pass"] is False and got["score"] == 0 and got["reason"].startswith(reason), got


def test_printing_does_not_disturb_the_answers():
    assert outcome("javascript", "console.log('\\n{}\\n');\nprocess.stdout.write('x\\n');\nreturn true", "")["pass"]
    assert outcome("python", "print('{}\\n') or __import__('os').write(1, b'x\\n') and True", "")["pass"]


def test_a_worker_that_times_out_or_dies_is_replaced():
    w = scripted.Worker(scripted.command("python"))
    try:
        ask = {"code": "len(output)", "file": None, "fn": None, "output": "ab", "context": {}}
        assert w.call(ask, 30) == {"value": 2}
        first = w._proc.pid
        with pytest.raises(TimeoutError):
            w.call({**ask, "code": "__import__('time').sleep(30)"}, 0.5)
        assert w._proc is None  # killed
        assert w.call(ask, 30) == {"value": 2} and w._proc.pid != first
        assert "exited (code 3)" in w.call({**ask, "code": "__import__('os')._exit(3)"}, 30)["error"]
        assert w.call(ask, 30) == {"value": 2}
    finally:
        w.close()


@pytest.mark.parametrize("kind,value,message", [
    ("javascript", 42, "'value' must be javascript code"),
    ("python", "  ", "'value' must be python code"),
    ("python", "file://{dir}/check.js", "a python assertion's file must end in .py"),
    ("javascript", "file://{dir}/check.rb", "a javascript assertion's file must end in .js or"),
    ("javascript", "file://check.js", "a relative script path in a gatekeeper suite"),
    ("python", "file://{dir}/nowhere.py", "no such file"),
])
def test_values_it_cannot_run_are_refused_at_load(scripts, kind, value, message):
    value = value.format(dir=scripts) if isinstance(value, str) else value
    with pytest.raises(checks.Refused, match=message):
        checks.prepare(Assertion(type=kind, value=value))


def test_javascript_without_node_names_make_promptfoo(monkeypatch, tmp_path):
    monkeypatch.setattr(scripted.promptfoo_setup, "node", lambda: tmp_path / "no-node")
    with pytest.raises(checks.Refused, match="run 'make promptfoo'"):
        checks.prepare(Assertion(type="javascript", value="true"))
    checks.prepare(Assertion(type="python", value="True"))  # Python needs no node


@pytest.mark.parametrize("raw", ["0", "-1", "soon"])
def test_a_bad_timeout_setting_is_exit_2(monkeypatch, raw):
    monkeypatch.setenv(scripted.TIMEOUT_ENV, raw)
    with pytest.raises(GatekeeperError, match=scripted.TIMEOUT_ENV):
        outcome("python", "True", "")


CONFIG = """prompts: ["Say hello to {{city}}"]
tests:
  - description: files
    vars: {city: Porto}
    assert:
      - {type: javascript, value: "file://checks/check.js"}
      - {type: python, value: "file://checks/check.py:score", threshold: 0.5}
  - file://cases.csv
"""
CSV = ('city,__expected1,__expected2,__expected3,__expected4,__expected5\n'
       'Porto,javascript: output.includes(context.vars.city),fn:output.length > 2,eval:true,python: len(output) > 2,'
       '"not-python:output == \'x\'"\n')


def test_a_promptfoo_config_runs_its_scripts_beside_it(tiny_ws, scripts):
    (tiny_ws / "assertions" / "checks").mkdir()
    for name in ("check.js", "check.py"):
        (tiny_ws / "assertions" / "checks" / name).write_text((scripts / name).read_text())
    (tiny_ws / "assertions" / "hello.promptfoo.yaml").write_text(CONFIG)
    (tiny_ws / "assertions" / "cases.csv").write_text(CSV)
    files, row = all_suites(Workspace(tiny_ws))["hello"].cases
    here = tiny_ws / "assertions" / "checks"
    assert [(a.type, a.value, a.threshold) for a in files.assert_] == [
        ("javascript", f"file://{here / 'check.js'}", None), ("python", f"file://{here / 'check.py'}:score", 0.5)]
    assert [(a.type, a.value) for a in row.assert_] == [
        ("javascript", "output.includes(context.vars.city)"), ("javascript", "output.length > 2"), ("javascript", "true"),
        ("python", "len(output) > 2"), ("not-python", "output == 'x'")]
    context = checks.Context(vars=files.vars, prompt="")
    assert [o["pass"] for o in checks.outcomes(files.assert_, "Porto!", context)] == [True, True]
    assert [o["pass"] for o in checks.outcomes(files.assert_, "Lisbon", context)] == [False, True]


def test_the_battery_digest_follows_the_script_not_where_the_workspace_lies(tiny_ws, scripts, tmp_path):
    import shutil

    (tiny_ws / "assertions" / "checks").mkdir()
    for name in ("check.js", "check.py"):
        (tiny_ws / "assertions" / "checks" / name).write_text((scripts / name).read_text())
    (tiny_ws / "assertions" / "hello.promptfoo.yaml").write_text(CONFIG)
    (tiny_ws / "assertions" / "cases.csv").write_text(CSV)

    def battery_digest(root):
        ws = Workspace(root)
        return battery.battery_digest(ws, battery.read(ws, ["hello"]))

    before = battery_digest(tiny_ws)
    moved = shutil.copytree(tiny_ws, tmp_path / "moved")
    assert battery_digest(moved) == before  # the absolute script paths do not enter the digest
    script = tiny_ws / "assertions" / "checks" / "check.py"
    script.write_text(script.read_text() + "\n# edited\n")
    assert battery_digest(tiny_ws) != before  # an edited script makes the evidence stale


def test_a_csv_file_py_expectation_is_refused_with_the_fix(tiny_ws):
    (tiny_ws / "assertions" / "hello.promptfoo.yaml").write_text('prompts: ["{{name}}"]\ntests: file://cases.csv\n')
    (tiny_ws / "assertions" / "cases.csv").write_text("name,__expected\nPorto,file://check.py\n")
    with pytest.raises(GatekeeperError, match=r"cases.csv, line 2: .*write 'python:file://check.py'"):
        all_suites(Workspace(tiny_ws))


def test_a_gatekeeper_suite_may_use_them(tiny_ws):
    (tiny_ws / "assertions" / "own.yaml").write_text(
        "suite: own\nstage: own\nprompt: [{role: user, static: false, text: '{q}'}]\ncases:\n  - id: one\n    vars: {q: hi}\n"
        "    assert: [{type: python, value: \"context['vars']['q'] == 'hi'\"}, {type: not-javascript, value: \"output === ''\"}]\n")
    (item,) = battery.read(Workspace(tiny_ws), ["own"])
    context = checks.Context(vars=item.case.vars, prompt="hi")
    assert [o["pass"] for o in checks.outcomes(list(item.case.assert_), "hello", context)] == [True, True]
    assert [o["pass"] for o in checks.outcomes(list(item.case.assert_), "", context)] == [True, False]


EVALUATED = """prompts: ["Say hello to {{name}}"]
tests:
  - description: scripted
    vars: {name: Porto}
    assert:
      - {type: javascript, value: "typeof output === 'string' && context.vars.name === 'Porto'"}
      - {type: python, value: "{'pass': False, 'score': 0.25, 'reason': 'never ' + context['vars']['name']}"}
"""


@pytest.mark.slow
def test_evaluate_records_script_outcomes(run_cli, tiny_ws):
    (tiny_ws / "assertions" / "tiny.yaml").unlink()
    (tiny_ws / "assertions" / "hello.promptfoo.yaml").write_text(EVALUATED)
    code, out = evaluate(run_cli, tiny_ws, "tiny", "--limit", "1")
    assert code in (0, 1) and out["verdict"] in ("PASS", "FAIL", "INCONCLUSIVE"), out
    (ev,) = ledger(tiny_ws).evaluations()
    results = ledger(tiny_ws).evaluation(ev["id"])["case_results"]
    assert len(results) == 3  # off twice, on once
    for r in results:
        js, py = r["result"]["outcomes"]
        assert js == {"type": "javascript", "name": None, "pass": True, "score": 1, "reason": "Assertion passed"}
        assert py == {"type": "python", "name": None, "pass": False, "score": 0.25, "reason": "never Porto"}


@pytest.mark.slow
def test_a_timeout_aborts_the_evaluation_and_records_no_outcome(run_cli, tiny_ws, monkeypatch):
    (tiny_ws / "assertions" / "tiny.yaml").unlink()
    (tiny_ws / "assertions" / "hello.promptfoo.yaml").write_text(textwrap.dedent("""\
        prompts: ["Say hello to {{name}}"]
        tests:
          - vars: {name: Porto}
            assert: [{type: python, value: "__import__('time').sleep(60) or True"}]
        """))
    monkeypatch.setenv(scripted.TIMEOUT_ENV, "1")
    code, out = evaluate(run_cli, tiny_ws, "tiny", "--limit", "1")
    assert code == 2 and "ran past 1 s" in out["error"] and scripted.TIMEOUT_ENV in out["error"], out
    lg = ledger(tiny_ws)
    (ev,) = lg.evaluations()
    record = lg.evaluation(ev["id"])
    assert record["status"] == "aborted" and record["verdict"] is None and record["case_results"] == []
    assert "ran past 1 s" in json.dumps(record["aborted_record"])
    assert lg.verify().ok
