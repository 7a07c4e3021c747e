"""YAML as promptfoo reads it (js-yaml 5, its core schema plus merge, timestamp and binary tags).

PyYAML resolves plain scalars by YAML 1.1 (``yes`` is true, ``1e3`` a string, ``010`` octal); js-yaml by
YAML 1.2's core schema. A promptfoo config, its test files and the JSON that ``contains-json`` pulls out
of an output must read as promptfoo reads them, so this loader swaps the resolvers.
"""

from __future__ import annotations

import math
import re
from datetime import date
from typing import Any

import yaml

from .value import JSONError, js_string, parse_json


class Loader(yaml.SafeLoader):
    """SafeLoader with js-yaml's scalar resolution."""


Loader.yaml_implicit_resolvers = {
    k: [(tag, rx) for tag, rx in v if tag in ("tag:yaml.org,2002:merge", "tag:yaml.org,2002:timestamp")]
    for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_NULL = re.compile(r"^(?:~|null|Null|NULL|)$")
_BOOL = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")
_INT = re.compile(r"^(?:0o[0-7]+|0x[0-9a-fA-F]+|[-+]?[0-9]+)$")
_FLOAT = re.compile(r"^(?:[-+]?[0-9]+(?:\.[0-9]*)?(?:[eE][-+]?[0-9]+)?|[-+]?\.[0-9]+(?:[eE][-+]?[0-9]+)?"
                    r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$")
for _tag, _rx, _first in [("null", _NULL, ["~", "n", "N", ""]), ("bool", _BOOL, list("tTfF")),
                          ("int", _INT, list("-+0123456789")), ("float", _FLOAT, list("-+.0123456789"))]:
    Loader.add_implicit_resolver(f"tag:yaml.org,2002:{_tag}", _rx, _first)
    # js-yaml tries null, bool, int, float in that order; add_implicit_resolver appends, so keep it
for _k, _v in Loader.yaml_implicit_resolvers.items():
    _order = ["null", "bool", "int", "float", "merge", "timestamp"]
    _v.sort(key=lambda tr: _order.index(tr[0].rsplit(":", 1)[1]))


def _int(loader: Loader, node: yaml.ScalarNode) -> Any:
    s = loader.construct_scalar(node)
    if not _INT.match(s):  # an explicit !!int js-yaml cannot read stays text
        return s
    sign = -1 if s.startswith("-") else 1
    body = s.lstrip("+-")
    base = 8 if body.startswith("0o") else 16 if body.startswith("0x") else 10
    return sign * int(body[2:] if base != 10 else body, base)


def _float(loader: Loader, node: yaml.ScalarNode) -> Any:
    s = loader.construct_scalar(node)
    low = s.lower().lstrip("+-")
    if low == ".inf":
        return -math.inf if s.startswith("-") else math.inf
    if low == ".nan":
        return math.nan
    try:
        x = float(s)
    except ValueError:
        return s
    return x if math.isfinite(x) else s  # js-yaml leaves 1e999 a string


def _timestamp(loader: Loader, node: yaml.ScalarNode) -> Any:
    try:
        return yaml.SafeLoader.construct_yaml_timestamp(loader, node)
    except ValueError:  # 2025-13-40: JavaScript rolls it over into some Date; it is a date all the same
        return date(1970, 1, 1)


def _mapping(loader: Loader, node: yaml.MappingNode) -> dict:
    """Scalar keys become their JavaScript text, as object keys do; js-yaml refuses a list or mapping key."""
    loader.flatten_mapping(node)
    out: dict = {}
    for key_node, value_node in node.value:
        if not isinstance(key_node, yaml.ScalarNode):
            raise yaml.constructor.ConstructorError(None, None, "a list or mapping cannot be a key", key_node.start_mark)
        key = loader.construct_object(key_node, deep=True)
        if not isinstance(key, str):
            key = js_string(key) if not isinstance(key, (date, bytes)) else str(key)
        out[key] = loader.construct_object(value_node, deep=True)
    return out


def _bool(loader: Loader, node: yaml.ScalarNode) -> bool:
    return loader.construct_scalar(node) in ("true", "True", "TRUE")


def _omap(loader: Loader, node: yaml.SequenceNode) -> list:
    return loader.construct_sequence(node, deep=True)


def _pairs(loader: Loader, node: yaml.SequenceNode) -> list:
    return [[k, v] for item in loader.construct_sequence(node, deep=True) for k, v in item.items()]


def _set(loader: Loader, node: yaml.MappingNode) -> dict:
    return {k: None for k in _mapping(loader, node)}


Loader.add_constructor("tag:yaml.org,2002:null", lambda loader, node: None)
Loader.add_constructor("tag:yaml.org,2002:bool", _bool)
Loader.add_constructor("tag:yaml.org,2002:int", _int)
Loader.add_constructor("tag:yaml.org,2002:float", _float)
Loader.add_constructor("tag:yaml.org,2002:timestamp", _timestamp)
Loader.add_constructor("tag:yaml.org,2002:map", _mapping)
Loader.add_constructor("tag:yaml.org,2002:omap", _omap)
Loader.add_constructor("tag:yaml.org,2002:pairs", _pairs)
Loader.add_constructor("tag:yaml.org,2002:set", _set)


def load(text: str) -> Any:
    """One YAML document as js-yaml reads it (empty text is None); raises yaml.YAMLError."""
    docs = list(yaml.load_all(text, Loader=Loader))
    if len(docs) > 1:
        raise yaml.YAMLError("expected a single document in the stream, but found more")
    return docs[0] if docs else None


# --- contains-json: promptfoo's extraction ----------------------------------------------------

_MAX_JSON = 100_000
_MAX_YAML_DEPTH = 200
_JS_SPACE = re.compile("[\t\n\v\f\r \u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000\ufeff]")


def _slash_comments(s: str) -> str:
    """promptfoo's convertSlashCommentsToHash: ``// x`` outside quotes becomes ``# x``."""
    lines = []
    for line in s.split("\n"):
        state, out, i = "normal", [], 0
        while i < len(line):
            # JavaScript's /[a-zA-Z]/.test(undefined) tests the text "undefined": true past the line's end
            ch, nxt, prev = line[i], line[i + 1] if i + 1 < len(line) else "undefined", line[i - 1] if i else ""
            if state == "normal":
                if ch == "'" and not re.match(r"[a-zA-Z]", prev):
                    state = "single"
                elif ch == '"':
                    state = "double"
                elif ch == "/" and nxt == "/":
                    start = next((j + 1 for j in range(i - 1, -1, -1) if _JS_SPACE.match(line[j])), 0)
                    if "://" in line[start: i + 2]:  # a URL's '//' is no comment
                        out.append(ch)
                        i += 1
                        continue
                    n = 2
                    while line[i + n: i + n + 1] == "/":
                        n += 1
                    out.append("#" * (n // 2) + line[i + n:])
                    i = len(line)
                    continue
            elif state == "single":
                if ch == "'" and not _escaped(line, i) and not re.match(r"[a-zA-Z]", nxt):
                    state = "normal"
            elif ch == '"' and not _escaped(line, i):
                state = "normal"
            out.append(ch)
            i += 1
        lines.append("".join(out))
    return "\n".join(lines)


def _escaped(line: str, i: int) -> bool:
    n = 0
    while i - n - 1 >= 0 and line[i - n - 1] == "\\":
        n += 1
    return n % 2 == 1


def _object(candidate: str) -> Any:
    """What promptfoo's ``loadYaml(convertSlashCommentsToHash(c), {json: true})`` gives when it is an object
    (a mapping or a list), else None."""
    try:
        v = parse_json(candidate)  # plain JSON, however deep, without recursion
        return v if isinstance(v, (dict, list)) else None
    except JSONError:
        pass
    if max(_depths(candidate)) > _MAX_YAML_DEPTH:
        return None  # deeper than PyYAML recurses; a deeper-inside span gets its own try
    try:
        # js-yaml takes tabs as flow-context spaces, PyYAML does not; the answer is the same with spaces
        v = load(_slash_comments(candidate).replace("\t", " "))
    except (yaml.YAMLError, RecursionError, ValueError, TypeError):
        return None
    return v if isinstance(v, (dict, list)) else None


def _depths(s: str):
    d = 0
    for ch in s:
        d += (ch in "{[") - (ch in "}]")
        yield d


def has_json_object(s: str) -> bool:
    """promptfoo's extractJsonObjects(s) is non-empty: some ``{`` opens a brace-balanced span (quotes
    not considered; unclosed braces closed at the end of the text) that reads as a YAML/JSON object.
    One try per ``{``, as promptfoo makes; spans are found in one pass instead of one scan each."""
    depth = [0]
    for ch in s:
        depth.append(depth[-1] + (ch == "{") - (ch == "}"))
    close, stack = {}, []
    for j, ch in enumerate(s):
        if ch == "{":
            stack.append(j)
        elif ch == "}" and stack:
            close[stack.pop()] = j + 1
    for i, ch in enumerate(s):
        if ch != "{":
            continue
        j = min(close.get(i, len(s)), i + _MAX_JSON)
        candidate = s[i:j] + "}" * (depth[j] - depth[i])
        if _object(candidate) is not None:
            return True
    return False


def json_objects(text: str) -> list[Any]:
    """promptfoo's extractJsonObjects: from each ``{``, the brace-balanced span (quotes not considered, braces
    left open closed at the end) read as YAML/JSON; a span that reads as an object is taken and the scan goes on after it."""
    out, i = [], 0
    while i < len(text):
        if text[i] != "{":
            i += 1
            continue
        opened, closed, j, end = 1, 0, i + 1, min(i + _MAX_JSON, len(text))
        found = None
        while j < end and opened > closed:
            opened += text[j] == "{"
            closed += text[j] == "}"
            j += 1
            if opened == closed or j == len(text) or j == i + _MAX_JSON:
                found = _object(text[i:j] + "}" * max(0, opened - closed))
                if found is not None or opened == closed:
                    break
        if found is not None:
            out.append(found)
            i = j
        else:
            i += 1
    return out
