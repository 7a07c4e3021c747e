"""Assertion values templated from a test's vars, as promptfoo does with nunjucks (``{{ var }}``).

nunjucks is a port of Jinja2, so Jinja2 (sandboxed) renders the same templates; what differs is how a
value prints, which follows JavaScript (``true``, ``1`` for 1.0, ``a,b`` for a list, nothing for null or a
missing var), that nunjucks keeps a template's trailing newline, and what a missing var does. promptfoo
configures nunjucks without ``throwOnUndefined``, so a missing var is JavaScript's ``undefined``: it prints
as nothing, its attributes are undefined too, ``~`` joins it as the text ``undefined``, arithmetic on it is
NaN, and each filter does what nunjucks' filter does with it (``upper`` gives "", ``length`` 0, ``join`` is
an error). Filters nunjucks does not have are errors, as in nunjucks; so is promptfoo's ``env`` global
(its process environment), which gatekeeper does not see.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Callable, Mapping

import jinja2
from jinja2 import meta
from jinja2.sandbox import SandboxedEnvironment

from .value import js_string, truthy

MARKS = ("{{", "{%", "{#")
NAN = float("nan")


class JSUndefined(jinja2.Undefined):
    """JavaScript's ``undefined`` as nunjucks treats a missing var."""

    __slots__ = ()

    def __str__(self) -> str:  # String(undefined): what ``~`` and ``+ "x"`` join
        return "undefined"

    def __getattr__(self, name: str) -> Any:
        if name[:2] == "__":
            raise AttributeError(name)
        return JSUndefined(name=name)  # nunjucks' memberLookup: undefined.a is undefined

    def __getitem__(self, key: Any) -> Any:
        return JSUndefined(name=str(key))

    def __add__(self, other: Any) -> Any:  # JavaScript's +: text when either side is text, else NaN
        return "undefined" + js_string(other) if isinstance(other, (str, list, dict)) else NAN

    def __radd__(self, other: Any) -> Any:
        return js_string(other) + "undefined" if isinstance(other, (str, list, dict)) else NAN

    def _nan(self, *_: Any) -> float:
        return NAN

    __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = _nan
    __floordiv__ = __rfloordiv__ = __mod__ = __rmod__ = __pow__ = __rpow__ = __neg__ = __pos__ = _nan

    def _false(self, _: Any) -> bool:  # undefined < x, > x, ... compare NaN: always false
        return False

    __lt__ = __le__ = __gt__ = __ge__ = _false

    def __eq__(self, other: Any) -> bool:  # nunjucks' == is JavaScript's loose ==: undefined == null
        return other is None or isinstance(other, jinja2.Undefined)

    def __ne__(self, other: Any) -> bool:
        return not self.__eq__(other)

    __hash__ = jinja2.Undefined.__hash__

    def __contains__(self, item: Any) -> bool:  # nunjucks: "cannot use 'in' operator ... unexpected types"
        self._fail_with_undefined_error()


def _default(value: Any, default: Any = JSUndefined(), boolean: bool = False) -> Any:
    """nunjucks' ``default``: replaces only undefined (null stays), or any falsy value with ``boolean``."""
    if boolean:
        return value if truthy(value) and not isinstance(value, jinja2.Undefined) else default
    return default if isinstance(value, jinja2.Undefined) else value


def _join(value: Any, delimiter: str = "", attribute: Any = None) -> str:
    """nunjucks' ``join`` is JavaScript's Array.prototype.join: null and undefined items join as ""."""
    if isinstance(value, (str, dict)) or not hasattr(value, "__iter__"):
        raise jinja2.TemplateRuntimeError("nunjucks' join filter needs a list")
    value = list(value)
    if attribute is not None:
        value = [x.get(attribute) if isinstance(x, dict) else None for x in value]
    return js_string(delimiter).join(_finalize(x) for x in value)


def _error(name: str) -> Callable[..., Any]:
    def fail(*_: Any, **__: Any) -> Any:
        raise jinja2.TemplateRuntimeError(f"nunjucks' {name} filter fails on an undefined or null value")
    return fail


# what each nunjucks filter gives for an undefined or null value (the rest are errors there)
_ON_UNDEFINED: dict[str, Callable[..., Any]] = {
    **{f: (lambda v, *a, **k: "") for f in ("capitalize", "e", "escape", "forceescape", "indent", "lower", "reverse",
                                            "safe", "sort", "striptags", "title", "truncate", "upper", "urlencode")},
    "center": lambda v, width=80, *a, **k: " " * width,
    "length": lambda v, *a, **k: 0,
    "abs": lambda v, *a, **k: 0 if v is None else NAN,  # Math.abs(null) is 0, of undefined NaN
    "round": lambda v, *a, **k: 0 if v is None else NAN,
    "int": lambda v, default=None, *a, **k: v if default is None else default,  # parseInt fails: the default
    "float": lambda v, default=None, *a, **k: v if default is None else default,
    "replace": lambda v, *a, **k: v,
    "wordcount": lambda v, *a, **k: None,
}
# nunjucks' own filters; Jinja2's others (tojson, map, ...) are "filter not found" there
_NUNJUCKS = set(_ON_UNDEFINED) | {"d", "default", "batch", "dictsort", "first", "groupby", "join", "last", "list",
                                  "random", "reject", "rejectattr", "select", "selectattr", "slice", "string", "sum",
                                  "trim", "urlize"}


def _filter(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
    """Jinja2's filter, or nunjucks' result when the value is undefined or null."""
    on_undefined = _ON_UNDEFINED.get(name, _error(name))
    takes_context = hasattr(f, "jinja_pass_arg")  # the environment or context comes first

    def filtered(*args: Any, **kwargs: Any) -> Any:
        value = args[1] if takes_context else args[0]
        if value is None or isinstance(value, jinja2.Undefined):
            return on_undefined(value, *args[1 + takes_context:], **kwargs)
        return f(*args, **kwargs)
    if takes_context:
        filtered.jinja_pass_arg = f.jinja_pass_arg  # type: ignore[attr-defined]
    return filtered


def _plain(v: Any) -> Any:
    """A printed value: undefined prints as nothing, also inside a list (Array.prototype.join)."""
    if isinstance(v, jinja2.Undefined):
        return None
    return [_plain(x) for x in v] if isinstance(v, list) else v


def _finalize(v: Any) -> str:
    v = _plain(v)
    return "" if v is None else js_string(v)


@lru_cache(maxsize=1)
def _env() -> SandboxedEnvironment:
    env = SandboxedEnvironment(autoescape=False, keep_trailing_newline=True, finalize=_finalize, undefined=JSUndefined)
    env.filters = {name: _filter(name, f) for name, f in env.filters.items() if name in _NUNJUCKS}
    env.filters["d"] = env.filters["default"] = _default
    env.filters["join"] = _filter("join", _join)
    return env


def render(template: str, vars: Mapping[str, Any]) -> str:
    """``nunjucks.renderString(template, vars)``; a template error is a ValueError naming it."""
    if not any(m in template for m in MARKS):
        return template
    try:
        env = _env()
        parsed = env.parse(template)
        if "env" in meta.find_undeclared_variables(parsed) and "env" not in vars:
            raise ValueError("it reads promptfoo's 'env' (its process environment), which gatekeeper does not see; "
                             "pass the value as a var")
        return env.from_string(parsed).render(dict(vars))
    except Exception as e:  # noqa: BLE001 - whatever stops a user's template is that template's error
        raise ValueError(f"the template {template!r} cannot be rendered ({e})") from None


def render_value(value: Any, vars: Mapping[str, Any]) -> Any:
    """A string value, or each string of a list value, rendered; anything else unchanged."""
    if isinstance(value, str):
        return render(value, vars)
    if isinstance(value, list):
        return [render(v, vars) if isinstance(v, str) else v for v in value]
    return value
