"""Static-first partition and prompt rendering.

A stage prompt is a list of segments marked static or dynamic. Partitioned, the static
segments move ahead of every dynamic one (each group keeping its order), so everything up
to the first dynamic byte is the same on every call: the prefix a cache can serve and the
runtime pins. Both configurations of an evaluation render the same way, so a parity run
isolates one variable. A segment's text has ``{var}`` fields, or is a nunjucks template rendered as
promptfoo renders a prompt (``nunjucks: true``, with the suite's custom ``filters`` run in JavaScript).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping, Sequence, cast

from ..cache.trie import common_prefix
from ..errors import GatekeeperError
from ..js import nunjucks
from ..workspace import RAW, Suite, Workspace

Mode = Literal["partitioned", "as_written"]
VAR = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
_MARK = "\x00gatekeeper-boundary\x00"  # never in real text; located after rendering


@dataclass(frozen=True)
class Piece:
    role: str
    static: bool
    text: str


@dataclass
class Rendered:
    messages: list[dict[str, str]]
    text: str
    tokens: list[int]
    static_tokens: int  # tokens before the first dynamic byte: the stage's pinnable prefix
    static_text: str = field(repr=False, default="")


def templated(seg) -> bool:
    """Whether a segment's text has ``{var}`` fields: ``file`` segments, nunjucks templates and static ``prompt``
    text (captured, already rendered) are not filled, so JSON and braces need no escaping."""
    return seg.text is not None and not seg.nunjucks and not (seg.role == RAW and seg.static)


def suite_vars(suite: Suite) -> set[str]:
    """Variables the suite's ``{var}`` segments need (a nunjucks template renders a missing var as nothing)."""
    # cast: a templated segment has text
    return {name for seg in suite.prompt if templated(seg) for name in VAR.findall(cast(str, seg.text))}


def missing_vars(suite: Suite) -> list[str]:
    """Problems like 'case X lacks var Y' or 'its template cannot be rendered', checked when the battery loads."""
    problems = []
    needed = suite_vars(suite)
    last = suite.prompt[-1]
    turn_needed = set(VAR.findall(cast(str, last.text))) if templated(last) else set()  # templated: it has text
    for case in suite.cases:
        if case.turns:
            if last.role != "user":
                problems.append(f"suite {suite.suite!r}, case {case.id!r}: 'turns' need the prompt's last segment to be a user segment")
                continue
            for n, turn in enumerate(case.turns, 1):
                lacking = (needed if n == 1 else turn_needed) - set(case.vars) - set(turn)
                if lacking:
                    problems.append(f"suite {suite.suite!r}, case {case.id!r}, turn {n}: missing vars {sorted(lacking)}; add them to 'vars' or the turn")
        else:
            lacking = needed - set(case.vars)
            if lacking:
                problems.append(f"suite {suite.suite!r}, case {case.id!r}: missing vars {sorted(lacking)}; add them to 'vars'")
        problems += _unrenderable(suite, case)
    return problems


def _unrenderable(suite: Suite, case) -> list[str]:
    """Each nunjucks segment rendered with the case's vars (each turn's, for a stream): the errors promptfoo
    would fail the test with, found before any case runs."""
    templates = [(n, seg) for n, seg in enumerate(suite.prompt, 1) if seg.nunjucks]
    if not templates:
        return []
    filters = js_filters(suite)
    problems = []
    for values in [{**case.vars, **turn} for turn in case.turns] or [case.vars]:
        for n, seg in templates:
            assert seg.text is not None  # Segment._one_source: a nunjucks segment's template is its text
            try:
                nunjucks.render_prompt(seg.text, values, filters)
            except nunjucks.RenderError as e:
                problems.append(f"suite {suite.suite!r}, case {case.id!r}: prompt segment {n} cannot be rendered "
                                f"({e.reason}), as promptfoo fails such a test; fix the template or the vars")
    return list(dict.fromkeys(problems))


def js_filters(suite: Suite) -> dict[str, Callable[..., Any]]:
    """The suite's custom nunjucks filters (``name: file://PATH.js``), each a call into the JavaScript worker."""
    if not suite.filters:
        return {}
    from ..setup import promptfoo as promptfoo_setup

    if not promptfoo_setup.node().is_file():
        raise GatekeeperError(f"suite {suite.suite!r}: its custom nunjucks filters ({', '.join(sorted(suite.filters))}) "
                              "run under the node that 'make promptfoo' installs, and it is not installed; run 'make promptfoo'")
    return {name: _js_filter(name, ref.removeprefix("file://")) for name, ref in suite.filters.items()}


def _js_filter(name: str, file: str) -> Callable[..., Any]:
    from . import scripted

    script = scripted.Script("javascript", file=file)

    def apply(value: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs:
            raise ValueError(f"the nunjucks filter {name!r} is given keyword arguments, which gatekeeper does not pass "
                             "to JavaScript; pass them in order")
        if any(isinstance(a, nunjucks.JSUndefined) for a in (value, *args)):
            raise ValueError(f"the nunjucks filter {name!r} is given an undefined value (a var the test does not set), "
                             "which gatekeeper cannot pass to JavaScript; set the var")
        try:
            result = scripted.call(script, [value, *args], what=f"the nunjucks filter {name!r} ({file})")
        except scripted.CallFailed as e:
            raise ValueError(f"the nunjucks filter {name!r} threw: {e}") from None
        return nunjucks.JSUndefined() if result is scripted.UNDEFINED else result
    return apply


def fill(text: str, values: Mapping[str, str]) -> str:
    def sub(m: re.Match) -> str:
        if m.group(1) not in values:
            raise GatekeeperError(f"missing var {m.group(1)!r}")
        return values[m.group(1)]

    return VAR.sub(sub, text)


def pieces(ws: Workspace, suite: Suite, values: Mapping[str, str], static_only: bool = False) -> list[Piece]:
    """The suite's segments rendered with ``values``. ``static_only``: only the static prefix matters (the
    runtime's pinned prefix), so a dynamic nunjucks segment is left empty rather than rendered without its vars."""
    filters = js_filters(suite) if any(seg.nunjucks for seg in suite.prompt) else {}

    def text(n: int, seg) -> str:
        if seg.nunjucks and static_only and not seg.static:
            return ""
        if seg.nunjucks:
            try:
                return nunjucks.render_prompt(ws.segment_text(suite, seg), values, filters)
            except nunjucks.RenderError as e:
                raise GatekeeperError(f"{suite.path or suite.suite}: suite {suite.suite!r}: prompt segment {n} cannot be "
                                      f"rendered ({e.reason}); fix the template or the vars") from None
        return fill(seg.text, values) if templated(seg) else ws.segment_text(suite, seg)

    return [Piece(seg.role, seg.static, text(n, seg)) for n, seg in enumerate(suite.prompt, 1)]


def order(items: Sequence[Piece], mode: Mode) -> list[Piece]:
    if mode == "as_written":
        return list(items)
    return [p for p in items if p.static] + [p for p in items if not p.static]


def messages(items: Sequence[Piece]) -> list[dict[str, str]]:
    """Consecutive pieces of one role become one message."""
    out: list[dict[str, str]] = []
    for p in items:
        if out and out[-1]["role"] == p.role:
            out[-1]["content"] += "\n\n" + p.text
        else:
            out.append({"role": p.role, "content": p.text})
    return out


def static_text(engine, ordered: Sequence[Piece]) -> str:
    """The rendered text up to the first dynamic byte (all of it when nothing is dynamic)."""
    first_dynamic = next((i for i, p in enumerate(ordered) if not p.static), None)
    if first_dynamic is None:
        return engine.render(messages(ordered))
    marked = list(ordered)
    p = marked[first_dynamic]
    marked[first_dynamic] = Piece(p.role, p.static, _MARK + p.text)
    text = engine.render(messages(marked))
    return text[: text.index(_MARK)]


def render(engine, items: Sequence[Piece], mode: Mode, history: Sequence[dict[str, str]] = ()) -> Rendered:
    """Render through the engine's chat template and count the static prefix's tokens.

    ``history`` continues a stream: the earlier turns' messages (with the assistant's
    answers), followed here by the last piece, the new user turn.
    """
    ordered = order(items, mode)
    if ordered and all(p.role == RAW for p in ordered):  # already rendered (a captured prompt): sent as it is
        first_dynamic = next((i for i, p in enumerate(ordered) if not p.static), len(ordered))
        prefix_text, text = "".join(p.text for p in ordered[:first_dynamic]), "".join(p.text for p in ordered)
        tokens = engine.tokenize(text)
        n = common_prefix(engine.tokenize(prefix_text), tokens) if prefix_text else 0
        return Rendered([{"role": "user", "content": text}], text, tokens, n, prefix_text)
    prefix_text = static_text(engine, ordered)
    msgs = messages(ordered)
    if history:
        msgs = [*history, msgs[-1]]
    text = engine.render(msgs)
    tokens = engine.tokenize(text)
    n = 0
    if prefix_text and text.startswith(prefix_text):
        # the prefix's last token may merge with the text after it: count only tokens both agree on
        n = common_prefix(engine.tokenize(prefix_text), tokens)
    return Rendered(msgs, text, tokens, n, prefix_text)

