"""JavaScript's value semantics, written once in gatekeeper/js/value.py: Number(), parseFloat, String(),
truthiness and JSON.stringify, checked against node itself (the node 'make promptfoo' installs), and every
caller in battery/, js/ and gate/ using that one home."""

from __future__ import annotations

import json
import math
import subprocess

from gatekeeper.battery import checks, graded, scored
from gatekeeper.js import nunjucks, nunjucks_operators, value
from gatekeeper.setup import promptfoo as promptfoo_setup

NUMBER_INPUTS = ["", "  12 ", "1e3", "-Infinity", "+Infinity", "infinity", "0b11", "0B2", "0o17", "0x1F", "0x", "+0x1", "-0x1",
                 "0x1_0", "1_000", ".5", "5.", ".", "1e", "1e400", "-0", "\u00a012\u2028", "\u0661\u0662", "abc", "12abc",
                 None, True, False, 0, -0.0, 1.5, 2**60, [], [5], [" 7 "], [None], [1, 2], [[3]], {}, {"a": 1}]
STRINGIFY_INPUTS = [None, True, 0, -0.0, 1.0, 1.5, 1e21, 1e-7, 1e16, 2**53 + 1, 2**60, 0.1 + 0.2, "", "a\"b\\c\n\t\r\b\f\x01\x1f\x7f",
                    "é 😀 \u2028", "\ud83d\ude00", "\ud800 lone", [], {}, [[]], [1, [2, {"a": [{}]}]],
                    {"b": 1, "a": [None, "x"], "2": 0, "10": 1, "1": 2, "01": 3, "-1": 4, "4294967295": 5, "4294967294": 6}]


def _node(script: str, inputs: list) -> list:
    node = promptfoo_setup.node()
    assert node.is_file(), "node is not installed: run 'make promptfoo' (make test does)"
    out = subprocess.run([str(node), "-e", script], input=json.dumps(inputs), capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_number_and_parse_float_are_javascripts():
    got = _node("const xs = JSON.parse(require('fs').readFileSync(0, 'utf8'));"
                "console.log(JSON.stringify(xs.map(x => [String(Number(x)), String(parseFloat(x)), !!x])))", NUMBER_INPUTS)
    for x, (number, parsed, truthy) in zip(NUMBER_INPUTS, got):
        assert value.number_string(value.js_number(x)) == number, x
        assert value.number_string(value.parse_float(value.js_string(x))) == parsed, x
        assert value.truthy(x) == truthy, x


def test_stringify_is_javascripts():
    got = _node("const xs = JSON.parse(require('fs').readFileSync(0, 'utf8'));"
                "console.log(JSON.stringify(xs.map(x => [JSON.stringify(x), JSON.stringify(x, null, 2), JSON.stringify([x, {k: x}], null, 4)])))",
                STRINGIFY_INPUTS)
    for x, (compact, two, four) in zip(STRINGIFY_INPUTS, got):
        assert value.stringify(x) == compact, x
        assert value.stringify(x, 2) == two, x
        assert value.stringify([x, {"k": x}], 4) == four, x


def test_stringify_writes_what_json_cannot_hold_as_null_and_nests_deeply():
    assert value.stringify([math.nan, math.inf, -math.inf, 10**400]) == "[null,null,null,null]"
    deep: list = []
    for _ in range(5000):  # iterative: nesting deeper than Python's recursion limit
        deep = [deep]
    assert value.stringify(deep) == "[" * 5001 + "]" * 5001


def test_every_caller_uses_the_one_home():
    assert graded.stringify is value.stringify and checks.stringify is value.stringify
    assert graded.js_number is value.js_number and scored.js_number is value.js_number
    assert checks.truthy is value.truthy and checks.js_string is value.js_string


def test_templates_read_numbers_and_write_json_as_javascript():
    assert nunjucks_operators.number(None) == 0 and nunjucks_operators.number([5]) == 5
    assert math.isnan(nunjucks_operators.number(nunjucks_operators.UNDEFINED))
    assert nunjucks.render("{{ x | dump }}", {"x": {"b": 1.0, "1": [1e-7, None]}}) == '{"1":[1e-7,null],"b":1}'
    assert nunjucks.render("{{ x | dump(2) }}", {"x": [1.0]}) == "[\n  1\n]"
    assert nunjucks.render("{{ '0x10' + 1 }} {{ '0x10' - 1 }} {{ x | float }}", {"x": " 2.5e1px"}) == "0x101 15 25"
