"""Assertion types: each one a pure function of the model's output text.

The types promptfoo also has (``SHARED``) mean exactly what promptfoo 0.123.1 means, down to how a
numeric value prints, how a comma-separated list splits, JavaScript's RegExp and JSON.parse, strings compared
as UTF-16 code units and lower-cased by toLowerCase, and which values it refuses (refused here at load,
exit 2, where promptfoo would error at run time); a ``not-`` prefix inverts any of them.
tests/test_promptfoo_oracle.py proves it against promptfoo itself.
``one-of``, ``max-length`` and ``min-length`` are gatekeeper's own (promptfoo has no such types).
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, cast

from ..evidence import AssertionOutcome
from ..js import regex
from ..js import yaml as jsyaml
from ..js.value import JSONError, code_units, deep_equal, is_js_space, is_json, js_lower, js_string, js_trim, parse_json, truthy
from ..js.value import stringify as stringify  # JSON.stringify, for gate/ (whose layer imports battery, not js)
from ..workspace import Assertion, Suite
from . import types
from .types import base_type

FAMILY = types.CHECKS  # this module's types, declared in the registry


class Refused(ValueError):
    """A value promptfoo cannot use (it would error) or gatekeeper will not guess at."""


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _needle(kind: str) -> Callable[[Any], str]:
    def prepare(v: Any) -> str:
        if (isinstance(v, str) and v) or (_is_number(v) and not math.isnan(v)):
            return js_string(v)
        raise Refused(f"'value' must be a non-empty string or a number (promptfoo's {kind} refuses {js_string(v)!r})")
    return prepare


def _text(kind: str) -> Callable[[Any], str]:
    def prepare(v: Any) -> str:
        if isinstance(v, str) and v:
            return v
        raise Refused(f"'value' must be a non-empty string ({kind})")
    return prepare


def _regex(v: Any) -> regex.JSRegExp:
    try:
        return regex.compile(_text("regex")(v))
    except ValueError as e:
        if isinstance(e, Refused):
            raise
        raise Refused(f"'value' is not a valid regular expression (as JavaScript's RegExp reads it: {e}); fix the pattern") from None


def comma_list(s: str) -> list[str]:
    """promptfoo's parseCommaSeparatedValues: fields split on commas and trimmed; a "quoted, field"
    keeps its commas (\\" or "" for a quote inside)."""
    out, i, n = [], 0, len(s)
    while i < n:
        while i < n and (is_js_space(s[i]) or s[i] == ","):
            i += 1
        if i >= n:
            break
        if s[i] != '"':
            j = s.find(",", i)
            j = n if j < 0 else j
            out.append(js_trim(s[i:j]))
            i = j
            continue
        field, i, closed = [], i + 1, False
        while i < n:
            if s[i] == "\\" and s[i + 1: i + 2] in ('"', "\\"):
                field.append(s[i + 1])
                i += 2
            elif s[i: i + 2] == '""':
                field.append('"')
                i += 2
            elif s[i] == '"':
                i, closed = i + 1, True
                break
            else:
                field.append(s[i])
                i += 1
        if not closed:
            raise Refused(f"'value' {s!r} has an unterminated quoted field; close the quote")
        while i < n and is_js_space(s[i]):
            i += 1
        if i < n and s[i] != ",":
            raise Refused(f"'value' {s!r}: expected a comma after a quoted field")
        out.append("".join(field))
    return out


def _many(v: Any) -> list[str]:
    if not truthy(v):
        raise Refused("'value' must be a list of strings, or a comma-separated string, and not empty")
    if isinstance(v, str):
        v = comma_list(v)
    if not isinstance(v, list):
        raise Refused(f"'value' must be a list of strings, or a comma-separated string (not {js_string(v)!r})")
    return [js_string(x) for x in v]


def _equals(v: Any) -> tuple[str, Any]:
    if v is None:
        raise Refused("needs a 'value' (promptfoo compares a missing one with the text 'undefined'; null with JSON null)")
    if isinstance(v, (list, dict)):
        return ("json", v)
    if not isinstance(v, (str, int, float)):
        raise Refused(f"'value' {v!r} is a YAML {type(v).__name__}, never equal to an output; quote it")
    return ("text", js_string(v))


def _equals_check(out: str, prepared: tuple[str, Any]) -> bool:
    kind, v = prepared
    if kind == "text":
        return out == v or code_units(out) == code_units(v)
    try:
        return deep_equal(v, parse_json(out))
    except JSONError:
        return False


def _schema(v: Any) -> Any:
    """None, or the JSON schema an is-json/contains-json value gives (YAML text is read as promptfoo reads it),
    compiled once by promptfoo's ajv so that a schema it refuses is refused at load."""
    if not truthy(v):
        return None
    if isinstance(v, str):
        try:
            v = jsyaml.load(v)
        except Exception as e:  # noqa: BLE001 - whatever js-yaml cannot read
            raise Refused(f"'value' is not a readable JSON schema ({e}); fix it") from None
    elif not isinstance(v, dict):
        raise Refused(f"'value' must be a JSON schema (an object, or YAML text), not {js_string(v)!r}")
    scripted = _sibling("scripted")
    if not scripted.promptfoo_setup.node().is_file():
        raise Refused("a JSON schema is checked by promptfoo's ajv, under the node that 'make promptfoo' installs, and "
                      "it is not installed; run 'make promptfoo'")
    try:
        scripted.schema_valid(v, [])
    except scripted.CallFailed as e:
        raise Refused(f"'value' is a JSON schema that ajv refuses ({e}); fix it") from None
    return v


def _conforms(values: list, schema: Any) -> list[bool]:
    return _sibling("scripted").schema_valid(schema, values)


def _is_json(out: str, schema: Any) -> bool:
    if schema is None:
        return is_json(out)
    try:
        value = parse_json(out)
    except JSONError:
        return False
    return _conforms([value], schema)[0]


def _contains_json(out: str, schema: Any) -> bool:
    if schema is None:
        return jsyaml.has_json_object(out)
    return any(_conforms(jsyaml.json_objects(out), schema))


def _strings(v: Any) -> list[str]:
    if isinstance(v, list) and v and all(isinstance(s, str) for s in v):
        return v
    raise Refused("'value' must be a list of strings (non-empty)")


def _length(v: Any) -> int:
    if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
        return v
    raise Refused("'value' must be a non-negative integer")


def _units(prepare: Callable[[Any], Any], fold: Callable[[str], str] = str) -> Callable[[Any], Any]:
    """Needles (one, or a list) as JavaScript compares them: UTF-16 code units, lower-cased first for i-types."""
    def prepared(v: Any) -> list[str]:
        v = prepare(v)
        return [code_units(fold(s)) for s in (v if isinstance(v, list) else [v])]
    return prepared


def _found(fold: Callable[[str], str] = str, quantifier: Callable = all) -> Callable[[str, list[str]], bool]:
    """JavaScript's ``output.includes(needle)`` (lower-cased first for i-types) for all or any needle."""
    def check(out: str, needles: list[str]) -> bool:
        hay = code_units(fold(out))
        return quantifier(n in hay for n in needles)
    return check


# base type -> (prepare(value) -> prepared, check(output, prepared) -> bool)
SHARED: dict[str, tuple[Callable[[Any], Any], Callable[[str, Any], bool]]] = {
    "equals": (_equals, _equals_check),
    "contains": (_units(_needle("contains")), _found()),
    "icontains": (_units(_needle("icontains"), js_lower), _found(js_lower)),
    "starts-with": (_units(_text("starts-with")), lambda out, v: code_units(out).startswith(v[0])),
    "regex": (_regex, lambda out, r: r.search(out)),
    "contains-any": (_units(_many), _found(quantifier=any)),
    "contains-all": (_units(_many), _found()),
    "icontains-any": (_units(_many, js_lower), _found(js_lower, any)),
    "icontains-all": (_units(_many, js_lower), _found(js_lower)),
    "is-json": (_schema, _is_json),
    "contains-json": (_schema, _contains_json),
}
GATEKEEPER_ONLY: dict[str, tuple[Callable[[Any], Any], Callable[[str, Any], bool]]] = {
    "one-of": (_strings, lambda out, v: out.strip() in v),
    "max-length": (_length, lambda out, v: len(out) <= v),
    "min-length": (_length, lambda out, v: len(out) >= v),
}
CHECKS = {**SHARED, **{f"not-{t}": SHARED[t] for t in SHARED}, **GATEKEEPER_ONLY}

# promptfoo types that are more than a function of the output text: base type -> the module of this package
# that evaluates it, as the registry declares (battery/types.py). Each is imported when first used, so the CLI
# never loads a grader or a subprocess runner it does not need. A module exposes ``prepare(assertion) -> Any``
# (raises Refused at load) and ``evaluate(assertion, output, context) -> dict`` (``{"pass": bool, ...}``; raises
# Refused when it cannot decide).
EVALUATED_BY: dict[str, str] = {t: f.module for f in types.FAMILIES.values() if f is not FAMILY for t in f.types}


@dataclass(frozen=True)
class Context:
    """What an assertion may see besides the output: the case's vars and rendered prompt, and the graders
    the evaluation opened (``graders``: None when the battery needs none)."""

    vars: Mapping[str, Any] = field(default_factory=dict)
    prompt: str = ""
    graders: Any = None
    response: Any = None  # providerResponse.output when a test's transform changed it (None: the output)


def evaluable(kind: str) -> bool:
    """Whether gatekeeper evaluates this type (``not-`` forms included)."""
    return kind in CHECKS or base_type(kind) in EVALUATED_BY


def _sibling(name: str):
    """A module of this package that builds on this one (Refused, Context), loaded by name when first used."""
    return importlib.import_module(f".{name}", __package__)


def _module(kind: str):
    return _sibling(EVALUATED_BY[base_type(kind)])


def prepare(a: Assertion) -> Any:
    """The assertion's value made ready to check; raises Refused for a value it cannot use."""
    if a.type not in CHECKS:
        return _module(a.type).prepare(a)
    return CHECKS[a.type][0](a.value)


def evaluate(assertion: Assertion, output: str, context: Context = Context()) -> dict[str, Any]:
    """``{"pass": bool, ...}`` for one assertion on one output (``not-`` inverts ``pass``), after the
    suite's transforms where it has them (battery/transform.py)."""
    inverse = assertion.type.startswith("not-")
    value: Any = output
    if any(k in assertion.options for k in ("output_transform", "transform")):
        transform = _sibling("transform")
        try:
            value, output, response = transform.apply(assertion.options, output, dict(context.vars), context.prompt)
        except transform.Failed as e:  # the test ended in an error: every assertion fails, not- or not
            return {"pass": False, "score": 0, "reason": str(e)}
        context = replace(context, response=response)
    if assertion.type in CHECKS:
        passed = CHECKS[assertion.type][1](output, prepare(assertion))
        return {"pass": passed != inverse}
    takes_value = EVALUATED_BY[base_type(assertion.type)] == "scripted"  # the user's code gets the value as it is
    result = _module(assertion.type).evaluate(assertion, value if takes_value else output, context)
    return {**result, "pass": result["pass"] != inverse}


def check(assertion: Assertion, output: str, context: Context = Context()) -> bool:
    return evaluate(assertion, output, context)["pass"]


def _value_problem(a: Assertion) -> str | None:
    try:
        prepare(a)
    except Refused as e:
        return str(e)
    return None


def validate_suite(suite: Suite) -> list[str]:
    """Every assertion whose value cannot be checked, named by suite, case and assertion."""
    problems = []
    for case in suite.cases:
        vars = {**case.vars, **{k: v for turn in case.turns for k, v in turn.items()}}
        for n, a in enumerate(case.assert_, 1):
            needs = getattr(_module(a.type), "needs", lambda a: ()) if a.type not in CHECKS else lambda a: ()
            lacking = [name for name in needs(a) if not vars.get(name)]
            problem = _value_problem(a) or (f"{base_type(a.type)} needs a non-empty {lacking[0]!r} var in each test; add it "
                                            "to the test's vars" if lacking else None)
            if problem:
                label = a.name or a.type
                problems.append(f"suite {suite.suite!r}, case {case.id!r}, assertion {n} ({label}): {problem}")
    return problems


def outcomes(assertions: list[Assertion], output: str, context: Context = Context()) -> list[AssertionOutcome]:
    """Each assertion's outcome, in order, as recorded in the ledger."""
    return [cast(AssertionOutcome, {"type": a.type, "name": a.name, **evaluate(a, output, context)}) for a in assertions]
