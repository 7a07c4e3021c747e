"""js-rouge 3.2.3's ``treeBankTokenize`` (the Penn Treebank word tokenizer promptfoo's ``rouge-n`` uses).

Each step is the library's own JavaScript regular expression, run by regress (an ECMAScript engine), with
JavaScript's replace semantics (global, ``$&``/``$1``, a callback for quotes). Indices are code points,
which equal JavaScript's UTF-16 indices for text in the Basic Multilingual Plane.
"""

from __future__ import annotations

import unicodedata
from typing import Callable

import regress

from .value import js_trim

Replacement = Callable[[list[str | None], int], str]


def _replace(pattern: str, flags: str, text: str, repl: str | Replacement) -> str:
    """``text.replace(new RegExp(pattern, 'g' + flags), repl)``: ``repl`` a template (``$&``, ``$1``..``$9``)
    or a function of (groups, index of the match)."""
    data = text.encode("utf-8")  # regress reports UTF-8 byte ranges
    out, last, count = [], 0, _capturing(pattern)
    for m in regress.Regex(pattern, flags).find_iter(text):  # type: ignore[union-attr]  # regress's stub wrongly allows None
        whole = m.range()  # group 0: the whole match
        groups: list[str | None] = [data[whole].decode("utf-8")]
        for k in range(1, count + 1):
            g = m.group(k)
            groups.append(None if g is None else data[g].decode("utf-8"))
        out.append(data[last:whole.start].decode("utf-8"))
        if callable(repl):
            out.append(repl(groups, len(data[:whole.start].decode("utf-8"))))
        else:
            out.append(_template(repl, groups))
        last = whole.stop
    out.append(data[last:].decode("utf-8"))
    return "".join(out)


def _capturing(pattern: str) -> int:
    """How many capturing groups the pattern has (``(`` not escaped, not in a class, not ``(?``)."""
    count, i, in_class = 0, 0, False
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\":
            i += 2
            continue
        if in_class:
            in_class = ch != "]"
        elif ch == "[":
            in_class = True
        elif ch == "(" and pattern[i + 1: i + 2] != "?":
            count += 1
        i += 1
    return count


def _template(repl: str, groups: list[str | None]) -> str:
    out, i = [], 0
    while i < len(repl):
        if repl[i] == "$" and i + 1 < len(repl):
            nxt = repl[i + 1]
            if nxt == "&":
                out.append(groups[0] or "")
                i += 2
                continue
            if nxt.isdigit() and int(nxt) < len(groups):
                out.append(groups[int(nxt)] or "")
                i += 2
                continue
        out.append(repl[i])
        i += 1
    return "".join(out)


def _test(pattern: str, flags: str, text: str | None) -> bool:
    """``/pattern/flags.test(text)``; JavaScript tests ``undefined`` as the text "undefined"."""
    return regress.Regex(pattern, flags).find("undefined" if text is None else text) is not None


def _at(text: str, i: int) -> str | None:
    return text[i] if 0 <= i < len(text) else None


def _character(text: str, i: int) -> str:
    """js-rouge's characterAt: the code point at ``i``, or ""."""
    return text[i] if 0 <= i < len(text) else ""


def _match_end(pattern: str, text: str) -> str | None:
    """``text.match(/(pattern)$/u)?.[0]``."""
    m = regress.Regex(f"(?:{pattern})$", "u").find(text)
    return None if m is None else text.encode("utf-8")[m.range()].decode("utf-8")


def _alphabetic_footnote(text: str, i: int) -> bool:
    following = _character(text, i + 1)
    return (following != unicodedata.normalize("NFKC", following)
            and _test("^\\p{Lm}(?:[\\s.,;:!?\"'\u201c\u2018\u201d\u2019\\])}>]|$)", "u", text[max(i + 1, 0): i + 5]))


def _follows_quoted_modifier(text: str, i: int) -> bool:
    modifier = _match_end("\\p{Lm}", text[max(0, i - 2): i])
    if modifier is None or not _alphabetic_footnote(text, i - len(modifier) - 1):
        return False
    start = i - len(modifier)
    while start > 0:
        number = _match_end("\\p{Number}", text[max(0, start - 2): start])
        if number is None:
            break
        start -= len(number)
    return _test("[.!?][\"'\u201d\u2019]$", "", text[max(0, start - 2): start])


def _opening_context(text: str, i: int) -> bool:
    return (i == 0 or _test("[\\s\\p{Punctuation}<]", "u", _at(text, i - 1)) or text[max(0, i - 2): i] == "``"
            or _follows_quoted_modifier(text, i))


_WORD = "[\\p{ID_Continue}\\u200c\\u200d]"
_CONTRACTIONS = ("(can)(not)", "(d)('ye)", "(gim)(me)", "(gon)(na)", "(got)(ta)", "(lem)(me)", "(more)('n)",
                 "(wan)(na)(?= )", "('t)(is)", "('t)(was)")


def tokenize(text: str) -> list[str]:
    """The sentence's word tokens, as js-rouge's treeBankTokenize gives them."""
    t = js_trim(_replace("[\\s\\u0085]+", "", text, " "))
    if not t:
        return []
    inside = False

    def quote(groups: list[str | None], i: int) -> str:
        nonlocal inside
        s = groups[0] or ""
        inside = s == "``" or (
            (i + len(s) < len(t) or i == 0 or _test("[\\s\\p{Ps}<]", "u", _at(t, i - 1)))
            and (not inside and _opening_context(t, i))
            and not _test("[.!?]", "", _at(t, i - 1) or "")
            and (s == '"' or (i > 0 and _test("^[\\p{Letter}\\p{Number}\\p{Sc}\\p{Ps}]$", "u", _character(t, i + 2))
                              and _first_quote(t[i + 2:]) == "''")))
        return " `` " if inside else " '' "

    parse = _replace("``|''|\"", "", t, quote)
    for pattern, flags, repl in (("\\.{3}", "", " ... "), ("[:,](?!\\p{Decimal_Number})", "u", " $& "),
                                 ("[;@#$%&]", "", " $& "),
                                 ("([^.])(?<!\\b[A-Za-z]\\.[A-Za-z])(\\.)([\\])}>'\\s]*)$", "", "$1 $2$3 "),
                                 ("[?!]", "", " $& "), ("[\\][(){}<>]", "", " $& "), ("--", "", " -- ")):
        parse = _replace(pattern, flags, parse, repl)
    parse = f" {parse} "
    for pattern, repl in (("([^'])' ", "$1 ' "), ("'([sSmMdD]) ", " '$1 "), ("('ll|'LL|'re|'RE|'ve|'VE|n't|N'T) ", " $1 ")):
        parse = _replace(pattern, "", parse, repl)
    for contraction in _CONTRACTIONS:
        parse = _replace(f"(?<!{_WORD}){contraction}(?!{_WORD})", "iu", parse, " $1 $2 ")
    parse = _replace("^ | $", "", _replace(" {2,}", "", parse, " "), "")
    return parse.split(" ")


def _first_quote(text: str) -> str | None:
    m = regress.Regex("``|''|\"").find(text)
    return None if m is None else text.encode("utf-8")[m.range()].decode("utf-8")
