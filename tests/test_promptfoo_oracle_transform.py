"""The oracle for ``transform``: the real promptfoo 0.123.1 grades a table of tests whose output a test's
``options.transform`` (or ``postprocess``) and an assertion's own ``transform`` change first, and gatekeeper
(its promptfoo loader, then battery/checks.py and battery/transform.py) must give the same pass/fail on every row.

Each row is one test: ``providerOutput`` is the text both start from. A transform that throws or returns nothing
makes promptfoo end the test in an error, which is a fail, and gatekeeper fails the assertion.
"""

from __future__ import annotations

import pytest
from promptfoo_table import scripts_graded

from gatekeeper.battery import checks, promptfoo

PROMPT, VARS = "Where is {{city}}?", {"city": "Porto"}
RENDERED = "Where is Porto?"
JS = """
module.exports = (output, context) => output + ' in ' + context.vars.city;
module.exports.parsed = (output) => JSON.parse(output);
"""
TS = "export default function (output: string): number { return output.length; }\n"
PY = """
def get_transform(output, context):
    return output.upper() + "/" + context["vars"]["city"]

def words(output, context):
    return output.split()
"""

ROWS: list[tuple] = []  # (test options, assertion, outputs)


def rows(options: dict, assertion: dict, outputs: list[str]) -> None:
    ROWS.extend((options, assertion, out) for out in outputs)


PARSE = {"transform": "JSON.parse(output)"}
rows({"transform": "output.trim()"}, {"type": "equals", "value": "abc"}, [" abc ", "abc", " abd"])
rows({"postprocess": "output + '!'"}, {"type": "equals", "value": "x!"}, ["x", "y"])
rows(PARSE, {"type": "is-json"}, ['{"a": 1}', "not json"])
rows(PARSE, {"type": "equals", "value": '{"a":1,"b":[true,null]}'}, ['{ "a": 1, "b": [true, null] }', '{"a": 2}'])
rows(PARSE, {"type": "javascript", "value": "output.color === 'purple' && context.providerResponse.output.color === 'purple'"},
     ['{"color": "purple"}', '{"color": "red"}'])
rows(PARSE, {"type": "python", "value": "output['a'] == 1"}, ['{"a": 1}', '{"a": 2}'])
rows(PARSE, {"type": "contains-any", "transform": "output.countries", "value": ["India", "Brazil"]},
     ['{"countries": ["India", "Peru"]}', '{"countries": ["Peru"]}'])
rows(PARSE, {"type": "not-contains", "value": "zzz"}, ["oops"])  # the test's transform throws: a fail, not- or not
rows({"transform": "output.length"}, {"type": "equals", "value": "3"}, ["abc", "ab"])
rows({"transform": "null"}, {"type": "not-contains", "value": "x"}, ["y"])  # nothing returned: a fail
rows({"transform": "context.vars.city + output"}, {"type": "starts-with", "value": "Porto"}, ["!", ""])
rows({"transform": "const x = output.trim();\nreturn x.toUpperCase();\n"}, {"type": "equals", "value": "ABC"}, [" abc ", "abd"])
rows({}, {"type": "contains", "transform": "output.toUpperCase()", "value": "ABC"}, ["xabcx", "xyz"])
rows({}, {"type": "equals", "transform": "context.prompt.label", "value": RENDERED}, ["anything"])
rows({}, {"type": "icontains", "transform": "output.slice(1)", "value": "B"}, ["ab", "ba"])
rows({}, {"type": "not-icontains", "transform": "undefinedName", "value": "B"}, ["ab"])
rows({"transform": "output.trim()"}, {"type": "equals", "transform": "output + output", "value": "abab"}, [" ab ", "ab "])
rows({"transform": "file://t.js"}, {"type": "equals", "value": "x in Porto"}, ["x", "y"])
rows({"transform": "file://t.js:parsed"}, {"type": "javascript", "value": "output.n > 1"}, ['{"n": 2}', '{"n": 1}'])
rows({"transform": "file://t.ts"}, {"type": "equals", "value": "4"}, ["four", "six"])
rows({"transform": "file://t.py"}, {"type": "equals", "value": "AB/Porto"}, ["ab", "ba"])
rows({}, {"type": "contains-all", "transform": "file://t.py:words", "value": ["a", "b"]}, ["a b", "a c"])


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """promptfoo's outcome for every row, from one ``promptfoo eval`` (installed by ``make promptfoo``)."""
    tests = [{"vars": VARS, "providerOutput": out, "assert": [assertion], **({"options": options} if options else {})}
             for options, assertion, out in ROWS]
    return scripts_graded(tmp_path_factory.mktemp("oracle_transform"), {"t.js": JS, "t.ts": TS, "t.py": PY}, PROMPT, tests)


def _promptfoo(result: dict) -> bool:
    components = (result.get("gradingResult") or {}).get("componentResults") or []
    return bool(components) and components[0]["pass"]  # no components: the test ended in an error


@pytest.mark.slow
def test_gatekeeper_transforms_and_grades_as_promptfoo_does(graded):
    path, results = graded
    config = promptfoo._read(path)
    disagree, passed = [], 0
    for i, (options, assertion, out) in enumerate(ROWS):
        test = {k: v for k, v in config["tests"][i].items() if k != "providerOutput"}
        (case,), skipped = promptfoo._cases({**config, "tests": [test]}, path)
        assert not skipped and len(case.assert_) == 1
        gk = checks.evaluate(case.assert_[0], out, checks.Context(vars=case.vars, prompt=RENDERED))
        pf = _promptfoo(results[i])
        passed += pf
        if gk["pass"] != pf:
            disagree.append(f"row {i} {options} {assertion} on {out!r}: promptfoo {pf}, gatekeeper {gk}")
    print(f"\ntransform oracle: {len(ROWS) - len(disagree)} of {len(ROWS)} rows agree ({passed} pass in promptfoo)")
    assert not disagree, f"{len(disagree)} of {len(ROWS)} rows disagree:\n" + "\n".join(disagree)
    assert 0 < passed < len(ROWS)  # the table has rows that pass and rows that fail
