"""JavaScript's values and operators inside a nunjucks template, where Jinja2 would give Python's.

promptfoo configures nunjucks without ``throwOnUndefined``, so a missing var is JavaScript's ``undefined``
(``JSUndefined``): it prints as nothing, its members are undefined too, ``~`` joins it as the text
``undefined`` and arithmetic on it is NaN. nunjucks compiles ``+``, ``==``, ``<``, ``and``, ``or``, ``not``,
``if`` and ``for`` to JavaScript's, so ``"1" + 1`` is ``"11"`` and ``[] or "x"`` is ``[]``; Jinja2 compiles
them to Python's. ``with_js_operators`` rewrites a parsed template so that each becomes a call that keeps
JavaScript's meaning, and ``TESTS`` are nunjucks' tests (``is odd``, ``is sameas``, ...) as JavaScript computes
them. ``printed`` and ``number`` are how a value prints and JavaScript's ``Number()``.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jinja2
from jinja2 import nodes
from jinja2.visitor import NodeTransformer
from markupsafe import Markup

from .value import SAFE_INT, code_units, js_lower, js_number, js_ordered, js_string, truthy

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

    # jinja2 types Undefined's operators as its failing method (-> NoReturn); undefined's give NaN instead
    __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = _nan  # type: ignore[assignment]
    __floordiv__ = __rfloordiv__ = __mod__ = __rmod__ = __pow__ = __rpow__ = __neg__ = __pos__ = _nan  # type: ignore[assignment]

    def _false(self, _: Any) -> bool:  # undefined < x, > x, ... compare NaN: always false
        return False

    __lt__ = __le__ = __gt__ = __ge__ = _false  # type: ignore[assignment]  # jinja2: -> NoReturn, as above

    def __eq__(self, other: Any) -> bool:  # nunjucks' == is JavaScript's loose ==: undefined == null
        return other is None or isinstance(other, jinja2.Undefined)

    def __ne__(self, other: Any) -> bool:
        return not self.__eq__(other)

    __hash__ = jinja2.Undefined.__hash__

    def __contains__(self, item: Any) -> bool:  # nunjucks: "cannot use 'in' operator ... unexpected types"
        self._fail_with_undefined_error()


UNDEFINED = JSUndefined()  # the default of arguments JavaScript leaves undefined


def plain(v: Any) -> Any:
    """A printed value: undefined prints as nothing, also inside a list (Array.prototype.join)."""
    if isinstance(v, jinja2.Undefined):
        return None
    return [plain(x) for x in v] if isinstance(v, list) else v


def printed(v: Any) -> str:
    """What ``{{ v }}`` prints: JavaScript's String(v), and nothing for null or undefined."""
    v = plain(v)
    return "" if v is None else js_string(v)


def number(v: Any) -> float:
    """JavaScript's Number(v) for the values a template holds (value.js_number; undefined is NaN)."""
    return NAN if isinstance(v, jinja2.Undefined) else js_number(plain(v))


# --- JavaScript's operators: nunjucks compiles ``+``, ``==``, ``if``, ``for`` ... to JavaScript's -----------


def _to_primitive(v: Any) -> Any:
    if isinstance(v, list):
        return js_string(plain(v))
    return "[object Object]" if isinstance(v, dict) else v


def _to_number(v: Any) -> float:
    """JavaScript's ToNumber: null 0, undefined NaN, text as Number() reads it (hex, binary, octal too)."""
    return number(_to_primitive(v))


def _to_text(v: Any) -> str:
    return "undefined" if isinstance(v, jinja2.Undefined) else js_string(plain(v))


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
    numeric = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731
    if nullish(a) or nullish(b):
        return nullish(a) and nullish(b)
    if isinstance(a, (list, dict)) and isinstance(b, (list, dict)):
        return a is b
    if isinstance(a, bool) and isinstance(b, bool) or isinstance(a, str) and isinstance(b, str):
        return a == b
    if numeric(a) and numeric(b):
        return float(a) == float(b)
    if isinstance(a, bool) or isinstance(b, bool):
        return _loose_equal(_to_number(a) if isinstance(a, bool) else a, _to_number(b) if isinstance(b, bool) else b)
    if isinstance(a, (list, dict)) or isinstance(b, (list, dict)):
        return _loose_equal(_to_primitive(a), _to_primitive(b))
    if numeric(a) and isinstance(b, str) or isinstance(a, str) and numeric(b):
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


def _strict_equal(a: Any, b: Any) -> bool:
    """JavaScript's ``===``: the same type and value; lists and objects only themselves."""
    numeric = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731
    if numeric(a) and numeric(b):
        return float(a) == float(b)
    if isinstance(a, jinja2.Undefined) or isinstance(b, jinja2.Undefined):
        return isinstance(a, jinja2.Undefined) and isinstance(b, jinja2.Undefined)
    if isinstance(a, (list, dict)) or isinstance(b, (list, dict)) or numeric(a) or numeric(b):
        return a is b
    return type(a) is type(b) and a == b


def _js_truthy(v: Any) -> bool:
    """JavaScript's ``!!v`` for a template value (undefined is false)."""
    return not isinstance(v, jinja2.Undefined) and truthy(plain(v))


def _mod_is(value: Any, by: Any, rest: float) -> bool:
    return _remainder(_to_number(value), _to_number(by)) == rest


def _string_test(case: Callable[[str], str]) -> Callable[[Any], bool]:
    def test(value: Any) -> bool:  # nunjucks calls value.toLowerCase(): an error on what has no such method
        if not isinstance(value, str):
            raise jinja2.TemplateRuntimeError("nunjucks' lower and upper tests need text")
        return case(value) == value
    return test


# nunjucks' tests (nunjucks/src/tests.js), each a JavaScript expression; ``none``/``null`` are its null test
TESTS: dict[str, Callable[..., bool]] = {
    "callable": callable, "defined": lambda v: not isinstance(v, jinja2.Undefined),
    "undefined": lambda v: isinstance(v, jinja2.Undefined),
    "null": lambda v: v is None, "none": lambda v: v is None, "None": lambda v: v is None,
    "divisibleby": lambda v, n: _mod_is(v, n, 0.0), "even": lambda v: _mod_is(v, 2, 0.0), "odd": lambda v: _mod_is(v, 2, 1.0),
    "escaped": lambda v: isinstance(v, Markup), "equalto": _strict_equal, "eq": _strict_equal, "sameas": _strict_equal,
    "ne": lambda a, b: not _strict_equal(a, b),
    "truthy": _js_truthy, "falsy": lambda v: not _js_truthy(v),
    "ge": lambda a, b: _compare(a, "gteq", b), "gt": lambda a, b: _compare(a, "gt", b),
    "greaterthan": lambda a, b: _compare(a, "gt", b), "le": lambda a, b: _compare(a, "lteq", b),
    "lt": lambda a, b: _compare(a, "lt", b), "lessthan": lambda a, b: _compare(a, "lt", b),
    "lower": _string_test(js_lower), "upper": _string_test(str.upper),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "string": lambda v: isinstance(v, str),
    "iterable": lambda v: isinstance(v, (str, list)), "mapping": lambda v: isinstance(v, dict),
}


def _iterable(value: Any, targets: int) -> Any:
    """What nunjucks' for loops over: a mapping's key/value pairs with two names and nothing with one; a list or
    text as it is; nothing for null, undefined, numbers."""
    if isinstance(value, dict):
        return list(js_ordered(value).items()) if targets == 2 else []
    if value is None or isinstance(value, (jinja2.Undefined, bool, int, float)):
        return []
    return value


def js_range(start: Any, stop: Any = UNDEFINED, step: Any = None) -> list:
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


# the filters with_js_operators' calls reach: names no template can write
OPERATOR_FILTERS: dict[str, Callable[..., Any]] = {"js:binop": _binop, "js:unop": _unop, "js:compare": _compare,
                    "js:truthy": _js_truthy,
                    "js:concat": lambda items: "".join(_to_text(x) for x in items), "js:iterable": _iterable}
_BINOPS = {"Add": "+", "Sub": "-", "Mul": "*", "Div": "/", "FloorDiv": "//", "Mod": "%", "Pow": "**"}
_COMPARISONS = {"eq", "ne", "lt", "gt", "lteq", "gteq"}


def _call(name: str, value: nodes.Expr, *args: nodes.Expr) -> nodes.Filter:
    return nodes.Filter(value, name, list(args), [], None, None, lineno=value.lineno)


class _JavaScript(NodeTransformer):
    """The parsed template with each operator, test and loop made a call that keeps JavaScript's meaning."""

    def generic_visit(self, node: Any, *args: Any, **kwargs: Any) -> Any:  # Any: each kind of node has its own fields
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


def with_js_operators(parsed: nodes.Template) -> nodes.Template:
    """The parsed template with JavaScript's operators; it renders where OPERATOR_FILTERS are filters."""
    return _JavaScript().visit(parsed)
