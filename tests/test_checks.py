"""Each assertion type says yes and no on real outputs."""

import pytest

from gatekeeper.battery.checks import CHECKS, Refused, check, prepare
from gatekeeper.js.nunjucks import render
from gatekeeper.js.value import js_lower
from gatekeeper.workspace import Assertion

CASES = [
    ("equals", "Paris", "Paris", "Paris."),
    ("contains", "4", "It is 4.", "It is four."),
    ("icontains", "paris", "PARIS!", "Lyon"),
    ("not-contains", "sorry", "Sure.", "sorry, no"),
    ("not-icontains", "sorry", "Sure.", "SORRY"),
    ("starts-with", "Yes", "Yes, it is", "I think yes"),
    ("regex", r"\b\d{2}\b", "about 42 days", "about 4 days"),
    ("not-regex", r"\d", "no digits", "d1git"),
    ("one-of", ["A", "B"], " B\n", "C"),
    ("contains-any", ["cat", "dog"], "a dog", "a bird"),
    ("contains-all", ["cat", "dog"], "cat and dog", "cat only"),
    ("icontains-any", ["CAT"], "a cat", "a dog"),
    ("icontains-all", ["CAT", "DOG"], "Cat, dog", "cat"),
    ("is-json", None, ' {"a": 1} ', "{a: 1}"),
    ("contains-json", None, 'result: {"a": [1]} ok', "result: [1, 2]"),
    ("max-length", 5, "short", "too long"),
    ("min-length", 3, "long", "no"),
    ("not-equals", "Paris", "Lyon", "Paris"),
    ("not-starts-with", "Yes", "No", "Yes!"),
    ("not-is-json", None, "{a: 1}", "[1]"),
    ("not-contains-json", None, "[1]", '{"a": 1}'),
    ("not-contains-any", ["cat", "dog"], "a bird", "a cat"),
    ("not-contains-all", ["cat", "dog"], "a cat", "cat dog"),
    ("not-icontains-any", ["CAT"], "a dog", "a Cat"),
    ("not-icontains-all", ["CAT", "DOG"], "cat", "Dog cat"),
]


@pytest.mark.parametrize("kind, value, good, bad", CASES)
def test_assertion_says_yes_and_no(kind, value, good, bad):
    a = Assertion(type=kind, value=value)
    assert check(a, good) is True
    assert check(a, bad) is False


def test_every_type_is_covered():
    assert {c[0] for c in CASES} == set(CHECKS)


@pytest.mark.parametrize("kind, value, output, expected", [
    ("contains", 4, "It is 4.", True),             # promptfoo prints numbers as JavaScript does
    ("contains", 4.0, "It is 4.", True),
    ("equals", 1e21, "1e+21", True),
    ("equals", True, "true", True),
    ("equals", {"a": [1, 2]}, '{"a":[1,2.0]}', True),  # an object value compares parsed JSON
    ("equals", {"a": 1}, '{"a": true}', False),        # strictly: true is not 1
    ("contains-any", "cat, dog", "a dog", True),   # comma-separated strings split
    ("contains-all", 'a, "b, c"', "a b, c", True),
    ("regex", r"\d$", "4\n", False),              # JavaScript's $ does not match before a final newline
    ("regex", r"\w", "é", False),                  # \w is ASCII-only
    ("regex", "^.$", "😀", False),                  # one emoji is two UTF-16 code units
    ("is-json", None, "NaN", False),
    ("is-json", None, "\u00a0{}", False),          # no stripping beyond JSON whitespace
    ("contains-json", None, 'x {"a": "}"} y', False),  # promptfoo's brace counting ignores strings
    ("contains-json", None, "x {a: 1} y", True),   # and it reads YAML flow mappings as JSON
])
def test_promptfoo_meaning(kind, value, output, expected):
    assert check(Assertion(type=kind, value=value), output) is expected


@pytest.mark.parametrize("kind, value", [
    ("contains", ""), ("contains", True), ("contains-any", ""), ("contains-any", 0), ("starts-with", 4),
    ("regex", "(?i)a"), ("regex", "(?P<n>a)"), ("equals", None), ("contains-any", '"a, b'),
    ("is-json", {"type": "object", "colour": 1}), ("is-json", 3), ("contains-json", "type: [nothing"),
])
def test_values_promptfoo_refuses_are_refused(kind, value):
    with pytest.raises(Refused):
        prepare(Assertion(type=kind, value=value))


def test_deep_json_does_not_recurse():
    deep = "[" * 100_000 + "]" * 100_000
    for kind in ("is-json", "contains-json"):
        assert check(Assertion(type=kind), deep) is (kind == "is-json")
    nested = '{"a":' * 5000 + "1" + "}" * 5000
    assert check(Assertion(type="contains-json"), nested)
    assert check(Assertion(type="equals", value={"a": 1}), nested) is False


@pytest.mark.parametrize("kind, value, output, expected", [
    ("contains", "\ud83d", "a 😀", True),             # a lone surrogate is half of an emoji (UTF-16 code units)
    ("contains", "\ude00", "a 😀", True),
    ("contains", "\ud83d", "a b", False),
    ("contains", "\ud83d\ude00", "😀", True),          # a pair read from escapes is the emoji
    ("not-contains", "\ud83d", "😀", False),
    ("starts-with", "\ud83d", "😀 hi", True),
    ("starts-with", "\ude00", "😀 hi", False),
    ("equals", "\ud83d\ude00", "😀", True),
    ("equals", "\ud83d", "😀", False),
    ("equals", {"k": "😀"}, '{"k": "\\ud83d\\ude00"}', True),
    ("contains-any", ["x", "\ud83d"], "😀", True),
    ("contains-all", ["\ud83d", "\ude00"], "😀", True),
    ("icontains", "\ud83d", "😀", True),
    ("icontains", "\ud801\udc00", "𐐨", True),         # toLowerCase sees the pair as one letter
    ("icontains-any", ["\ua7cb"], "\u0264", True),      # a case pair Unicode added after Python's tables
    ("icontains-all", ["ΑΣ", "İ"], "ας i\u0307", True),  # final sigma, dotted capital I
])
def test_strings_compare_as_javascript_strings(kind, value, output, expected):
    assert check(Assertion(type=kind, value=value), output) is expected


@pytest.mark.parametrize("text, lower", [
    ("ABC", "abc"), ("ΑΣ", "ας"), ("Σ", "σ"), ("İ", "i\u0307"), ("\ud801\udc00", "\U00010428"), ("\ud83d", "\ud83d"),
    ("\u1c89\ua7dc\U00010d50\U00016ea0", "\u1c8a\u019b\U00010d70\U00016ebb"),
])
def test_lower_case_is_javascripts(text, lower):
    assert js_lower(text) == lower


VARS = {"word": "cat", "nums": [1, 2], "obj": {"a": "b"}, "nul": None}


@pytest.mark.parametrize("template, rendered", [
    ("{{ missing }}", ""), ("{{ missing.a.b }}x", "x"), ("{{ obj.zz.b }}", ""), ("{{ missing[0] }}", ""),
    ("{{ missing ~ '!' }}", "undefined!"), ("{{ 'a' + missing }}", "aundefined"), ("{{ missing + 1 }}", "NaN"),
    ("{{ missing * 2 }}", "NaN"), ("{{ missing > 0 }}", "false"), ("{{ missing == none }}", "true"),
    ("{{ missing | upper }}x", "x"), ("{{ missing | length }}", "0"), ("{{ missing | abs }}", "NaN"),
    ("{{ nul | abs }}", "0"), ("{{ missing | int }}|", "|"), ("{{ missing | int(3) }}", "3"),
    ("{{ missing | int ~ '|' }}", "undefined|"), ("{{ missing | default('d') }}", "d"), ("{{ nul | default('d') }}", ""),
    ("{{ nul | default('d', true) }}", "d"), ("{{ missing | center(3) }}|", "   |"), ("{{ [missing, 1] }}", ",1"),
    ("{{ [missing, nul, 1] | join('-') }}", "--1"), ("{% for i in missing %}a{% else %}e{% endfor %}", "e"),
    ("{{ nums | join(',') }}", "1,2"), ("{{ word | upper }}", "CAT"),
])
def test_an_undefined_var_renders_as_nunjucks_renders_it(template, rendered):
    assert render(template, VARS) == rendered


@pytest.mark.parametrize("template", [
    "{{ missing | join(',') }}", "{{ missing | trim }}", "{{ missing | first }}", "{{ 'a' in missing }}", "{{ missing() }}",
    "{{ word | tojson }}", "{{ env.HOME }}",
])
def test_what_nunjucks_cannot_render_is_an_error(template):
    with pytest.raises(ValueError, match="cannot be rendered"):
        render(template, VARS)


def test_a_lone_surrogate_needle_is_digested_as_its_json_escape():
    # the battery's digest holds every assertion value; a needle JavaScript allows must not stop an evaluation
    from gatekeeper.identity import canonical_json

    data = canonical_json(Assertion(type="contains", value="\ud83d 😀").model_dump(mode="json"))
    assert b'"\\ud83d \xf0\x9f\x98\x80"' in data
    data.decode("utf-8")  # still UTF-8
