"""The oracle's table: edge cases of every assertion type gatekeeper shares with promptfoo.

Each row is (class, type, value, output, vars). ``ABSENT`` leaves ``value`` out; ``Raw("yes")`` writes the
value as a plain YAML scalar, so js-yaml's reading of it is under test too. ``config()`` writes them all
as one promptfoo config (one test per row, its ``providerOutput`` the text graded; an empty one falls
through to the echo provider, which returns the prompt ``{{output}}``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from gatekeeper.setup import promptfoo as promptfoo_build

ABSENT = object()


def promptfoo_results(folder: Path, text: str, rows: int, **env: str) -> tuple[Path, dict[int, dict]]:
    """The real promptfoo's result for each of ``rows`` tests of config ``text``, from one ``promptfoo eval``
    in ``folder`` (installed by ``make promptfoo``), by test index."""
    import pytest

    assert promptfoo_build.installed(), "promptfoo is not installed: run 'make promptfoo' (python -m gatekeeper.setup.promptfoo)"
    path = folder / "oracle.promptfoo.yaml"
    path.write_text(text, encoding="utf-8")
    out = folder / "out.json"
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        run = promptfoo_build.eval_config(path, out)
    assert out.is_file(), f"promptfoo eval wrote no results (exit {run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    results = {r["testIdx"]: r for r in json.loads(out.read_text(encoding="utf-8"))["results"]["results"]}
    assert sorted(results) == list(range(rows)), "promptfoo did not grade every row"
    return path, results


def scripts_graded(folder: Path, files: dict[str, str], prompt: str, tests: list[dict]) -> tuple[Path, dict[int, dict]]:
    """promptfoo's result for each test (its providerOutput graded as the echo provider's output) of a config
    with one prompt, run in ``folder`` beside ``files`` (the assertions' scripts; Python ones on this Python)."""
    import sys

    for name, text in files.items():
        (folder / name).write_text(text, encoding="utf-8")
    lines = [f"  - {json.dumps({'description': str(i), **test})}" for i, test in enumerate(tests)]
    config = f"providers: [echo]\nprompts: [{json.dumps(prompt)}]\ntests:\n" + "\n".join(lines) + "\n"
    return promptfoo_results(folder, config, len(tests), PROMPTFOO_PYTHON=sys.executable)


class Raw(str):
    """A value written as a bare YAML scalar (``yes``, ``1e3``, ``2025-05-03``)."""


DEEP_ARRAY = "[" * 20_000 + "]" * 20_000
DEEP_OBJECT = '{"a":' * 3000 + "1" + "}" * 3000

ROWS: list[tuple] = []


def rows(cls: str, kind: str, value, outputs, vars=None):
    for out in outputs:
        ROWS.append((cls, kind, value, out, vars or {}))


# numeric, boolean and object values
for v, outs in [(4, ["It is 4.", "four"]), (4.0, ["4", "4.0 only"]), (0, ["0", "none"]), (-0.0, ["0", "-0"]),
                (1e21, ["1e+21", "1000000000000000000000"]), (1e-7, ["1e-7", "0.0000001"]), (0.1, ["0.1"]),
                (12345678901234567890, ["12345678901234567000", "12345678901234567890"]), (1.5, ["1.5"]),
                (Raw(".nan"), ["NaN"]), (Raw(".inf"), ["Infinity"]), (True, ["true"]), (False, ["false"])]:
    rows("numbers", "contains", v, outs)
for v, outs in [(4, ["4", "4.0"]), (True, ["true", "True"]), (None, ["null", "x"]), ({"a": 1}, ['{"a": 1}', '{"a":1.0}', '{"a":true}', "{a: 1}"]),
                ([1, "x"], ['[1, "x"]', '[1,"x"] ']), ("4", ["4"]), ({"a": 0}, ['{"a": -0}', '{"a": 0}']), ([True], ["[1]", "[true]"]),
                ({"a": [1, {"b": None}]}, ['{"a":[1,{"b":null}]}', '{"a":[1,{}]}']), ({}, ["{}", "[]"]), ([], ["[]", "{}"]),
                (1e21, ["1e+21"]), (0.1, ["0.1", "0.10"])]:
    rows("numbers", "equals", v, outs)
for kind, v, outs in [("icontains", 42, ["X42"]), ("starts-with", 4, ["4"]), ("regex", 4, ["4"]), ("contains-any", [1, 2], ["a 2"]),
                      ("contains-any", [None], ["null"]), ("contains-any", [[1, 2]], ["1,2"]), ("contains-any", {"a": 1}, ["a"]),
                      ("contains-any", 5, ["5"]), ("contains-any", True, ["true"]), ("contains-all", [1.0, "b"], ["1 b"]),
                      ("icontains-all", [True, "X"], ["TRUE x"]), ("not-contains", 7, ["7", "8"]), ("not-equals", 3, ["3", "4"]),
                      ("contains", {"a": 1}, ["[object Object]"]), ("contains", [1], ["1"])]:
    rows("numbers", kind, v, outs)

# comma-separated strings for contains-any / -all
for kind in ("contains-any", "contains-all", "icontains-any", "icontains-all", "not-contains-any", "not-contains-all"):
    for v in ["cat,dog", "cat, dog", " cat ,, dog ", '"cat,dog",bird', '"a""b", c', '"a\\"b"', '"unterminated',
              '"cat" dog', ",,,", "Cat", "cat,", '"", x']:
        rows("commas", kind, v, ["a cat and a dog", 'a"b, c', "CAT bird cat,dog"])

# empty and missing values
for kind in ("contains", "icontains", "not-contains", "not-icontains", "starts-with", "not-starts-with", "regex", "not-regex",
             "contains-any", "contains-all", "icontains-any", "equals", "not-equals"):
    rows("empty", kind, "", ["", "x"])
    rows("empty", kind, ABSENT, ["x", "undefined"])
    rows("empty", kind, None, ["x", "null"])
for kind, v in [("contains-any", []), ("contains-all", []), ("icontains-all", []), ("contains-any", [""]), ("is-json", ""),
                ("contains-json", ""), ("is-json", 0), ("contains", " ")]:
    rows("empty", kind, v, ["x", "{}", " "])

# JavaScript's RegExp
for pattern, outs in [
    (r"\d$", ["4\n", "4"]), (r"^a$", ["a\nb", "a"]), (r"\d", ["٣", "3"]), (r"\w", ["é", "_"]), (r"^\s$", ["\u00a0", "\u0085", "\u2028", "\ufeff", "\x1c", "\v"]),
    (r"^.$", ["\r", "\n", "\u2028", "\u2029", "😀", "é"]), (r"^..$", ["😀"]), ("😀", ["a😀"]), (r"\ud83d", ["😀"]), ("(?i)a", ["a"]), ("(?P<n>a)", ["a"]),
    (r"(?<n>a)\k<n>", ["aa", "ab"]), (r"\Z", ["Z", "abc"]), (r"\A", ["A", "abc"]), ("a{,2}", ["a{,2}", "aa"]), ("[[:alpha:]]", ["a", "[:a]"]),
    ("(?<=a)b", ["ab", "cb"]), ("(?<!a)b", ["ab", "cb"]), (r"\bé\b", [" é "]), ("[^]", ["x", ""]), ("[]", ["x"]), (r"\p{L}", ["p{L}", "a"]),
    (r"\cJ", ["\n"]), (r"\0", ["\x00", "0"]), (r"\1", ["\x01", "1"]), ("a**", ["a"]), (r"\k<n>", ["k<n>"]), ("(?<a>x)(?<a>y)", ["xy"]),
    (r"\u{41}", ["A", "u" * 41]), (r"\x41", ["A"]), (r"\/", ["/"]), ("a|", ["b"]), ("(?=a)", ["a", "b"]), ("a{", ["a{"]), ("]", ["]"]),
    ("}", ["}"]), ("x{2,1}", ["xx"]), ("*", ["*"]), ("(", ["("]), ("[b-a]", ["b"]), (r"[\d-z]", ["-", "5"]), ("(?:a)+$", ["aa\n"]),
    (r"\s+", ["\t"]), (r"^[A-Z]+$", ["ABC", "ÀBC"]), ("(?i:a)", ["A"]), (r"\$", ["$"]), (r"[\w-]", ["-"]), (r"a\b", ["aé"]),
    (r"(a)|b", ["b"]), (r"^\S+$", ["\u00a0a", "ab"]), ("^$", ["", "\n"]), (r"\n$", ["a\n"]), (r"\D", ["٣"]), (r"\W", ["é"]),
]:
    rows("regex", "regex", pattern, outs)
    rows("regex", "not-regex", pattern, outs[:1])

# is-json: JSON.parse
for out in ["NaN", "Infinity", "-Infinity", "1", " 1 ", "\u00a01", "{}", "{'a':1}", '{"a":1,}', "[1,]", "01", "1.", ".5", "-0",
            "1e5", '"\\x41"', '"\\u00e9"', '"a\tb"', "true", "null", "", " ", "\n{}\n", "\ufeff{}", '{"a":1}{"b":2}',
            "\u2028{}", "{}\x0c", '"\\ud800"', "[1, 2, {\"a\": [null]}]", "1e400", "-", "[-]", '{"a" 1}', "tru", '"\\/"', '"\\a"',
            DEEP_ARRAY, DEEP_OBJECT]:
    rows("is-json", "is-json", ABSENT, [out])
    rows("is-json", "not-is-json", ABSENT, [out])

# contains-json: promptfoo's extraction (brace counting, YAML flow mappings, // comments)
for out in ['x {"a":1} y', "{a: 1}", "[1,2]", '{"a": "}"}', "{}", "{ }", "{{}}", '{"a": 1 // comment\n}', '{"url": "http://x"}',
            'text {"a": [1, 2', '{"a":1', '} {"a": 1}', "{a: b: c}", "{'a': 1}", '{"a": NaN}', "{a: .nan}", '{"a":1}{',
            '{\t"a": 1}', "{\ta: 1}", "{ a: [1, {b: 2}] }", "{!!str a: 1}", "{&x a: *x}", "{? a : b}", "{a: 2025-05-01}", "{@a: 1}",
            "{`a`: 1}", "{-: 1}", "{a: 1, a: 2}", "{[1]: 2}", '{"a": "\\q"}', '{"a": "\\/"}', "{a: 'it''s'}", "no json",
            "{a}", "{a, b}", "{'a: 1}", "{\"a\": 'b\"}", "{a: !foo 1}", "{a: [}", "{a: 1}}", "{# x}", "{a: # x\n1}", "{ // x\n}",
            "{a: //x\n1}", "prefix {\n  \"a\": 1\n} suffix", "{a: b}c}", "{|}", "{>}", "{%a: 1}", "{a: \"\\x41\"}", "{a: \"\\e\"}",
            "[{\"a\": 1}]", "{ a:1 }", "{a:1}", "{\"a\":1}", "{a: 1,}", "{,}", "{a: {b: {c: {}}}}", DEEP_OBJECT,
            "{" * 300 + "}" * 300, "{\"a\": \"{\"}", "{\"a\": \"\\\"}\"}"]:
    rows("contains-json", "contains-json", ABSENT, [out])
    rows("contains-json", "not-contains-json", ABSENT, [out])

# is-json and contains-json with a JSON schema: promptfoo's own ajv (strict schemas, ajv-formats)
SCHEMA = {"type": "object", "required": ["color"],
          "properties": {"color": {"type": "string"}, "n": {"type": "integer", "minimum": 1}}}
for kind, outs in [("is-json", ['{"color": "red"}', '{"color": 1}', '{"n": 2}', '{"color": "red", "n": 0}', "not json", "[1]"]),
                   ("contains-json", ['x {"color": "red"} y', '{"n": 1} {"color": "blue"}', '{"color": 3}', "none",
                                      "{color: red}", '{"color": "red", "n": 1.5}'])]:
    rows("json-schema", kind, SCHEMA, outs)
    rows("json-schema", f"not-{kind}", SCHEMA, outs)
rows("json-schema", "is-json", "type: object\nrequired: [a]", ['{"a": 1}', '{"b": 1}'])  # a schema written as YAML text
rows("json-schema", "is-json", {"type": "string", "format": "email"}, ['"a@b.co"', '"nope"'])  # ajv-formats
rows("json-schema", "is-json", {"$id": "num", "type": "number"}, ["1", '"1"'])
rows("json-schema", "is-json", {"type": "object", "colour": 1}, ["{}"])  # strict: an unknown keyword is an error

# values templated from the test's vars
V = {"word": "cat", "n": 4, "x": 1.0, "flag": True, "nums": [1, 2], "obj": {"a": "b"}, "html": "<b>&", "pat": "^c.t$"}
for kind, v, outs in [("contains", "{{ word }}", ["a cat", "a dog"]), ("contains", "{{word}}s", ["cats"]), ("contains", "{{ missing }}", ["x"]),
                      ("contains", "{{ missing }}x", ["x"]), ("equals", "{{ n }}", ["4"]), ("equals", "{{ x }}", ["1", "1.0"]),
                      ("equals", "{{ flag }}", ["true", "True"]), ("equals", "{{ nums }}", ["1,2"]), ("equals", "{{ obj.a }}", ["b"]),
                      ("equals", "{{ obj }}", ["[object Object]"]), ("equals", "{{ word | upper }}", ["CAT"]),
                      ("equals", "{% if flag %}yes{% endif %}", ["yes"]), ("equals", "{# c #}x", ["x"]), ("contains", "{{", ["{{"]),
                      ("equals", "{{ word }}\n", ["cat\n", "cat"]), ("regex", "{{ pat }}", ["cat", "cut"]), ("contains-any", ["{{ word }}", "z"], ["cat"]),
                      ("contains-any", "{{ word }}, z", ["cat"]), ("contains", "{{ html }}", ["<b>&", "&lt;b&gt;&amp;"]),
                      ("equals", "{{ n + 1 }}", ["5"]), ("equals", "{{ word ~ '!' }}", ["cat!"]), ("equals", "{{ nums | length }}", ["2"]),
                      ("starts-with", "{{ word }}", ["cats"]), ("not-contains", "{{ word }}", ["dog"]), ("equals", {"k": "{{ word }}"}, ['{"k": "{{ word }}"}', '{"k": "cat"}']),
                      ("equals", ["{{ word }}"], ['["cat"]']), ("equals", "{{ n * 1.5 }}", ["6"]), ("equals", "{{ 7 / 2 }}", ["3.5"]),
                      ("equals", "{{ 'a' if false else 'b' }}", ["b"]), ("contains", "{{ word }", ["{{ word }"]), ("equals", "{{ none }}", [""])]:
    rows("templating", kind, v, outs, V)

# YAML scalars read as js-yaml reads them (YAML 1.2 core schema)
for token, outs in [("yes", ["yes", "true"]), ("no", ["no", "false"]), ("on", ["on"]), ("1e3", ["1000", "1e3"]), ("010", ["10", "8"]),
                    ("0o17", ["15"]), ("0x1F", ["31"]), ("1_000", ["1_000", "1000"]), ("~", ["null"]), ("2025-05-03", ["2025-05-03"]),
                    ("12:30", ["12:30", "750"]), ("+1", ["1"]), (".5", ["0.5"]), ("1.", ["1"]), ("True", ["true"]), ("NULL", ["x"]),
                    ("-.inf", ["-Infinity"]), ("0b11", ["0b11", "3"]), ("=", ["="]), ("1e999", ["1e999"])]:
    rows("yaml", "contains", Raw(token), outs)
    rows("yaml", "equals", Raw(token), outs[:1])

# case folding and the rest of the string types
for kind, v, outs in [("icontains", "İ", ["i̇", "i"]), ("icontains", "ß", ["SS", "ß"]), ("icontains", "σ", ["ΑΣ"]), ("icontains", "ǅ", ["ǆ"]),
                      ("icontains-any", ["ΑΣ"], ["ας"]), ("starts-with", "Yes", ["Yes, it is", " Yes", "yes"]), ("not-starts-with", "a", ["ab", "ba"]),
                      ("equals", "Paris", ["Paris", "Paris ", "Paris\n", "paris"]), ("not-equals", "x", ["x", "y"]),
                      ("contains", "\n", ["a\nb", "ab"]), ("equals", "😀", ["😀"]), ("contains", "e\u0301", ["é"])]:
    rows("strings", kind, v, outs)

# strings as JavaScript compares them: UTF-16 code units (a lone surrogate is half an emoji; "\ud83d\ude00"
# escapes are the emoji) and toLowerCase (surrogate pairs as one character, Unicode 17's case pairs)
for kind, v, outs in [("contains", "\ud83d", ["a😀b", "ab"]), ("contains", "\ude00", ["😀"]), ("contains", "\ud83d\ude00", ["😀"]),
                      ("not-contains", "\ud83d", ["😀", "a"]), ("icontains", "\ud83d", ["😀"]), ("icontains", "\ud801\udc00", ["𐐨", "𐐀"]),
                      ("icontains", "\ua7cb", ["ɤ"]), ("icontains", "\U00010d50", ["\U00010d70"]), ("icontains", "\u1c89", ["\u1c8a"]),
                      ("icontains-any", ["\ud83d", "x"], ["😀"]), ("icontains-all", ["\ua7dc", "\ud83d"], ["ƛ😀"]),
                      ("contains-any", "\ud83d, x", ["😀"]), ("contains-all", ["\ud83d", "\ude00"], ["😀"]), ("not-contains-any", ["\ude00"], ["😀"]),
                      ("starts-with", "\ud83d", ["😀 hi", "hi 😀"]), ("not-starts-with", "\ud83d", ["😀"]), ("equals", "\ud83d\ude00", ["😀", "x"]),
                      ("not-equals", "\ud83d\ude00", ["😀"]), ("equals", {"k": "😀"}, ['{"k": "\\ud83d\\ude00"}']), ("equals", ["\ud83d\ude00"], ['["😀"]'])]:
    rows("utf-16", kind, v, outs)

# a missing var is JavaScript's undefined (promptfoo's nunjucks has no throwOnUndefined)
for kind, v, outs in [("equals", "{{ missing.a }}x", ["x"]), ("contains", "{{ obj.zz.b }}y", ["y"]), ("equals", "{{ missing[0] }}", [""]),
                      ("equals", "{{ missing ~ '!' }}", ["undefined!", "!"]), ("equals", "{{ 'a' + missing }}", ["aundefined"]),
                      ("equals", "{{ missing + 1 }}", ["NaN"]), ("equals", "{{ -missing }}", ["NaN"]), ("equals", "{{ missing | abs }}", ["NaN"]),
                      ("equals", "{{ missing | upper }}x", ["x"]), ("equals", "{{ missing | default('d') }}", ["d"]),
                      ("equals", "{{ missing.a | default('d') }}", ["d"]), ("equals", "{{ missing | length }}", ["0"]),
                      ("equals", "{{ missing | int }}|", ["|"]), ("equals", "{{ missing | int ~ '|' }}", ["undefined|"]),
                      ("equals", "{{ missing | center(3) }}|", ["   |"]), ("contains", "{{ missing | join(',') }}x", ["x"]),
                      ("contains", "{{ missing | trim }}x", ["x"]), ("contains", "{{ missing | first }}x", ["x"]),
                      ("equals", "{{ missing == none }}", ["true"]), ("equals", "{{ missing > 0 }}", ["false"]),
                      ("equals", "{{ 'a' in missing }}", ["false"]), ("contains", "{{ missing() }}x", ["x"]),
                      ("equals", "{% for i in missing %}a{% else %}e{% endfor %}", ["e"]), ("equals", "{{ [missing, 1] | join('-') }}", ["-1"]),
                      ("equals", "{{ [missing, 1] }}", [",1"]), ("equals", "{{ nums[5] ~ 'x' }}", ["undefinedx"]),
                      ("contains-any", ["{{ missing }}", "{{ missing.a }}z"], ["z"]), ("contains", "{{ missing | tojson }}x", ["x"]),
                      ("equals", "{{ nums | join(missing) }}", ["1,2"]), ("equals", "{{ missing | replace('a', 'b') ~ '|' }}", ["undefined|"])]:
    rows("undefined", kind, v, outs, V)


def _scalar(v) -> str:
    """A YAML value as flow text: JSON, except Raw tokens, and characters js-yaml will not take raw escaped."""
    if isinstance(v, Raw):
        return str(v)
    text = json.dumps(v, ensure_ascii=False)
    # (lone surrogates, which YAML text cannot hold, as the escapes js-yaml reads back to them)
    return re.sub("[\x7f-\x9f\u2028\u2029\ufeff\ufffe\uffff\ud800-\udfff]", lambda m: "\\u%04x" % ord(m.group()), text)


def config() -> str:
    """The promptfoo config (flow YAML) for every row, in order: test i is ROWS[i]."""
    tests = []
    for i, (cls, kind, value, out, vars) in enumerate(ROWS):
        assertion = f'{{"type": {_scalar(kind)}' + ("" if value is ABSENT else f', "value": {_scalar(value)}') + "}"
        # the output is no var where it can be helped: promptfoo renders string vars as templates too
        all_vars = ", ".join(f"{_scalar(k)}: {_scalar(v)}" for k, v in {**vars, **({} if out else {"output": ""})}.items())
        # providerOutput is graded as it is (the prompt itself is trimmed on the way to a provider)
        tests.append(f'  - {{"description": "{i} {cls}", "vars": {{{all_vars}}}, "providerOutput": {_scalar(out)}, '
                     f'"assert": [{assertion}]}}')
    return 'description: gatekeeper oracle\nproviders: [echo]\nprompts: ["{{output}}"]\ntests:\n' + "\n".join(tests) + "\n"
