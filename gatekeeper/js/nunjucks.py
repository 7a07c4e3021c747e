"""Prompts and assertion values templated from a test's vars, as promptfoo does with nunjucks (``{{ var }}``).

nunjucks is a port of Jinja2, so Jinja2 (sandboxed) renders the same templates; what differs is how a
value prints, which follows JavaScript (``true``, ``1`` for 1.0, ``a,b`` for a list, nothing for null or a
missing var), that nunjucks keeps a template's trailing newline, and what a missing var does. promptfoo
configures nunjucks without ``throwOnUndefined``, so a missing var is JavaScript's ``undefined``: it prints
as nothing, its attributes are undefined too, ``~`` joins it as the text ``undefined``, arithmetic on it is
NaN, and each filter does what nunjucks' filter does with it (``upper`` gives "", ``length`` 0, ``join`` is
an error). Filters nunjucks does not have are errors, as in nunjucks; so is promptfoo's ``env`` global
(its process environment), which gatekeeper does not see. promptfoo adds a ``load`` filter (``JSON.parse``)
and a config's custom filters (``render``'s ``filters``). A member (``a.b``, ``a["b"]``) of a JSON value is
looked up as JavaScript looks it up: a mapping's key (never a Python method), a string's or list's
``length``. ``render_prompt`` is promptfoo's renderPrompt: the vars prepared as it prepares them first.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable, Mapping

import jinja2
from jinja2 import meta, nodes
from jinja2.sandbox import SandboxedEnvironment
from jinja2.visitor import NodeTransformer

from .value import SAFE_INT, JSONError, code_units, js_lower, js_string, js_trim, parse_json, truthy

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
    "nl2br": lambda v, *a, **k: "",
    "string": lambda v, *a, **k: v,
    "dump": lambda v, *a, **k: "null" if v is None else JSUndefined(),  # JSON.stringify(undefined) is undefined
}
# nunjucks' own filters; Jinja2's others (tojson, map, ...) are "filter not found" there
_NUNJUCKS = set(_ON_UNDEFINED) | {"d", "default", "batch", "dictsort", "dump", "first", "groupby", "join", "last",
                                  "list", "nl2br", "random", "reject", "rejectattr", "select", "selectattr", "slice",
                                  "string", "sum", "trim", "urlize"}


# --- nunjucks' filters where Jinja2's differ on plain values (nunjucks/src/filters.js) ---------------


def _text(v: Any) -> str:
    """A filter's input as nunjucks' normalize leaves it (false is ''), printed as JavaScript prints it."""
    return "" if v is False else js_string(_plain(v))


def _math_round(x: float) -> float:
    r = math.floor(x)
    return r + 1 if x - r >= 0.5 else r


def _number(v: Any) -> float:
    """JavaScript's Number(v) for the values a template holds."""
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):
        t = js_trim(v)
        if not t:
            return 0.0
        try:
            return float(t) if re.fullmatch(r"[+-]?(Infinity|(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?)", t) else NAN
        except ValueError:
            return NAN
    return NAN


def _round(value: Any, precision: Any = 0, method: Any = "common") -> float:
    factor = 10.0 ** (_number(precision) if precision else 0)
    x = _number(value) * factor
    if not math.isfinite(x):
        return x / factor if not math.isnan(x) else NAN
    rounded = math.ceil(x) if method == "ceil" else math.floor(x) if method == "floor" else _math_round(x)
    return rounded / factor


def _capitalize(value: Any) -> str:
    low = js_lower(_text(value))
    return low[:1].upper() + low[1:]


def _title(value: Any) -> str:
    return " ".join(_capitalize(word) for word in _text(value).split(" "))


def _truncate(value: Any, length: Any = 255, killwords: Any = False, end: Any = None) -> str:
    text, length = _text(value), int(_number(length)) if length else 255
    if len(text) <= length:
        return text
    at = length if killwords else text.rfind(" ", 0, length + 1)
    return text[: length if at == -1 else at] + ("..." if end is None else js_string(end))


def _indent(value: Any, width: Any = 4, indentfirst: Any = False) -> str:
    text = _text(value)
    if not text:
        return ""
    pad = " " * math.ceil(_number(width) if width else 4)
    return "\n".join(line if i == 0 and not truthy(indentfirst) else pad + line for i, line in enumerate(text.split("\n")))


def _center(value: Any, width: Any = 80) -> str:
    text, width = _text(value), _number(width) if width else 80
    if len(text) >= width:
        return text
    spaces = width - len(text)
    return " " * max(0, math.ceil(spaces / 2 - spaces % 2)) + text + " " * math.ceil(spaces / 2)


_ESCAPES = {"&": "&amp;", '"': "&quot;", "'": "&#39;", "<": "&lt;", ">": "&gt;", "\\": "&#92;"}


def _escape(value: Any) -> str:
    return re.sub(r"[&\"'<>\\]", lambda m: _ESCAPES[m.group()], js_string(_plain(value)))


def _trim(value: Any) -> str:
    if not isinstance(value, str):
        raise jinja2.TemplateRuntimeError("nunjucks' trim filter needs text")
    return js_trim(value)


def _replace(value: Any, old: Any, new: Any = "undefined", max_count: Any = -1) -> Any:
    if isinstance(old, (int, float)) and not isinstance(old, bool):
        old = js_string(old)
    elif not isinstance(old, str):
        return value
    text = js_string(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value
    if not isinstance(text, str):
        return value
    new = js_string(_plain(new)) if not isinstance(new, jinja2.Undefined) else "undefined"
    if old == "":
        return new + new.join(text) + new
    count = -1 if max_count is None else int(_number(max_count))
    return text.replace(old, new, count) if count != 0 else text


def _wordcount(value: Any) -> Any:
    words = re.findall(r"[A-Za-z0-9_]+", _text(value))
    return len(words) or None


def _list(value: Any) -> list:
    if isinstance(value, str):
        return list(code_units(value))
    if isinstance(value, dict):
        return [{"key": k, "value": v} for k, v in value.items()]
    if isinstance(value, list):
        return value
    raise jinja2.TemplateRuntimeError("list filter: type not iterable")


def _length(value: Any) -> int:
    if isinstance(value, str):
        return len(code_units(value))
    return len(value) if isinstance(value, (list, dict)) else 0


def _json_ready(v: Any) -> Any:
    """A value as JSON.stringify writes it: whole numbers without '.0', NaN and infinities as null."""
    if isinstance(v, float):
        return None if not math.isfinite(v) else int(v) if v.is_integer() and abs(v) < SAFE_INT else v
    if isinstance(v, dict):
        return {k: _json_ready(x) for k, x in v.items() if not isinstance(x, jinja2.Undefined)}
    if isinstance(v, (list, tuple)) or hasattr(v, "__next__"):  # a list, or what batch and slice give
        return [None if isinstance(x, jinja2.Undefined) else _json_ready(x) for x in v]
    return v


def _dump(value: Any, spaces: Any = None) -> str:
    indent = int(min(10, _number(spaces))) if isinstance(spaces, (int, float)) and not isinstance(spaces, bool) and spaces >= 1 else None
    return json.dumps(_json_ready(value), ensure_ascii=False, indent=indent, separators=None if indent else (",", ":"))


def _nl2br(value: Any) -> str:
    return re.sub(r"\r\n|\n", "<br />\n", js_string(_plain(value)))


def _js_parse(value: Any, pattern: str) -> float:
    m = re.match(pattern, js_trim(js_string(_plain(value))))
    return float(m.group()) if m else NAN


def _int(value: Any, default: Any = JSUndefined(), base: Any = 10) -> Any:
    """parseInt(value, base): the digits at the start, else the default."""
    text = js_trim(js_string(_plain(value)))
    base = int(_number(base)) or 10
    if base == 16:
        text = re.sub(r"^([+-]?)0[xX]", r"\1", text)
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"[:base]
    m = re.match(r"[+-]?[" + re.escape(digits) + "]+", text, re.I) if 2 <= base <= 36 else None
    return int(m.group(), base) if m else default


def _float(value: Any, default: Any = JSUndefined()) -> Any:
    x = _js_parse(value, r"[+-]?(Infinity|(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?)")
    return default if math.isnan(x) else x


def _striptags(value: Any, preserve_linebreaks: Any = False) -> str:
    text = js_trim(re.sub(r"</?([a-z][a-z0-9]*)\b[^>]*>|<!--[\s\S]*?-->", "", _text(value), flags=re.I))
    if truthy(preserve_linebreaks):
        text = re.sub(r"^ +| +$", "", text, flags=re.M)
        return re.sub(r"\n\n\n+", "\n\n", re.sub(r" +", " ", text).replace("\r\n", "\n"))
    return re.sub(r"\s+", " ", text)


_OWN = {"capitalize": _capitalize, "title": _title, "truncate": _truncate, "indent": _indent, "center": _center,
        "escape": _escape, "e": _escape, "forceescape": _escape, "trim": _trim, "replace": _replace, "round": _round,
        "wordcount": _wordcount, "string": lambda v: v, "list": _list, "length": _length, "dump": _dump,
        "nl2br": _nl2br, "int": _int, "float": _float, "striptags": _striptags}


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


def _load(value: Any) -> Any:
    """promptfoo's ``load`` filter: ``JSON.parse(value)``, which reads the value as text first."""
    if isinstance(value, jinja2.Undefined):
        raise jinja2.TemplateRuntimeError('the load filter: "undefined" is not valid JSON')
    text = js_string(_plain(value))
    try:
        return parse_json(text)
    except JSONError as e:
        raise jinja2.TemplateRuntimeError(f"the load filter: {text[:60]!r} is not valid JSON ({e})") from None


def _plain(v: Any) -> Any:
    """A printed value: undefined prints as nothing, also inside a list (Array.prototype.join)."""
    if isinstance(v, jinja2.Undefined):
        return None
    return [_plain(x) for x in v] if isinstance(v, list) else v


def _finalize(v: Any) -> str:
    v = _plain(v)
    return "" if v is None else js_string(v)


# --- JavaScript's operators: nunjucks compiles ``+``, ``==``, ``if``, ``for`` ... to JavaScript's -----------


def _to_primitive(v: Any) -> Any:
    if isinstance(v, list):
        return js_string(_plain(v))
    return "[object Object]" if isinstance(v, dict) else v


def _to_number(v: Any) -> float:
    """JavaScript's ToNumber: null 0, undefined NaN, text as Number() reads it (hex, binary, octal too)."""
    v = _to_primitive(v)
    if v is None:
        return 0.0
    if isinstance(v, jinja2.Undefined):
        return NAN
    if isinstance(v, str):
        m = re.fullmatch(r"0([xXbBoO])([0-9a-fA-F]+)", js_trim(v))
        if m:
            try:
                return float(int(m.group(2), {"x": 16, "b": 2, "o": 8}[m.group(1).lower()]))
            except ValueError:
                return NAN
    return _number(v)


def _to_text(v: Any) -> str:
    return "undefined" if isinstance(v, jinja2.Undefined) else js_string(_plain(v))


def _js_number(x: float) -> Any:
    """A JavaScript number as a template keeps it: whole ones as int, so that they index lists and count ranges."""
    x = float(x)
    return int(x) if math.isfinite(x) and x.is_integer() and abs(x) < SAFE_INT else x


def _divide(a: float, b: float) -> float:
    if b == 0:
        return NAN if a == 0 or math.isnan(a) else math.copysign(math.inf, a) * math.copysign(1, b)
    return a / b


def _power(a: float, b: float) -> float:
    if math.isnan(b) or (abs(a) == 1 and math.isinf(b)):
        return NAN if b != 0 else 1.0
    try:
        return math.pow(a, b)
    except OverflowError:
        return math.inf if a > 0 or b % 2 == 0 else -math.inf
    except ValueError:
        return NAN


def _remainder(a: float, b: float) -> float:
    if b == 0 or math.isinf(a) or math.isnan(a) or math.isnan(b):
        return NAN
    return a if math.isinf(b) else math.fmod(a, b)


def _binop(a: Any, b: Any, op: str) -> Any:
    if op == "+":
        pa, pb = _to_primitive(a), _to_primitive(b)
        if isinstance(pa, str) or isinstance(pb, str):
            return _to_text(pa) + _to_text(pb)
        return _js_number(_to_number(pa) + _to_number(pb))
    x, y = _to_number(a), _to_number(b)
    if op == "-":
        return _js_number(x - y)
    if op == "*":
        return _js_number(x * y)
    if op == "/":
        return _js_number(_divide(x, y))
    if op == "//":  # nunjucks: Math.floor(a / b)
        q = _divide(x, y)
        return _js_number(math.floor(q) if math.isfinite(q) else q)
    if op == "%":
        return _js_number(_remainder(x, y))
    return _js_number(_power(x, y))  # **


def _unop(a: Any, op: str) -> Any:
    x = _to_number(a)
    return _js_number(-x if op == "-" else x)


def _loose_equal(a: Any, b: Any) -> bool:
    """JavaScript's ``==``, which nunjucks compiles ``==`` to."""
    nullish = lambda v: v is None or isinstance(v, jinja2.Undefined)  # noqa: E731
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731
    if nullish(a) or nullish(b):
        return nullish(a) and nullish(b)
    if isinstance(a, (list, dict)) and isinstance(b, (list, dict)):
        return a is b
    if isinstance(a, bool) and isinstance(b, bool) or isinstance(a, str) and isinstance(b, str):
        return a == b
    if number(a) and number(b):
        return float(a) == float(b)
    if isinstance(a, bool) or isinstance(b, bool):
        return _loose_equal(_to_number(a) if isinstance(a, bool) else a, _to_number(b) if isinstance(b, bool) else b)
    if isinstance(a, (list, dict)) or isinstance(b, (list, dict)):
        return _loose_equal(_to_primitive(a), _to_primitive(b))
    if number(a) and isinstance(b, str) or isinstance(a, str) and number(b):
        return _to_number(a) == _to_number(b)
    return False


def _less(a: Any, b: Any) -> bool | None:
    """JavaScript's ``a < b``: texts compare by code units, anything else as numbers (None: NaN was involved)."""
    pa, pb = _to_primitive(a), _to_primitive(b)
    if isinstance(pa, str) and isinstance(pb, str):
        return code_units(pa) < code_units(pb)
    x, y = _to_number(pa), _to_number(pb)
    return None if math.isnan(x) or math.isnan(y) else x < y


def _compare(a: Any, *pairs: Any) -> bool:
    """A chain of comparisons as JavaScript runs ``a < b < c``: left to right, each result the next left side."""
    for op, b in zip(pairs[::2], pairs[1::2]):
        if op in ("eq", "ne"):
            a = _loose_equal(a, b) == (op == "eq")
        elif op in ("lt", "gt"):
            a = bool(_less(a, b) if op == "lt" else _less(b, a))
        else:  # a <= b is !(b < a), false when NaN is involved
            less = _less(b, a) if op == "lteq" else _less(a, b)
            a = less is False
    return a


def _iterable(value: Any, targets: int) -> Any:
    """What nunjucks' for loops over: a mapping's key/value pairs with two names and nothing with one; a list or
    text as it is; nothing for null, undefined, numbers."""
    if isinstance(value, dict):
        return list(value.items()) if targets == 2 else []
    if value is None or isinstance(value, (jinja2.Undefined, bool, int, float)):
        return []
    return value


def _range(start: Any, stop: Any = JSUndefined(), step: Any = None) -> list:
    """nunjucks' range global, counting as its JavaScript loop counts (at most 100,000 items, as Jinja2's sandbox)."""
    if isinstance(stop, jinja2.Undefined):
        start, stop, step = 0, start, 1
    i, stop, step = _to_number(start), _to_number(stop), _to_number(step) if truthy(step) else 1.0
    out: list = []
    while (i < stop if step > 0 else i > stop) and len(out) <= 100_000:
        out.append(_js_number(i))
        i += step
    if len(out) > 100_000:
        raise jinja2.TemplateRuntimeError("range: more than 100,000 items")
    return out


_JS = {"js:binop": _binop, "js:unop": _unop, "js:compare": _compare, "js:truthy": lambda v: truthy(_plain(v)) if not isinstance(v, jinja2.Undefined) else False,
       "js:concat": lambda items: "".join(_to_text(x) for x in items), "js:iterable": _iterable}
_BINOPS = {"Add": "+", "Sub": "-", "Mul": "*", "Div": "/", "FloorDiv": "//", "Mod": "%", "Pow": "**"}
_COMPARISONS = {"eq", "ne", "lt", "gt", "lteq", "gteq"}


def _call(name: str, value: nodes.Expr, *args: nodes.Expr) -> nodes.Filter:
    return nodes.Filter(value, name, list(args), [], None, None, lineno=value.lineno)


class _JavaScript(NodeTransformer):
    """The parsed template with each operator, test and loop made a call that keeps JavaScript's meaning."""

    def generic_visit(self, node: nodes.Node, *args: Any, **kwargs: Any) -> Any:
        node = super().generic_visit(node, *args, **kwargs)
        kind = type(node).__name__
        if kind in _BINOPS:
            return _call("js:binop", node.left, node.right, nodes.Const(_BINOPS[kind]))
        if kind in ("Neg", "Pos"):
            return _call("js:unop", node.node, nodes.Const("-" if kind == "Neg" else "+"))
        if kind == "Concat":
            return _call("js:concat", nodes.List(node.nodes, lineno=node.lineno))
        if kind == "Compare" and all(o.op in _COMPARISONS for o in node.ops):
            return _call("js:compare", node.expr, *[x for o in node.ops for x in (nodes.Const(o.op), o.expr)])
        if kind == "Or":  # JavaScript's ||: the left side when it is truthy, else the right
            return nodes.CondExpr(_call("js:truthy", node.left), node.left, node.right, lineno=node.lineno)
        if kind == "And":
            return nodes.CondExpr(_call("js:truthy", node.left), node.right, node.left, lineno=node.lineno)
        if kind == "Not":
            node.node = _call("js:truthy", node.node)
        elif kind in ("If", "CondExpr"):
            node.test = _call("js:truthy", node.test)
            if kind == "CondExpr" and node.expr2 is None:  # nunjucks: an inline if without else gives ''
                node.expr2 = nodes.Const("")
        elif kind == "For":
            targets = len(node.target.items) if isinstance(node.target, nodes.Tuple) else 1
            if node.test is not None:  # nunjucks reads 'for x in a if c' as an inline if: a when c (outside the loop), else ''
                node.iter, node.test = nodes.CondExpr(_call("js:truthy", node.test), node.iter, nodes.Const(""),
                                                      lineno=node.lineno), None
            node.iter = _call("js:iterable", node.iter, nodes.Const(targets))
        return node


class _JSEnvironment(SandboxedEnvironment):
    """Members of JSON values as nunjucks' memberLookup finds them (``obj[key]`` in JavaScript)."""

    def getattr(self, obj: Any, attribute: str) -> Any:
        return self.getitem(obj, attribute)

    def getitem(self, obj: Any, key: Any) -> Any:
        if isinstance(obj, dict):
            return obj[key] if isinstance(key, str) and key in obj else self.undefined(obj=obj, name=str(key))
        if isinstance(obj, (str, list)):
            items = code_units(obj) if isinstance(obj, str) else obj
            if key == "length":
                return len(items)
            if isinstance(key, (int, float)) and not isinstance(key, bool) and key == int(key) and 0 <= key < len(items):
                return items[int(key)]
            return self.undefined(obj=obj, name=str(key))
        if isinstance(obj, (bool, int, float)) or obj is None:
            return self.undefined(obj=obj, name=str(key))
        return super().getitem(obj, key)


BUILTIN_FILTERS = frozenset(_NUNJUCKS | {"load"})  # nunjucks' own and promptfoo's ``load``


@lru_cache(maxsize=1)
def _env() -> SandboxedEnvironment:
    env = _JSEnvironment(autoescape=False, keep_trailing_newline=True, finalize=_finalize, undefined=JSUndefined)
    env.filters = {name: _filter(name, f) for name, f in env.filters.items() if name in _NUNJUCKS}
    env.filters["d"] = env.filters["default"] = _default
    env.filters.update({name: _filter(name, f) for name, f in _OWN.items()})
    env.filters["join"] = _filter("join", _join)
    env.filters["load"] = _load
    env.filters.update(_JS)  # names no template can write: only _JavaScript's calls reach them
    env.globals = {"range": _range, "cycler": env.globals["cycler"], "joiner": env.globals["joiner"]}  # nunjucks' globals
    return env


class RenderError(ValueError):
    """A template that cannot be rendered; ``reason`` is why, without the template."""

    def __init__(self, template: str, reason: str):
        super().__init__(f"the template {template!r} cannot be rendered ({reason})")
        self.reason = reason


def render(template: str, vars: Mapping[str, Any], filters: Mapping[str, Callable[..., Any]] | None = None) -> str:
    """``nunjucks.renderString(template, vars)``; ``filters``: custom filters for this render, over nunjucks'
    own (as promptfoo's addFilter). A template error is a RenderError (a ValueError) naming it."""
    if not any(m in template for m in MARKS):
        return template
    try:
        if filters:
            env = _env().overlay()
            env.filters = {**_env().filters, **filters}
            compiled, reads_env = _compile(env, template)
        else:
            compiled, reads_env = _compiled(template)
        if reads_env and "env" not in vars:
            raise ValueError("it reads promptfoo's 'env' (its process environment), which gatekeeper does not see; "
                             "pass the value as a var")
        return compiled.render(dict(vars))
    except Exception as e:  # noqa: BLE001 - whatever stops a user's template is that template's error
        raise RenderError(template, str(e)) from None


def _compile(env: SandboxedEnvironment, template: str) -> tuple[jinja2.Template, bool]:
    """The template compiled with JavaScript's operators, and whether it reads ``env``."""
    parsed = env.parse(template)
    reads_env = "env" in meta.find_undeclared_variables(parsed)
    return env.from_string(_JavaScript().visit(parsed)), reads_env


@lru_cache(maxsize=512)
def _compiled(template: str) -> tuple[jinja2.Template, bool]:
    return _compile(_env(), template)


@dataclass(frozen=True)
class Names:
    """What a template reads: its vars (undeclared names), the filters it applies, and the methods it calls."""

    vars: frozenset[str]
    filters: frozenset[str]
    methods: tuple[str, ...]


@lru_cache(maxsize=512)
def names(template: str) -> Names:
    """The names a template uses; a ValueError when it does not parse."""
    try:
        parsed = _env().parse(template)
        filters = frozenset(f.name for f in parsed.find_all(nodes.Filter))
        lenient = _env().overlay()  # knows every filter named, so that finding the vars compiles
        lenient.filters = {**_env().filters, **{name: _load for name in filters}}
        vars = frozenset(meta.find_undeclared_variables(lenient.parse(template)))
    except jinja2.TemplateSyntaxError as e:  # TemplateAssertionError too (an unknown test)
        raise ValueError(f"line {e.lineno}: {e.message}") from None
    methods = tuple(f"{c.node.attr}()" if isinstance(c.node, nodes.Getattr) else "[...]()"
                    for c in parsed.find_all(nodes.Call) if isinstance(c.node, (nodes.Getattr, nodes.Getitem)))
    return Names(vars, filters, methods)


# promptfoo's autoWrapRawIfPartialNunjucks: a tag left open at a line's end makes the whole text literal
_PARTIAL = re.compile(r"(\{%[^%]*|\{\{[^}]*|\{#[^#]*)(?=[\n\r\u2028\u2029]|\Z)")
_RAW, _ENDRAW = re.compile(r"\{%\s*raw\s*%\}"), re.compile(r"\{%\s*endraw\s*%\}")


def auto_raw(text: str) -> str:
    """The text as promptfoo renders a text prompt: inside ``{% raw %}`` when a tag is left open."""
    if _PARTIAL.search(text) and not (_RAW.search(text) and _ENDRAW.search(text)):
        return "{% raw %}" + text + "{% endraw %}"
    return text


_PLACEHOLDER = re.compile(r"\{\{\s*([A-Za-z0-9_]+)\s*\}\}")


def prompt_vars(values: Mapping[str, Any]) -> dict[str, Any]:
    """The vars as promptfoo's renderPrompt hands them to nunjucks: one trailing newline dropped from each
    text, then ``{{ name }}`` in a var's text replaced by that var (resolveVariables: five passes at most)."""
    out = {k: v[:-1] if isinstance(v, str) and v.endswith("\n") else v for k, v in values.items()}
    for _ in range(5):
        resolved = True
        for key, value in out.items():
            m = _PLACEHOLDER.search(value) if isinstance(value, str) else None
            if m and m.group(1) in out:  # a name no var has stays as it is
                out[key] = _replace_first(value, m.group(), js_string(out[m.group(1)]))
                resolved = False
        if resolved:
            break
    return out


def _replace_first(s: str, old: str, new: str) -> str:
    """JavaScript's ``s.replace(old, new)`` with a string pattern: the first match, ``$$ $& $` $'`` expanded."""
    at = s.index(old)
    expanded = re.sub(r"\$([$&`'])", lambda m: {"$": "$", "&": old, "`": s[:at], "'": s[at + len(old):]}[m.group(1)], new)
    return s[:at] + expanded + s[at + len(old):]


def render_prompt(template: str, values: Mapping[str, Any], filters: Mapping[str, Callable[..., Any]] | None = None) -> str:
    """promptfoo's renderPrompt on a prompt's text (or one chat message): the vars prepared, then rendered."""
    return render(template, prompt_vars(values), filters)


def render_value(value: Any, vars: Mapping[str, Any]) -> Any:
    """A string value, or each string of a list value, rendered; anything else unchanged."""
    if isinstance(value, str):
        return render(value, vars)
    if isinstance(value, list):
        return [render(v, vars) if isinstance(v, str) else v for v in value]
    return value
