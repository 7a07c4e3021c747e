"""Prompts that use nunjucks beyond ``{{ var }}`` (tags, filters, expressions, promptfoo's ``load`` filter and a
config's ``nunjucksFilters``), rendered as promptfoo 0.123.1 renders them, and refused where gatekeeper would
read them differently. The oracle runs the real promptfoo (echo provider: its output is the rendered prompt).
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
from conftest import evaluate, ledger

from gatekeeper.battery import partition, promptfoo
from gatekeeper.battery import suites as battery
from gatekeeper.errors import GatekeeperError
from gatekeeper.js import nunjucks
from gatekeeper.setup import promptfoo as promptfoo_build
from gatekeeper.workspace import Segment, Workspace

EXAMPLES = Path(__file__).resolve().parent.parent / "bench" / "promptfoo_examples"

# a text prompt with expressions, tags, nunjucks' filters, the load filter on a CSV var, custom filters (one
# CommonJS, one ES module, one with an argument), literal braces, a var that names another var; a prompt
# with a tag left open (literal, as promptfoo wraps it in {% raw %}); a chat rendered message by message;
# and a provider's request shape ({system, messages}, a text part with cache_control)
ORACLE = {
    "promptfooconfig.yaml": """providers: [echo]
prompts: [file://prompts.txt, file://chat.json, file://request.yaml]
nunjucksFilters:
  shout: ./shout.js
  flip: filters/flip.mjs
tests: file://tests.csv
""",
    "shout.js": "module.exports = function (str, times) { return String(str).toUpperCase() + '!'.repeat(times || 1); };\n",
    "filters/flip.mjs": "export default function (s) { return s.split('').reverse().join(''); }\n",
    "prompts.txt": """Tone: {{ (style | load).tone }}; bullets: {{ (style | load).formatting.bullets }}; tags: {{ (style | load).tags | join("/") }}
{% if lang == "French" %}Réponds en français.{% else %}Answer in {{ lang | lower }}.{% endif %}
{% for w in (style | load).tags %}- {{ loop.index }}. {{ w | title }}
{% endfor %}Count: {{ (style | load).tags | length }}, {{ body.length }} chars, {{ count * 2 }}, {{ count + 1 }}, {{ missing }}!
Reversed: {{ (style | load).tags | reverse }} {{ (style | load).tags | reverse | join("+") }} {{ body | reverse }} {{ (style | load).formatting | reverse | length }}
Objects: {% for k, v in {"b": 1, "2": 3, "1": 0} %}{{ k }}{{ v }}{% endfor %} {{ {"b": 1, "10": 2} | dump }} {{ body | urlencode }} {{ {"a b": "c/d"} | urlencode }}
Tests: {{ count is odd }} {{ count is divisibleby(5) }} {{ lang is sameas("French") }} {{ missing is null }} {{ none is none }} {{ count | string | length }} {{ (style | load).tone | abs }}
Arrays: {{ [1, 2, 3] | select("odd") }} {{ [1, 2, 3] | reject("odd") }} {{ [1, 2, 3] | batch(2) | length }} {{ [1, 2, 3] | slice(2) }} {{ [{"a": 1}] | groupby("a") }} {% for k, v in [{"a": "x"}, {"a": 1}, {"a": 0}, {"b": 2}] | groupby("a") %}{{ k }}={{ v | length }};{% endfor %}
Shout: {{ body | shout(2) }} / {{ body | flip }} / {{ body | upper | truncate(5) }} / {{ 7 // 2 }} / {{ (style | load) | dump }}
{% for k, v in (style | load).formatting %}{{ k }}={{ v }} {% else %}no formatting{% endfor %}{{ "" if (style | load).tags else " (no tags)" }}
Literal {braces} and {{ note }}
---
Open tag {{ body
 }} stays: {{ lang }}
""",
    "chat.json": '[{"role": "system", "content": "{% if lang %}Language: {{ lang | upper }}{% endif %}"},'
                 ' {"role": "user", "content": "{{ body }} ({{ (style | load).tone | default(\'plain\') }})"}]',
    "request.yaml": "system: 'Be {{ style | load | dump | length }} chars'\nmessages:\n  - role: user\n    content:\n"
                    "      - type: text\n        text: 'Riddle: {{ body }}'\n        cache_control: {type: ephemeral}\n",
    "tests.csv": '__description,lang,body,style,note,count\n'
                 'first,French,Hello world,"{""tone"":""formal"",""tags"":[""a"",""b c""],""formatting"":{""bullets"":true}}","see {{lang}}",3\n'
                 'second,Pirate,I\'m hungry,"{""tone"":""casual"",""tags"":[],""formatting"":{}}",plain,10\n',
}


def _write(folder: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text, encoding="utf-8", newline="")
    return folder / "promptfooconfig.yaml"


def _messages(raw: str) -> tuple:
    try:
        parsed = json.loads(raw)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict) and "messages" in parsed:  # a provider's request shape; one text part a message
        parsed = [{"role": "system", "content": parsed["system"]}] + [
            {"role": m["role"], "content": m["content"][0]["text"]} for m in parsed["messages"]]
    if isinstance(parsed, list) and all(isinstance(m, dict) and "role" in m for m in parsed):
        return tuple((m["role"], m["content"]) for m in parsed)
    return (("user", raw),)


def _gatekeeper(config: Path) -> Counter:
    """(test description, rendered messages) for every prompt and case gatekeeper reads from the config."""
    ws = Workspace(config.parent)
    seen: Counter = Counter()
    for suite in promptfoo.load_suites(config, "oracle"):
        assert partition.missing_vars(suite) == []  # every case renders at load
        for case in suite.cases:
            seen[(case.id, tuple((m["role"], m["content"]) for m in partition.messages(partition.pieces(ws, suite, case.vars))))] += 1
    return seen


@pytest.mark.slow
def test_nunjucks_prompts_render_as_promptfoo_renders_them(tmp_path):
    assert promptfoo_build.installed(), "promptfoo is not installed: run 'make promptfoo' (python -m gatekeeper.setup.promptfoo)"
    config = _write(tmp_path, ORACLE)
    out = tmp_path / "out.json"
    run = promptfoo_build.eval_config(config, out)
    assert out.is_file(), f"promptfoo eval wrote no results (exit {run.returncode}):\n{run.stderr[-3000:]}"
    results = json.loads(out.read_text(encoding="utf-8"))["results"]["results"]
    assert all(not r.get("error") for r in results), [r["error"] for r in results]
    theirs = Counter((r["testCase"]["description"], _messages(r["prompt"]["raw"])) for r in results)
    ours = _gatekeeper(config)
    assert sum(theirs.values()) == 8
    assert ours == theirs, f"only promptfoo: {theirs - ours}\nonly gatekeeper: {ours - theirs}"


def test_the_simple_csv_example_reads_its_style_with_load(tmp_path):
    shutil.copytree(EXAMPLES / "simple-csv", tmp_path / "simple-csv")
    config = tmp_path / "simple-csv" / "promptfooconfig.yaml"
    first, second = promptfoo.load_suites(config, "simple")
    assert [s.nunjucks for s in first.prompt] == [True] and not first.filters
    assert [s.nunjucks for s in second.prompt] == [False]  # only {{ var }}: {var} fields, as before
    ws = Workspace(config.parent)
    (text,) = [p.text for p in partition.pieces(ws, first, first.cases[1].vars)]
    assert "- Tone: casual\n- Length: brief\n" in text and '"I\'m hungry"' in text
    # the runtime's pinned prefix needs no var: a dynamic template is left empty, not rendered without them
    assert [p.text for p in partition.pieces(ws, first, {}, static_only=True)] == [""]


def test_a_template_segment_keeps_older_digests_and_needs_no_var(tmp_path):
    assert Segment(role="user", static=False, text="{q}").model_dump(mode="json") == {"role": "user", "static": False, "text": "{q}", "file": None}
    config = _write(tmp_path, {"promptfooconfig.yaml": "prompts: ['Hi {{ name | default(\"you\") }}{{ extra }}']\n"
                                                       "tests: [{vars: {q: x}}]\n"})
    (suite,) = promptfoo.load_suites(config, "t")
    assert partition.suite_vars(suite) == set() and partition.missing_vars(suite) == []
    assert [p.text for p in partition.pieces(Workspace(tmp_path), suite, suite.cases[0].vars)] == ["Hi you"]
    dumped = suite.model_dump(mode="json", by_alias=True)
    assert dumped["prompt"][0]["nunjucks"] is True and "filters" not in dumped  # no custom filter: no key


def test_a_template_without_vars_is_static_text(tmp_path):
    config = _write(tmp_path, {"promptfooconfig.yaml": "prompts:\n  - file://chat.json\ntests: [{vars: {q: x}}]\n",
                               "chat.json": '[{"role": "system", "content": "{% for i in range(3) %}{{ i }}{% endfor %} {{ \'a\' ~ 1 }}"},'
                                            ' {"role": "user", "content": "{{ q }}"}]'})
    (suite,) = promptfoo.load_suites(config, "t")
    assert [(s.static, s.nunjucks, s.text) for s in suite.prompt] == [(True, False, "012 a1"), (False, False, "{q}")]


def test_custom_filters_run_in_node(tmp_path):
    config = _write(tmp_path, {"promptfooconfig.yaml": "prompts: ['{{ q | wrap(\"*\") }} {{ q | upper }}']\n"
                                                       "nunjucksFilters: {wrap: lib/wrap.js, upper: lib/lower.cjs}\n"
                                                       "tests: [{vars: {q: Hi}}, {vars: {q: bad}}]\n",
                               "lib/wrap.js": "module.exports = (s, c) => { if (s === 'bad') throw new Error('no bad input'); return c + s + c; };\n",
                               "lib/lower.cjs": "module.exports = (s) => s.toLowerCase();\n"})
    (suite,) = promptfoo.load_suites(config, "t")
    assert suite.filters == {"upper": f"file://{(tmp_path / 'lib/lower.cjs').resolve()}",
                             "wrap": f"file://{(tmp_path / 'lib/wrap.js').resolve()}"}
    assert [p.text for p in partition.pieces(Workspace(tmp_path), suite, suite.cases[0].vars)] == ["*Hi* hi"]  # a custom filter wins
    (problem,) = partition.missing_vars(suite)  # the test promptfoo fails is named before any case runs
    assert "case 'test 2'" in problem and "'wrap' threw: no bad input" in problem


def test_the_battery_digest_follows_a_filter_file_not_where_the_workspace_lies(tiny_ws, tmp_path):
    (tiny_ws / "assertions" / "tiny.yaml").unlink()
    _write(tiny_ws / "assertions", {"t.promptfoo.yaml": "prompts: ['{{ q | wrap }}']\nnunjucksFilters: {wrap: wrap.js}\n"
                                                        "tests: [{vars: {q: Hi}}]\n",
                                    "wrap.js": "module.exports = (s) => '*' + s + '*';\n"})

    def digest(root):
        ws = Workspace(root)
        return battery.battery_digest(ws, battery.read(ws, ["t"]))

    before = digest(tiny_ws)
    assert digest(shutil.copytree(tiny_ws, tmp_path / "moved")) == before
    (tiny_ws / "assertions" / "wrap.js").write_text("module.exports = (s) => '_' + s + '_';\n")
    assert digest(tiny_ws) != before


def test_the_filters_key_is_still_refused_naming_the_filter(tmp_path):
    shutil.copytree(EXAMPLES / "nunjucks-custom-filters", tmp_path / "ex")
    with pytest.raises(GatekeeperError) as e:
        promptfoo.load_suites(tmp_path / "ex" / "promptfooconfig.yaml", "ex")
    message = str(e.value)
    assert "prompts.txt" in message and "'allcaps'" in message and "filter not found: allcaps" in message
    assert "rename the key to 'nunjucksFilters'" in message


@pytest.mark.parametrize("files, expected", [
    ({"promptfooconfig.yaml": "prompts: ['{% if flag %}yes{% endif %}']\ntests:\n  - vars: {flag: false}\n"},
     r"promptfooconfig.yaml, test 1: field 'vars.flag': false is not text.*quote it"),
    ({"promptfooconfig.yaml": "prompts: ['{{ n + 1 }}']\ndefaultTest: {vars: {n: 3}}\ntests: [{vars: {q: x}}]\n"},
     r"defaultTest \(applies to test 1\): field 'vars.n': 3 is not text"),
    ({"promptfooconfig.yaml": "prompts: ['{{ cfg.tone }}']\ntests: [{vars: {cfg: {tone: dry}}}]\n"},
     r"field 'vars.cfg'.*JSON text and read it with '\| load'"),
    ({"promptfooconfig.yaml": "prompts: ['{{ q | shout }}']\ntests: [{vars: {q: x}}]\n"},
     r"filter 'shout'.*filter not found: shout.*define it under 'nunjucksFilters'"),
    ({"promptfooconfig.yaml": "prompts: ['{{ q.toUpperCase() }}']\ntests: [{vars: {q: x}}]\n"}, r"calls the method toUpperCase\(\)"),
    ({"promptfooconfig.yaml": "prompts: [\"{{ q \"]\ntests: [{vars: {q: x}}]\n"}, None),
    ({"promptfooconfig.yaml": "prompts: ['{% if q %}x']\ntests: [{vars: {q: x}}]\n"}, r"nunjucks does not parse"),
    ({"promptfooconfig.yaml": "prompts: [file://c.json]\nnunjucksFilters: {shout: s.js}\ntests: [{vars: {q: x}}]\n",
      "c.json": '[{"role": "user", "content": "{{ q | shout }}"}]', "s.js": "module.exports = (s) => s;\n"},
     r"chat message uses the custom filter 'shout'"),
    ({"promptfooconfig.yaml": "prompts: ['{{ q | s }}']\nnunjucksFilters: {s: file://s.js}\ntests: [{vars: {q: x}}]\n",
      "s.js": ""}, r"field 'nunjucksFilters.s'.*without 'file://'"),
    ({"promptfooconfig.yaml": "prompts: ['{{ q | s }}']\nnunjucksFilters: {s: nowhere.js}\ntests: [{vars: {q: x}}]\n"},
     r"field 'nunjucksFilters.s': nowhere.js matches no file"),
    ({"promptfooconfig.yaml": "prompts: ['{{ q | upper }}: {{ note }}']\ntests: [{vars: {q: x, note: '{% if 1 %}y{% endif %}'}}]\n"},
     r"field 'vars.note' \(case 'test 1'\) holds nunjucks"),
    ({"promptfooconfig.yaml": "prompts: ['{\"a\": \"{{ q | upper }}\"}']\ntests: [{vars: {q: x}}]\n"}, r"the prompt is JSON"),
    # what Jinja2 reads and nunjucks does not parse: promptfoo fails every test
    ({"promptfooconfig.yaml": "prompts: ['{{ q[1:] }}']\ntests: [{vars: {q: xy}}]\n"}, r"nunjucks has no slices"),
    ({"promptfooconfig.yaml": "prompts: ['{{ q is sameas \"x\" }}']\ntests: [{vars: {q: x}}]\n"},
     r"argument only in parentheses \(is sameas\(...\)\)"),
    ({"promptfooconfig.yaml": "prompts: ['{{ 1e3 }} {{ q }}']\ntests: [{vars: {q: x}}]\n"}, r"does not parse the number 1e3"),
    # what nunjucks renders and gatekeeper does not read
    ({"promptfooconfig.yaml": "prompts: ['{{ q === \"x\" }}']\ntests: [{vars: {q: x}}]\n"},
     r"not read by gatekeeper \(line 1: JavaScript's strict === or !==; write == or !="),
    ({"promptfooconfig.yaml": "prompts: ['{% include \"p.txt\" %}{{ q }}']\ntests: [{vars: {q: x}}]\n", "p.txt": "x"},
     r"not read by gatekeeper \(line 1: \{% include %\} reads a file relative to the folder promptfoo is run from"),
    # JSON that is no chat, with a plain {{ var }} or none: promptfoo sends it written again with 2-space indents
    ({"promptfooconfig.yaml": "prompts: ['{\"a\": \"{{ q }}\"}']\ntests: [{vars: {q: x}}]\n"}, r"the prompt is JSON but not a chat"),
    ({"promptfooconfig.yaml": "prompts: [file://p.yaml]\ntests: [{vars: {q: x}}]\n", "p.yaml": "task: summarize\nlimit: 3\n"},
     r"p.yaml\).*the prompt is JSON but not a chat"),
    ({"promptfooconfig.yaml": "prompts: [file://p.yaml]\ntests: [{vars: {q: x}}]\n",
      "p.yaml": "messages: [{role: user, content: '{{ q }}'}]\ntemperature: 0.2\n"}, r"also sets \['temperature'\]"),
    ({"promptfooconfig.yaml": "prompts: [file://p.yaml]\ntests: [{vars: {q: x}}]\n",
      "p.yaml": "[{role: user, content: [{type: text, text: a}, {type: text, text: '{{ q }}'}]}]\n"}, r"several parts"),
])
def test_what_gatekeeper_would_read_differently_is_refused(tmp_path, files, expected):
    if expected is None:  # a tag left open is literal text in promptfoo: nothing to refuse
        (suite,) = promptfoo.load_suites(_write(tmp_path, files), "t")
        assert [p.text for p in partition.pieces(Workspace(tmp_path), suite, suite.cases[0].vars)] == ["{{ q "]
        return
    import re

    with pytest.raises(GatekeeperError) as e:
        promptfoo.load_suites(_write(tmp_path, files), "t")
    assert re.search(expected, str(e.value)), str(e.value)


def test_a_render_error_is_refused_at_load_naming_suite_and_case(workspace):
    _write(workspace / "assertions", {"promptfooconfig.yaml": "", "faq.promptfoo.yaml":
                                      "prompts: ['Tone: {{ (style | load).tone }}']\n"
                                      "tests: [{vars: {style: '{\"tone\": \"dry\"}'}}, {description: broken, vars: {style: 'not json'}}]\n"})
    (workspace / "assertions" / "promptfooconfig.yaml").unlink()
    with pytest.raises(GatekeeperError) as e:
        battery.read(Workspace(workspace), ["faq"], limit=1)  # --limit hides no case that cannot render
    assert "suite 'faq', case 'broken'" in str(e.value) and "'not json' is not valid JSON" in str(e.value)


def test_a_prompt_that_renders_anew_each_time_is_refused_at_load(workspace):
    """nunjucks' random filter: the flag-off and flag-on runs would not read one prompt."""
    _write(workspace / "assertions", {"faq.promptfoo.yaml": "prompts: ['Pick: {{ (q | load) | random }}']\n"
                                                          "tests: [{vars: {q: '[1, 2]'}}]\n"})
    with pytest.raises(GatekeeperError) as e:
        battery.read(Workspace(workspace), ["faq"])
    assert "suite 'faq'" in str(e.value) and "random filter picks anew on every render" in str(e.value)


@pytest.mark.parametrize("template, vars, rendered", [
    ("{{ (s | load).a.b }} {{ s | load | dump }}", {"s": '{"a": {"b": [1, 2.5]}}'}, '1,2.5 {"a":{"b":[1,2.5]}}'),
    ("{{ (s | load).items }} {{ (s | load).keys }}|{{ s.length }}", {"s": '{"items": 3}'}, "3 |12"),  # keys, not Python methods
    ("{{ n * 2 }} {{ n + 1 }} {{ n == 3 }} {{ n > 20 }}", {"n": "3"}, "6 31 true false"),  # CSV text, as JavaScript mixes it
    ("{% if l %}y{% endif %}{{ e or 'd' }}", {"l": [], "e": ""}, "yd"),  # an empty list is truthy in JavaScript
])
def test_expressions_keep_javascripts_meaning(template, vars, rendered):
    assert nunjucks.render(template, vars) == rendered


def test_vars_are_prepared_as_promptfoo_prepares_them():
    prepared = nunjucks.prompt_vars({"a": "x {{b}}\n", "b": "B$&", "c": "{{ nope }}"})
    # one trailing newline dropped; JavaScript's replace expands $& to the placeholder again, once a pass, five passes
    assert prepared == {"a": "x BBBBB{{b}}", "b": "B$&", "c": "{{ nope }}"}
    assert nunjucks.auto_raw("{{ a\n}}") == "{% raw %}{{ a\n}}{% endraw %}" and nunjucks.auto_raw("{{ a }}") == "{{ a }}"


@pytest.mark.slow
def test_a_nunjucks_prompt_evaluates_on_the_tiny_model(tiny_ws, run_cli):
    _write(tiny_ws / "assertions", {"faq.promptfoo.yaml": "prompts: [file://faq/prompt.txt]\n"
                                                          "nunjucksFilters: {shout: faq/shout.js}\ntests: file://faq/tests.csv\n",
                                    "faq/prompt.txt": "{% if (cfg | load).formal %}Dear user.{% endif %} {{ q | shout }}",
                                    "faq/shout.js": "module.exports = (s) => s.toUpperCase();\n",
                                    "faq/tests.csv": 'q,cfg,__expected\nhi,"{""formal"":true}",not-contains:zebra\n'
                                                     'yo,"{""formal"":false}",not-contains:zebra\n'})
    code, outcome = evaluate(run_cli, tiny_ws, "tiny", "--suite", "faq")
    assert code in (0, 1) and outcome["verdict"] in ("PASS", "FAIL", "INCONCLUSIVE"), outcome
    with ledger(tiny_ws) as lg:
        cases = {r["case_id"] for r in lg.evaluation(outcome["evaluation_id"])["case_results"]}
    assert cases == {"faq/test 1", "faq/test 2"}
