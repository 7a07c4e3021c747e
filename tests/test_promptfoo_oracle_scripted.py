"""The oracle for javascript and python assertions: the real promptfoo 0.123.1 grades a table of them, and
gatekeeper (its promptfoo loader, then battery/scripted.py) must give the same pass/fail on every row.

Each row is one test of one config: ``providerOutput`` is the text both grade, the vars and the rendered prompt
are the same, and the script files sit beside the config. promptfoo runs Python assertions with
``PROMPTFOO_PYTHON`` (this interpreter). A row promptfoo errors on (a JavaScript file that throws) counts as a
fail, which is what gatekeeper records for it.
"""

from __future__ import annotations

from collections import Counter

import pytest
from promptfoo_table import scripts_graded

from gatekeeper.battery import checks, promptfoo

PROMPT, VARS = "Where is {{city}}?", {"city": "Porto"}
RENDERED = "Where is Porto?"

JS = """
module.exports = (output, context) => output.includes(context.vars.city);
module.exports.score = (output) => output.length / 10;
module.exports.graded = (output, context) => ({pass: output.startsWith('P'), score: 0.5, reason: context.prompt});
module.exports.boom = () => { throw new Error('no luck'); };
module.exports.text = () => 'true';
module.exports.later = async (output) => output.length > 3;
module.exports.nothing = () => null;
"""
ESM = "export default function (output) { return output === 'Porto'; }\nexport const half = () => 0.5;\n"
PY = """
def get_assert(output, context):
    return context["vars"]["city"] in output

def score(output, context):
    return len(output) / 10

def graded(output, context):
    return {"pass_": output.startswith("P"), "score": 0.5, "reason": context["prompt"]}

def boom(output, context):
    raise ValueError("no luck")

def text(output, context):
    return "0.3 or so"

async def later(output, context):
    return len(output) > 3

class Checks:
    @staticmethod
    def short(output, context):
        return len(output) < 6
"""

ROWS: list[tuple] = []  # (type, value, threshold, outputs)


def rows(kind: str, value, outputs: list[str], threshold: float | None = None) -> None:
    ROWS.extend((kind, value, threshold, out) for out in outputs)


OUTS = ["Porto", "Lisbon is not Porto", " ", "P"]  # an empty providerOutput would fall through to the echo provider
for lang, f in (("javascript", "file://check.js"), ("python", "file://check.py")):
    for kind in (lang, f"not-{lang}"):
        rows(kind, f, OUTS)
        rows(kind, f"{f}:score", OUTS)
        rows(kind, f"{f}:score", OUTS, 0.5)
        rows(kind, f"{f}:graded", OUTS)
        rows(kind, f"{f}:graded", OUTS, 0.6)
        rows(kind, f"{f}:boom", ["x"])
        rows(kind, f"{f}:text", ["x"])
        rows(kind, f"{f}:later", ["abc", "abcd"])
rows("javascript", "file://check.js:nothing", ["x"])
rows("javascript", "file://esm.mjs", ["Porto", "porto"])
rows("javascript", "file://esm.mjs:half", ["x"])
rows("javascript", "file://esm.mjs:half", ["x"], 0.6)
rows("python", "file://check.py:Checks.short", ["Porto", "Lisbon!"])

for kind in ("javascript", "not-javascript"):
    rows(kind, "output.includes(context.vars.city)", OUTS)
    rows(kind, "output.length / 10", OUTS)
    rows(kind, "output.length / 10", OUTS, 0.2)
    rows(kind, "output.length - 1", ["P", "Po"])  # 0 fails without a threshold, 1 passes
    rows(kind, "output.length - 1", ["P", "Po"], 0)
    rows(kind, "const n = output.length; n > 2", OUTS)
    rows(kind, "let s = 'a;b'; output.includes(s.slice(0, 1))", ["a", "b"])
    rows(kind, "output === 'P';", ["P", "Q"])
    rows(kind, "({pass: output === 'P', score: 0.1, reason: context.prompt})", ["P", "Q"], 0.5)
    rows(kind, "({pass: true})", ["P"])
    rows(kind, "'true'", ["P"])
    rows(kind, "JSON.parse(output).ok", ['{"ok": true}', '{"ok": 1}', "not json"])
    rows(kind, "if (output.length > 3) {\n  return true;\n}\nreturn context.prompt === 'Where is Porto?';\n", OUTS)
    rows(kind, "output.length > 3\n", OUTS)  # a YAML block's newline: trimmed, so still one line
    rows(kind, "Promise.resolve(output.length)", OUTS)
    rows(kind, "NaN", ["x"])
    rows(kind, "throw new Error('x')", ["x"])
for kind in ("python", "not-python"):
    rows(kind, "context['vars']['city'] in output", OUTS)
    rows(kind, "len(output) / 10", OUTS)
    rows(kind, "len(output) / 10", OUTS, 0.2)
    rows(kind, "len(output) - 1", ["P", "Po"])
    rows(kind, "len(output) - 1", ["P", "Po"], 0)
    rows(kind, "str(len(output) - 1)", ["P", "Po"])
    rows(kind, "output == 'P'", ["P", "Q"])
    rows(kind, "{'pass': output == 'P', 'score': 0.4, 'reason': context['prompt']}", ["P", "Q"])
    rows(kind, "{'pass': output == 'P', 'score': 0.4, 'reason': 'r'}", ["P", "Q"], 0.3)
    rows(kind, "{'pass': output == 'P', 'score': 0.4, 'reason': 'r'}", ["P", "Q"], 0.5)
    rows(kind, "{'pass': True}", ["P"])
    rows(kind, "json.dumps({'pass': output == 'P', 'score': 1, 'reason': 'j'})", ["P", "Q"])
    rows(kind, "'TRUE' if output.strip() else 'false'", ["P", " "])
    rows(kind, "'0.25 apples'", ["x"])
    rows(kind, "' 7'", ["x"])
    rows(kind, "'apples'", ["x"])
    rows(kind, "None", ["x"])
    rows(kind, "[1]", ["x"])
    rows(kind, "1 / (len(output) - 1)", ["ab", "a"])
    rows(kind, "if len(output) > 3:\n    return True\nreturn context['prompt'] == 'Where is Porto?'", OUTS)
    rows(kind, "len(output) > 3\n", ["abcd"])  # not trimmed: a two-line body that returns None
    rows(kind, "float('inf')", ["x"])


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """promptfoo's outcome for every row, from one ``promptfoo eval`` (installed by ``make promptfoo``)."""
    tests = [{"vars": VARS, "providerOutput": out,
              "assert": [{"type": kind, "value": value, **({"threshold": threshold} if threshold is not None else {})}]}
             for kind, value, threshold, out in ROWS]
    return scripts_graded(tmp_path_factory.mktemp("oracle_scripted"), {"check.js": JS, "esm.mjs": ESM, "check.py": PY},
                          PROMPT, tests)


def _promptfoo(result: dict) -> tuple[bool, str]:
    components = (result.get("gradingResult") or {}).get("componentResults") or []
    if not components:  # the assertion threw inside promptfoo: the test fails with the error
        return False, "error: " + (result.get("error") or "").splitlines()[0]
    return components[0]["pass"], components[0].get("reason", "")


@pytest.mark.slow
def test_gatekeeper_agrees_with_promptfoo_on_every_script_row(graded):
    path, results = graded
    config = promptfoo._read(path)
    agree, disagree = Counter(), []
    for i, (kind, value, threshold, out) in enumerate(ROWS):
        result = results[i]
        if result.get("response"):  # an assertion that threw leaves none
            assert result["response"]["output"] == out, f"row {i}: promptfoo graded {result['response']['output']!r}"
        assert result["prompt"]["raw"] == RENDERED, f"row {i}: promptfoo's prompt is {result['prompt']['raw']!r}"
        test = {k: v for k, v in config["tests"][i].items() if k != "providerOutput"}
        (case,), skipped = promptfoo._cases({**config, "tests": [test]}, path)
        assert not skipped and len(case.assert_) == 1
        gk = checks.evaluate(case.assert_[0], out, checks.Context(vars=case.vars, prompt=RENDERED))
        pf = _promptfoo(result)
        if gk["pass"] == pf[0]:
            agree[kind] += 1
        else:
            disagree.append(f"row {i} {kind} {value!r} (threshold {threshold}) on {out!r}: promptfoo {pf}, gatekeeper {gk}")
    print(f"\nscripted oracle: {sum(agree.values())} of {len(ROWS)} rows agree; by type: {dict(agree)}")
    assert not disagree, f"{len(disagree)} of {len(ROWS)} rows disagree:\n" + "\n".join(disagree)
    assert set(agree) == {"javascript", "not-javascript", "python", "not-python"} and len(ROWS) >= 150
