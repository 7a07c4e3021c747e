"""Assertion values templated from a test's vars, as promptfoo does with nunjucks (``{{ var }}``).

nunjucks is a port of Jinja2, so Jinja2 (sandboxed) renders the same templates; what differs is how a
value prints, which follows JavaScript (``true``, ``1`` for 1.0, ``a,b`` for a list, nothing for null or a
missing var), and that nunjucks keeps a template's trailing newline.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Mapping

import jinja2
from jinja2.sandbox import SandboxedEnvironment

from .value import js_string

MARKS = ("{{", "{%", "{#")


def _finalize(v: Any) -> str:
    return "" if v is None or isinstance(v, jinja2.Undefined) else js_string(v)


@lru_cache(maxsize=1)
def _env() -> SandboxedEnvironment:
    return SandboxedEnvironment(autoescape=False, keep_trailing_newline=True, finalize=_finalize,
                                undefined=jinja2.Undefined)


def render(template: str, vars: Mapping[str, Any]) -> str:
    """``nunjucks.renderString(template, vars)``; a template error is a ValueError naming it."""
    if not any(m in template for m in MARKS):
        return template
    try:
        return _env().from_string(template).render(dict(vars))
    except jinja2.TemplateError as e:
        raise ValueError(f"the template {template!r} cannot be rendered ({e})") from None


def render_value(value: Any, vars: Mapping[str, Any]) -> Any:
    """A string value, or each string of a list value, rendered; anything else unchanged."""
    if isinstance(value, str):
        return render(value, vars)
    if isinstance(value, list):
        return [render(v, vars) if isinstance(v, str) else v for v in value]
    return value
