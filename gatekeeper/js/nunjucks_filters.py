"""nunjucks' filters as nunjucks implements them, for templates that Jinja2 renders.

Jinja2's filters share nunjucks' names but not always their results: nunjucks prints as JavaScript prints,
counts UTF-16 code units and reads numbers as ``Number()`` and ``parseInt`` do (nunjucks/src/filters.js).
What each filter does with an undefined or null value is nunjucks' too (``upper`` gives "", ``length`` 0,
``join`` is an error). Filters nunjucks does not have (Jinja2's ``tojson``, ``map``, ...) are not here, so
they are errors as in nunjucks. promptfoo adds ``load`` (``JSON.parse``).
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable, Mapping
from urllib.parse import quote

import jinja2

from .nunjucks_operators import NAN, UNDEFINED, JSUndefined, number, plain, printed
from .value import (
    SAFE_INT,
    JSONError,
    code_units,
    js_lower,
    js_ordered,
    js_string,
    js_trim,
    parse_float,
    parse_json,
    stringify,
    truthy,
)


def _default(value: Any, default: Any = UNDEFINED, boolean: bool = False) -> Any:
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
    return js_string(delimiter).join(printed(x) for x in value)


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
BUILTIN_FILTERS = frozenset(_NUNJUCKS | {"load"})  # nunjucks' own and promptfoo's ``load``


# --- nunjucks' filters where Jinja2's differ on plain values (nunjucks/src/filters.js) ---------------


def _js_abs(x: float) -> Any:
    return int(abs(x)) if math.isfinite(x) and x.is_integer() and abs(x) < SAFE_INT else abs(x)


def _text(v: Any) -> str:
    """A filter's input as nunjucks' normalize leaves it (false is ''), printed as JavaScript prints it."""
    return "" if v is False else js_string(plain(v))


def _math_round(x: float) -> float:
    r = math.floor(x)
    return r + 1 if x - r >= 0.5 else r


def _round(value: Any, precision: Any = 0, method: Any = "common") -> float:
    factor = 10.0 ** (number(precision) if precision else 0)
    x = number(value) * factor
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
    text, length = _text(value), int(number(length)) if length else 255
    if len(text) <= length:
        return text
    at = length if killwords else text.rfind(" ", 0, length + 1)
    return text[: length if at == -1 else at] + ("..." if end is None else js_string(end))


def _indent(value: Any, width: Any = 4, indentfirst: Any = False) -> str:
    text = "" if value is False else value
    if not text:
        return ""
    if not isinstance(text, str):
        raise jinja2.TemplateRuntimeError("nunjucks' indent filter needs text")
    pad = " " * math.ceil(number(width) if width else 4)
    return "\n".join(line if i == 0 and not truthy(indentfirst) else pad + line for i, line in enumerate(text.split("\n")))


def _center(value: Any, width: Any = 80) -> str:
    text, width = _text(value), number(width) if width else 80
    if len(text) >= width:
        return text
    spaces = width - len(text)
    return " " * max(0, math.ceil(spaces / 2 - spaces % 2)) + text + " " * math.ceil(spaces / 2)


_ESCAPES = {"&": "&amp;", '"': "&quot;", "'": "&#39;", "<": "&lt;", ">": "&gt;", "\\": "&#92;"}


def _escape(value: Any) -> str:
    return re.sub(r"[&\"'<>\\]", lambda m: _ESCAPES[m.group()], js_string(plain(value)))


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
    new = js_string(plain(new)) if not isinstance(new, jinja2.Undefined) else "undefined"
    if old == "":
        return new + new.join(text) + new
    count = -1 if max_count is None else int(number(max_count))
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


def _reverse(value: Any) -> Any:
    """nunjucks' ``reverse``: text reversed by UTF-16 code units, a copy of a list reversed, anything else []."""
    if isinstance(value, str):
        return code_units(value)[::-1]
    return list(value)[::-1] if isinstance(value, list) else []


def _groupby(value: Any, attribute: Any) -> dict:
    """nunjucks' ``groupby``: an object from each item's attribute (a dotted path), printed as text, to its
    items, with JavaScript's key order (array-index keys first, ascending)."""
    parts = attribute.split(".") if isinstance(attribute, str) else [attribute]
    groups: dict[str, list] = {}
    for item in code_units(value) if isinstance(value, str) else value if isinstance(value, list) else []:
        key = item
        for part in parts:
            key = key[part] if isinstance(key, dict) and part in key else JSUndefined()
        groups.setdefault(js_string(plain(key)) if not isinstance(key, jinja2.Undefined) else "undefined", []).append(item)
    return js_ordered(groups)


def _length(value: Any) -> int:
    if isinstance(value, str):
        return len(code_units(value))
    return len(value) if isinstance(value, (list, dict)) else 0


def _json_ready(v: Any) -> Any:
    """A template's value as JSON.stringify sees it: an undefined member left out, an undefined item null (numbers
    and key order are value.stringify's)."""
    if isinstance(v, dict):
        return {k: _json_ready(x) for k, x in v.items() if not isinstance(x, jinja2.Undefined)}
    if isinstance(v, (list, tuple)) or hasattr(v, "__next__"):  # a list, or what batch and slice give
        return [None if isinstance(x, jinja2.Undefined) else _json_ready(x) for x in v]
    return v


def _dump(value: Any, spaces: Any = None) -> str:
    indent = int(min(10, number(spaces))) if isinstance(spaces, (int, float)) and not isinstance(spaces, bool) and spaces >= 1 else 0
    return stringify(_json_ready(value), indent)


def _uri_component(value: Any) -> str:
    """JavaScript's encodeURIComponent: UTF-8 bytes as %XX, but for letters, digits and -_.!~*'(). Surrogate
    pairs are joined first; a lone one cannot be encoded (an error, as JavaScript's URIError)."""
    return quote(code_units(js_string(plain(value))).encode("utf-16", "surrogatepass").decode("utf-16"), safe="-_.!~*'()")


def _urlencode(value: Any) -> str:
    """nunjucks' ``urlencode``: text encoded whole; an object's (or a list of pairs') k=v joined by &."""
    if isinstance(value, str):
        return _uri_component(value)
    pairs = value if isinstance(value, list) else list(js_ordered(value).items()) if isinstance(value, dict) else []
    return "&".join(f"{_uri_component(p[0] if p else JSUndefined())}={_uri_component(p[1] if len(p) > 1 else JSUndefined())}"
                    for p in pairs)


def _random(*_: Any) -> Any:
    raise jinja2.TemplateRuntimeError("nunjucks' random filter picks anew on every render, so the flag-off and flag-on "
                                      "runs would not read one prompt; pick the item in the test's vars")


def _nl2br(value: Any) -> str:
    return re.sub(r"\r\n|\n", "<br />\n", js_string(plain(value)))


def _int(value: Any, default: Any = UNDEFINED, base: Any = 10) -> Any:
    """parseInt(value, base): the digits at the start, else the default."""
    text = js_trim(js_string(plain(value)))
    base = int(number(base)) or 10
    if base == 16:
        text = re.sub(r"^([+-]?)0[xX]", r"\1", text)
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"[:base]
    m = re.match(r"[+-]?[" + re.escape(digits) + "]+", text, re.I) if 2 <= base <= 36 else None
    return int(m.group(), base) if m else default


def _float(value: Any, default: Any = UNDEFINED) -> Any:
    x = parse_float(js_string(plain(value)))  # parseFloat
    return default if math.isnan(x) else x


def _striptags(value: Any, preserve_linebreaks: Any = False) -> str:
    text = js_trim(re.sub(r"</?([a-z][a-z0-9]*)\b[^>]*>|<!--[\s\S]*?-->", "", _text(value), flags=re.I))
    if truthy(preserve_linebreaks):
        text = re.sub(r"^ +| +$", "", text, flags=re.M)
        return re.sub(r"\n\n\n+", "\n\n", re.sub(r" +", " ", text).replace("\r\n", "\n"))
    return re.sub(r"\s+", " ", text)


_OWN: dict[str, Callable[..., Any]] = {
        "capitalize": _capitalize, "title": _title, "truncate": _truncate, "indent": _indent, "center": _center,
        "escape": _escape, "e": _escape, "forceescape": _escape, "trim": _trim, "replace": _replace, "round": _round,
        "wordcount": _wordcount, "string": lambda v: js_string(plain(v)), "list": _list, "urlencode": _urlencode, "random": _random,
        "abs": lambda v: _js_abs(number(v)), "reverse": _reverse, "groupby": _groupby, "length": _length, "dump": _dump,
        "nl2br": _nl2br, "int": _int, "float": _float, "striptags": _striptags}


def _filter(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
    """Jinja2's filter, or nunjucks' result when the value is undefined or null."""
    on_undefined = _ON_UNDEFINED.get(name, _error(name))
    takes_context = hasattr(f, "jinja_pass_arg")  # the environment or context comes first

    def filtered(*args: Any, **kwargs: Any) -> Any:
        value = args[1] if takes_context else args[0]
        if value is None or isinstance(value, jinja2.Undefined):
            return on_undefined(value, *args[1 + takes_context:], **kwargs)
        out = f(*args, **kwargs)
        return list(out) if hasattr(out, "__next__") else out  # nunjucks' select, batch, slice... give arrays
    if takes_context:
        filtered.jinja_pass_arg = f.jinja_pass_arg  # type: ignore[attr-defined]
    return filtered


def load(value: Any) -> Any:
    """promptfoo's ``load`` filter: ``JSON.parse(value)``, which reads the value as text first."""
    if isinstance(value, jinja2.Undefined):
        raise jinja2.TemplateRuntimeError('the load filter: "undefined" is not valid JSON')
    text = js_string(plain(value))
    try:
        return parse_json(text)
    except JSONError as e:
        raise jinja2.TemplateRuntimeError(f"the load filter: {text[:60]!r} is not valid JSON ({e})") from None


def environment_filters(jinja_filters: Mapping[str, Callable[..., Any]]) -> dict[str, Callable[..., Any]]:
    """nunjucks' filters and promptfoo's ``load``: Jinja2's (``jinja_filters``) where nunjucks has the same,
    nunjucks' own where they differ, each giving nunjucks' result for an undefined or null value."""
    filters = {name: _filter(name, f) for name, f in jinja_filters.items() if name in _NUNJUCKS}
    filters["d"] = filters["default"] = _default
    filters.update({name: _filter(name, f) for name, f in _OWN.items()})
    filters["join"] = _filter("join", _join)
    filters["load"] = load
    return filters
