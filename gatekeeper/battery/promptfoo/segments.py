"""A prompt's messages as gatekeeper segments: ``{var}`` fields where promptfoo's nunjucks is that simple,
else nunjucks segments.

A prompt whose only nunjucks is ``{{ var }}`` becomes ``{var}`` fields; any other nunjucks (tags, filters,
expressions, literal ``{word}`` braces) makes a nunjucks segment, rendered as promptfoo renders it with the
config's ``nunjucksFilters`` (a text prompt with a tag left open is literal text, as promptfoo wraps it in
``{% raw %}``). A chat's messages are rendered one by one without custom filters, as promptfoo renders a JSON
prompt; what promptfoo would render differently (a method call, a custom filter in a chat) is refused.
"""

from __future__ import annotations

import re
from typing import Any

from ...errors import GatekeeperError
from ...js import nunjucks
from ...workspace import Segment

_SIMPLE_VAR = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")
_KEYWORDS = {"true", "false", "none", "null"}  # nunjucks' constants, not vars


def _segment(role: str, text: str, where: str, chat: bool = False) -> Segment:
    """One message of a prompt: ``{var}`` fields where its only nunjucks is ``{{ var }}``, else a nunjucks
    segment. ``chat``: a message of a JSON chat, which promptfoo renders without wrapping open tags."""
    from ..partition import VAR

    if role not in ("system", "user", "assistant"):
        raise GatekeeperError(f"{where}: prompt role {role!r}: use system, user or assistant")
    if not chat:
        text = nunjucks.auto_raw(text)
    fields = _SIMPLE_VAR.sub(lambda m: "{" + m.group(1) + "}", text)
    simple = (not any(mark in fields for mark in nunjucks.MARKS) and not VAR.search(_SIMPLE_VAR.sub("", text))
              and not _KEYWORDS & set(_SIMPLE_VAR.findall(text)))
    if simple:
        return Segment(role=role, static=fields == text, text=fields)
    return _template(role, text, where, chat)


def _template(role: str, text: str, where: str, chat: bool) -> Segment:
    """A nunjucks segment, or static text when it reads no var and no filter (rendered here once)."""
    from ..partition import VAR

    try:
        used = nunjucks.names(text)
    except nunjucks.NotRead as e:
        raise GatekeeperError(f"{where}: the prompt's nunjucks is not read by gatekeeper ({e}), though promptfoo "
                              "renders it; write it as the message says") from None
    except ValueError as e:
        raise GatekeeperError(f"{where}: the prompt's nunjucks does not parse ({e}), so promptfoo fails every test "
                              "with it; fix the template") from None
    if used.methods:
        raise GatekeeperError(f"{where}: the prompt calls the method {used.methods[0]}, which promptfoo runs as "
                              "JavaScript and gatekeeper's nunjucks does not; use a nunjucks filter (upper, replace, "
                              "...) or a custom one (nunjucksFilters)")
    if not used.vars and not used.filters:
        try:
            rendered = nunjucks.render_prompt(text, {})
        except nunjucks.RenderError as e:
            raise GatekeeperError(f"{where}: the prompt cannot be rendered ({e.reason}), so promptfoo fails every test "
                                  "with it; fix the template") from None
        if not VAR.search(rendered):
            return Segment(role=role, static=True, text=rendered)
    return Segment(role=role, static=not used.vars, text=text, nunjucks=True)


def _chat(data: Any, where: str) -> list[tuple[str, str]] | None:
    """(role, text) of each message of a chat prompt: a JSON list of {role, content}, or a provider's request
    shape ``{system?, messages}``; a content may be a list of one ``{type: text, text}`` part. None: no chat."""
    if isinstance(data, dict) and isinstance(data.get("messages"), list):
        if set(data) - {"messages", "system"}:
            raise GatekeeperError(f"{where}: the chat prompt also sets {sorted(set(data) - {'messages', 'system'})}, which "
                                  "promptfoo sends to the provider and gatekeeper's engines do not take; keep "
                                  "'messages' (and 'system')")
        system = [{"role": "system", "content": data["system"]}] if "system" in data else []
        data = system + data["messages"]
    if not (isinstance(data, list) and data and all(isinstance(m, dict) and "role" in m and "content" in m for m in data)):
        return None
    out = []
    for m in data:
        content = m["content"]
        if isinstance(content, list) and len(content) == 1 and isinstance(content[0], dict) \
                and content[0].get("type") == "text" and isinstance(content[0].get("text"), str):
            content = content[0]["text"]  # cache_control and the like steer a hosted API's cache, not the text
        if not isinstance(content, str):
            raise GatekeeperError(f"{where}: a chat message's content is not text (images, several parts); gatekeeper "
                                  "renders a message of one text")
        out.append((m["role"], content))
    return out
