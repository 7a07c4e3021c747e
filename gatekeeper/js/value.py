"""JavaScript's meaning of values, for assertion types that promptfoo (a JavaScript program) defines.

promptfoo turns a numeric `value` into text with `String(v)`, parses output with `JSON.parse` and compares
JSON with `util.isDeepStrictEqual`; Python's `str`, `json.loads` and `==` differ on each (`4.0`, `NaN`,
`True == 1`) and recurse on deep JSON. These are iterative re-statements of the JavaScript rules, each
written once here for battery/, js/ and gate/: `String()` (`js_string`), `Number()` (`js_number`),
`parseFloat` (`parse_float`), truthiness (`truthy`), `JSON.parse` (`parse_json`), `JSON.stringify`
(`stringify`) and `util.isDeepStrictEqual` (`deep_equal`). JavaScript strings are UTF-16 code units:
`code_units` and `js_lower` give Python strings the same meaning.
"""

from __future__ import annotations

import math
import re
from datetime import date
from typing import Any

SAFE_INT = 2**53
# JavaScript's \s and String.prototype.trim: WhiteSpace and LineTerminator (not Python's isspace)
JS_SPACE = "\t\n\v\f\r \u00a0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000\ufeff"


def is_js_space(ch: str) -> bool:
    return ch in JS_SPACE


def js_trim(s: str) -> str:
    return s.strip(JS_SPACE)


# --- strings as UTF-16 code units ------------------------------------------------------------

_ASTRAL = re.compile("[\U00010000-\U0010ffff]")
_PAIR = re.compile("[\ud800-\udbff][\udc00-\udfff]")
# case pairs Unicode added after 14.0 (Python 3.11's tables) up to 17.0 (node 22's ICU, which promptfoo runs on)
_NEWER_LOWER = {0x1C89: 0x1C8A, 0xA7CB: 0x0264, 0xA7CC: 0xA7CD, 0xA7CE: 0xA7CF, 0xA7D2: 0xA7D3, 0xA7D4: 0xA7D5,
                0xA7DA: 0xA7DB, 0xA7DC: 0x019B, **{c: c + 0x20 for c in range(0x10D50, 0x10D66)},
                **{c: c + 0x1B for c in range(0x16EA0, 0x16EB9)}}


def _split(m: re.Match) -> str:
    c = ord(m.group()) - 0x10000
    return chr(0xD800 + (c >> 10)) + chr(0xDC00 + (c & 0x3FF))


def _join(m: re.Match) -> str:
    high, low = map(ord, m.group())
    return chr(0x10000 + ((high - 0xD800) << 10) + (low - 0xDC00))


def code_units(s: str) -> str:
    """``s`` with one character per UTF-16 code unit (an astral character becomes its surrogate pair), so
    Python's ``in``, ``startswith`` and ``==`` compare as JavaScript's includes, startsWith and ===: a lone
    surrogate matches half of an emoji, and a pair read from ``\\ud83d\\ude00`` equals the emoji."""
    return s if s.isascii() else _ASTRAL.sub(_split, s)


def js_lower(s: str) -> str:
    """``String.prototype.toLowerCase``: a surrogate pair is one character (Python keeps a pair read from
    escapes as two), and the case pairs of Unicode 17.0."""
    return s.lower() if s.isascii() else _PAIR.sub(_join, s).lower().translate(_NEWER_LOWER)


def number_string(x: float) -> str:
    """ECMAScript Number::toString: shortest round-trip digits, exponent outside 1e-7 .. 1e21."""
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "Infinity" if x > 0 else "-Infinity"
    if x == 0:
        return "0"
    sign = "-" if x < 0 else ""
    mantissa, _, exp = repr(abs(x)).partition("e")  # Python's repr is the shortest round-trip too
    whole, _, frac = mantissa.partition(".")
    digits = (whole + frac).lstrip("0")
    n = len(whole) + int(exp or 0) - (len(whole + frac) - len(digits))  # ECMAScript's n: x = 0.digits * 10**n
    digits = digits.rstrip("0")
    k = len(digits)
    if k <= n <= 21:
        out = digits + "0" * (n - k)
    elif 0 < n <= 21:
        out = digits[:n] + "." + digits[n:]
    elif -6 < n <= 0:
        out = "0." + "0" * -n + digits
    else:
        e = n - 1
        out = digits[0] + ("." + digits[1:] if k > 1 else "") + "e" + ("+" if e >= 0 else "-") + str(abs(e))
    return sign + out


def js_ordered(d: dict) -> dict:
    """A mapping in JavaScript's property order: array-index keys ("0", "7", ...) ascending, then the rest as
    inserted (how an object from JSON.parse or a literal walks and prints)."""
    index = sorted((k for k in d if isinstance(k, str) and re.fullmatch(r"0|[1-9][0-9]*", k) and int(k) < 2**32 - 1), key=int)
    return {k: d[k] for k in [*index, *(k for k in d if k not in index)]} if index else d


def js_string(v: Any) -> str:
    """``String(v)`` for a value read from YAML or JSON."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v) if abs(v) < SAFE_INT else number_string(float(v))
    if isinstance(v, float):
        return number_string(v)
    if isinstance(v, str):
        return v
    if isinstance(v, list):
        return ",".join("" if x is None else js_string(x) for x in v)
    if isinstance(v, dict):
        return "[object Object]"
    return str(v)


# --- Number() and parseFloat ------------------------------------------------------------------

_DECIMAL = re.compile(r"[+-]?(?:Infinity|(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)")  # ASCII digits only
_RADIX = re.compile(r"0[xX][0-9a-fA-F]+|0[oO][0-7]+|0[bB][01]+")  # no sign, no '_'


def _double(x: int | float) -> float:
    """A number as JavaScript holds it: a double (an int too large for one is an infinity)."""
    try:
        return float(x)
    except OverflowError:
        return math.inf if x > 0 else -math.inf


def js_number(v: Any) -> float:
    """``Number(v)`` for a value read from YAML or JSON: true 1, null 0, a list as its text (``[5]`` 5,
    ``[]`` 0), an object NaN; text trimmed, empty 0, else decimal, Infinity or 0x/0o/0b digits, else NaN."""
    if isinstance(v, bool):
        return float(v)
    if v is None:
        return 0.0
    if isinstance(v, (int, float)):
        return _double(v)
    if isinstance(v, list):
        return js_number(js_string(v))
    if not isinstance(v, str):
        return math.nan
    s = js_trim(v)
    if not s:
        return 0.0
    if _RADIX.fullmatch(s):
        return _double(int(s, 0))
    return float(s) if _DECIMAL.fullmatch(s) else math.nan


def parse_float(s: str) -> float:
    """``parseFloat(s)``: the longest decimal number (or Infinity) at the start of the trimmed text, else NaN."""
    m = _DECIMAL.match(js_trim(s))
    return float(m.group()) if m else math.nan


def truthy(v: Any) -> bool:
    """JavaScript truthiness: "", 0, NaN, null and false are falsy; [] and {} are not."""
    if isinstance(v, float) and math.isnan(v):
        return False
    if isinstance(v, (list, dict)):
        return True
    return bool(v) or isinstance(v, (date, bytes))


# --- JSON.parse -------------------------------------------------------------------------------

_WS = re.compile(r"[ \t\n\r]*")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")
_STRING_CHUNK = re.compile(r'[^"\\\x00-\x1f]*')
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_LITERALS = {"true": True, "false": False, "null": None}


class JSONError(ValueError):
    pass


def _skip_ws(s: str, i: int) -> int:
    """The index after the JSON whitespace at ``i`` (``_WS`` matches the empty string, so it always matches)."""
    m = _WS.match(s, i)
    assert m is not None
    return m.end()


def _string(s: str, i: int) -> tuple[str, int]:
    """A JSON string starting after its opening quote at ``i``; returns (text, index after the quote)."""
    parts = []
    while True:
        m = _STRING_CHUNK.match(s, i)
        assert m is not None  # the pattern matches the empty string
        parts.append(m.group())
        i = m.end()
        if i >= len(s):
            raise JSONError("unterminated string")
        ch = s[i]
        if ch == '"':
            return "".join(parts), i + 1
        if ch != "\\":
            raise JSONError(f"control character in string at {i}")
        esc = s[i + 1: i + 2]
        if esc in _ESCAPES:
            parts.append(_ESCAPES[esc])
            i += 2
        elif esc == "u" and re.fullmatch(r"[0-9a-fA-F]{4}", s[i + 2: i + 6]):
            parts.append(chr(int(s[i + 2: i + 6], 16)))  # lone surrogates stay, as in JavaScript
            i += 6
        else:
            raise JSONError(f"bad escape at {i}")


def parse_json(s: str) -> Any:
    """``JSON.parse(s)`` without recursion: numbers are doubles, only JSON whitespace, NaN is no JSON."""
    root: list = []
    stack: list[tuple[Any, str | None]] = [(root, None)]  # (container, pending key)
    i = _skip_ws(s, 0)
    expect_value = True
    while True:
        container, _ = stack[-1]
        if expect_value:
            if i >= len(s):
                raise JSONError("unexpected end")
            ch = s[i]
            if ch in "[{":
                stack.append(([] if ch == "[" else {}, None))
                i = _skip_ws(s, i + 1)
                close = "]" if ch == "[" else "}"
                if s[i: i + 1] == close:
                    value, _ = stack.pop()
                    i += 1
                else:
                    if ch == "{":
                        i = _key(s, i, stack)
                    continue
            elif ch == '"':
                value, i = _string(s, i + 1)
            elif ch in "-0123456789":
                m = _NUMBER.match(s, i)
                if not m:
                    raise JSONError(f"bad number at {i}")
                value, i = float(m.group()), m.end()
            else:
                word = next((w for w in _LITERALS if s.startswith(w, i)), None)
                if word is None:
                    raise JSONError(f"unexpected {ch!r} at {i}")
                value, i = _LITERALS[word], i + len(word)
            _put(stack, value)
        # after a value: a separator, a closer, or the end
        i = _skip_ws(s, i)
        container, _ = stack[-1]
        if container is root:
            if i != len(s):
                raise JSONError(f"unexpected text after JSON at {i}")
            return root[0]
        ch = s[i: i + 1]
        close = "]" if isinstance(container, list) else "}"
        if ch == ",":
            i = _skip_ws(s, i + 1)
            if isinstance(container, dict):
                i = _key(s, i, stack)
            expect_value = True
        elif ch == close:
            value, _ = stack.pop()
            i += 1
            _put(stack, value)
            expect_value = False
        else:
            raise JSONError(f"expected ',' or {close!r} at {i}")


def _key(s: str, i: int, stack: list) -> int:
    if s[i: i + 1] != '"':
        raise JSONError(f"expected a key at {i}")
    key, i = _string(s, i + 1)
    i = _skip_ws(s, i)
    if s[i: i + 1] != ":":
        raise JSONError(f"expected ':' at {i}")
    stack[-1] = (stack[-1][0], key)
    return _skip_ws(s, i + 1)


def _put(stack: list, value: Any) -> None:
    container, key = stack[-1]
    if isinstance(container, dict):
        container[key] = value
    else:
        container.append(value)


def is_json(s: str) -> bool:
    try:
        parse_json(s)
        return True
    except JSONError:
        return False


# --- JSON.stringify ----------------------------------------------------------------------------

_JSON_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r", "\t": "\\t"}
_TO_ESCAPE = re.compile(r'["\\\x00-\x1f\ud800-\udfff]')


def _quoted(s: str) -> str:
    """A string as JSON.stringify writes it: a surrogate pair is one character, a lone surrogate is escaped."""
    if not s.isascii():
        s = _PAIR.sub(_join, s)
    return '"' + _TO_ESCAPE.sub(lambda m: _JSON_ESCAPES.get(m.group()) or f"\\u{ord(m.group()):04x}", s) + '"'


def _scalar_json(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        x = _double(v)
        return number_string(x) if math.isfinite(x) else "null"
    if isinstance(v, str):
        return _quoted(v)
    return _quoted(js_string(v))  # a YAML date or !!binary: its text


def stringify(v: Any, indent: int = 0) -> str:
    """``JSON.stringify(v, null, indent)`` for a value read from YAML or JSON, iteratively: numbers as
    JavaScript prints them (NaN and the infinities as null), keys in JavaScript's property order."""
    out: list[str] = []
    todo: list[Any] = [(v, 0)]  # (value, depth) still to write, or text to write as it is
    while todo:
        item = todo.pop()
        if isinstance(item, str):
            out.append(item)
            continue
        x, depth = item
        if isinstance(x, dict):
            ordered = js_ordered({k if isinstance(k, str) else js_string(k): y for k, y in x.items()})
            pairs: list[tuple[str, Any]] = [(_quoted(k) + (": " if indent else ":"), y) for k, y in ordered.items()]
            brackets = "{}"
        elif isinstance(x, list):
            pairs, brackets = [("", y) for y in x], "[]"
        else:
            out.append(_scalar_json(x))
            continue
        if not pairs:
            out.append(brackets)
            continue
        inner, outer = ("\n" + " " * (indent * (depth + 1)), "\n" + " " * (indent * depth)) if indent else ("", "")
        parts: list[Any] = []
        for n, (key, y) in enumerate(pairs):
            parts += [("," if n else "") + inner + key, (y, depth + 1)]
        out.append(brackets[0])
        todo += reversed([*parts, outer + brackets[1]])
    return "".join(out)


# --- util.isDeepStrictEqual ---------------------------------------------------------------------


def _same_primitive(a: Any, b: Any) -> bool:
    num_a = isinstance(a, (int, float)) and not isinstance(a, bool)
    num_b = isinstance(b, (int, float)) and not isinstance(b, bool)
    if num_a or num_b:
        if not (num_a and num_b):
            return False
        fa, fb = float(a), float(b)
        if math.isnan(fa) or math.isnan(fb):
            return math.isnan(fa) and math.isnan(fb)
        return fa == fb and math.copysign(1, fa) == math.copysign(1, fb)  # Object.is: -0 is not 0
    if isinstance(a, str) and isinstance(b, str):
        return code_units(a) == code_units(b)
    return type(a) is type(b) and a == b


def deep_equal(a: Any, b: Any) -> bool:
    """``util.isDeepStrictEqual`` on YAML/JSON values, iteratively (deep nesting cannot overflow)."""
    todo = [(a, b)]
    while todo:
        x, y = todo.pop()
        if isinstance(x, list) or isinstance(y, list):
            if not (isinstance(x, list) and isinstance(y, list)) or len(x) != len(y):
                return False
            todo.extend(zip(x, y))
        elif isinstance(x, dict) or isinstance(y, dict):
            if not (isinstance(x, dict) and isinstance(y, dict)) or x.keys() != y.keys():
                return False
            todo.extend((x[k], y[k]) for k in x)
        elif isinstance(x, (date, bytes)) or isinstance(y, (date, bytes)):
            return False  # a YAML date or !!binary is never equal to parsed JSON
        elif not _same_primitive(x, y):
            return False
    return True
