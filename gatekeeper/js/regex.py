"""JavaScript's ``RegExp`` (no flags), which promptfoo's ``regex`` assertions use, on top of ``regress``.

regress is the ECMAScript regex engine of the Rust ecosystem; its Python bindings match code points,
while a JavaScript RegExp without the ``u`` flag matches UTF-16 code units (``/^.$/`` does not match an
emoji). So characters outside the BMP, in the text and in the pattern, are spelled as two code units,
each mapped to a private-use character that regex classes treat as a lone surrogate would be treated
(not a word, digit or space character; matched by ``.``).
"""

from __future__ import annotations

import re
from functools import lru_cache

import regress

_UNIT_BASE = 0xE000  # U+E000..U+E7FF stand for the surrogates U+D800..U+DFFF
_ASTRAL = re.compile("[\U00010000-\U0010ffff]")
_SURROGATE_ESCAPE = re.compile(r"(?<!\\)((?:\\\\)*)\\u([dD][89a-fA-F][0-9a-fA-F]{2})")


def _unit(code: int) -> str:
    return chr(_UNIT_BASE + code - 0xD800)


def _units(m: re.Match) -> str:
    c = ord(m.group()) - 0x10000
    return _unit(0xD800 + (c >> 10)) + _unit(0xDC00 + (c & 0x3FF))


def utf16(text: str) -> str:
    """The text as JavaScript sees it without the ``u`` flag: one character per UTF-16 code unit."""
    text = "".join(_unit(ord(ch)) if 0xD800 <= ord(ch) <= 0xDFFF else ch for ch in text) if _has_surrogate(text) else text
    return _ASTRAL.sub(_units, text)


def _has_surrogate(text: str) -> bool:
    return any(0xD800 <= ord(ch) <= 0xDFFF for ch in text)


def _node22(pattern: str) -> str:
    """What regress reads differently from node 22's V8 without flags: ``\\u{41}`` is ``u`` repeated 41
    times (the braces are a quantifier), and group modifiers ``(?i:...)`` do not exist yet (an error)."""
    out, i, in_class = [], 0, False
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\":
            pair = pattern[i: i + 2]
            out.append("u" if pair == "\\u" and pattern[i + 2: i + 3] == "{" else pair)
            i += 2
            continue
        if in_class:
            in_class = ch != "]"
        elif ch == "[":
            in_class = True
        elif ch == "(" and re.match(r"\?[a-zA-Z-]", pattern[i + 1: i + 3]):
            raise ValueError(f"Invalid regular expression: /{pattern}/: Invalid group")
        out.append(ch)
        i += 1
    return "".join(out)


class JSRegExp:
    """``new RegExp(pattern)``; ``search(text)`` is ``regex.test(text)``."""

    def __init__(self, pattern: str):
        self.pattern = pattern
        try:
            source = _SURROGATE_ESCAPE.sub(lambda m: m.group(1) + "\\u%04X" % (_UNIT_BASE + int(m.group(2), 16) - 0xD800),
                                           utf16(_node22(pattern)))
            self._regex = regress.Regex(source)
        except regress.RegressError as e:
            raise ValueError(f"Invalid regular expression: /{pattern}/: {e}") from None

    def search(self, text: str) -> bool:
        return self._regex.find(utf16(text)) is not None


@lru_cache(maxsize=1024)
def compile(pattern: str) -> JSRegExp:
    return JSRegExp(pattern)
