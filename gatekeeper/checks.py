"""Assertion types: each one a pure function of the model's output text.

Names and meanings follow promptfoo's deterministic assertions, so existing test cases carry over.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable

from .workspace import Assertion, Suite


def _json_values(text: str):
    """Every JSON object or array that parses starting at some '{' or '['."""
    decoder = json.JSONDecoder()
    for i, ch in enumerate(text):
        if ch in "{[":
            try:
                yield decoder.raw_decode(text, i)[0]
            except json.JSONDecodeError:
                continue


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except json.JSONDecodeError:
        return False


_STR, _LIST, _INT, _NONE = "a string", "a list of strings", "a non-negative integer", "no value"

# type -> (what `value` must be, check(output, value))
CHECKS: dict[str, tuple[str, Callable[[str, Any], bool]]] = {
    "equals": (_STR, lambda out, v: out == v),
    "contains": (_STR, lambda out, v: v in out),
    "icontains": (_STR, lambda out, v: v.lower() in out.lower()),
    "not-contains": (_STR, lambda out, v: v not in out),
    "not-icontains": (_STR, lambda out, v: v.lower() not in out.lower()),
    "starts-with": (_STR, lambda out, v: out.startswith(v)),
    "regex": (_STR, lambda out, v: re.search(v, out) is not None),
    "not-regex": (_STR, lambda out, v: re.search(v, out) is None),
    "one-of": (_LIST, lambda out, v: out.strip() in v),
    "contains-any": (_LIST, lambda out, v: any(s in out for s in v)),
    "contains-all": (_LIST, lambda out, v: all(s in out for s in v)),
    "icontains-any": (_LIST, lambda out, v: any(s.lower() in out.lower() for s in v)),
    "icontains-all": (_LIST, lambda out, v: all(s.lower() in out.lower() for s in v)),
    "is-json": (_NONE, lambda out, v: _is_json(out.strip())),
    "contains-json": (_NONE, lambda out, v: next(_json_values(out), None) is not None),
    "max-length": (_INT, lambda out, v: len(out) <= v),
    "min-length": (_INT, lambda out, v: len(out) >= v),
}


def check(assertion: Assertion, output: str) -> bool:
    return CHECKS[assertion.type][1](output, assertion.value)


def _value_problem(a: Assertion) -> str | None:
    kind = CHECKS[a.type][0]
    v = a.value
    if kind == _STR and not isinstance(v, str):
        return f"'value' must be {kind}"
    if kind == _LIST and not (isinstance(v, list) and v and all(isinstance(s, str) for s in v)):
        return f"'value' must be {kind} (non-empty)"
    if kind == _INT and not (isinstance(v, int) and not isinstance(v, bool) and v >= 0):
        return f"'value' must be {kind}"
    if kind == _NONE and v is not None:
        return "takes no 'value'; remove it"
    if a.type in ("regex", "not-regex"):
        try:
            re.compile(v)
        except re.error as e:
            return f"'value' is not a valid regular expression ({e}); fix the pattern"
    return None


def validate_suite(suite: Suite) -> list[str]:
    """Every assertion whose value cannot be checked, named by suite, case and assertion."""
    problems = []
    for case in suite.cases:
        for n, a in enumerate(case.assert_, 1):
            problem = _value_problem(a)
            if problem:
                label = a.name or a.type
                problems.append(f"suite {suite.suite!r}, case {case.id!r}, assertion {n} ({label}): {problem}")
    return problems


def outcomes(assertions: list[Assertion], output: str) -> list[dict[str, Any]]:
    """Each assertion's outcome, in order, as recorded in the ledger."""
    return [{"type": a.type, "name": a.name, "pass": check(a, output)} for a in assertions]
