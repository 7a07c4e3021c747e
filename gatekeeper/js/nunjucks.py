"""Prompts and assertion values templated from a test's vars, as promptfoo does with nunjucks (``{{ var }}``).

nunjucks is a port of Jinja2, so Jinja2 (sandboxed) renders the same templates, given back what JavaScript
gives nunjucks: how values print, ``undefined`` and the operators (``nunjucks_operators``) and nunjucks' own
filters (``nunjucks_filters``). A member (``a.b``, ``a["b"]``) of a JSON value is looked up as JavaScript
looks it up: a mapping's key (never a Python method), a string's or list's ``length``. nunjucks keeps a
template's trailing newline. promptfoo's ``env`` global (its process environment) is an error, as
gatekeeper does not see it; a config's custom filters are ``render``'s ``filters``. ``render_prompt`` is
promptfoo's renderPrompt: the vars prepared as it prepares them first. ``names`` also refuses what Jinja2
parses and nunjucks does not (slices, ``is sameas 3``, ``1e3``), and, as ``NotRead``, what nunjucks reads and
gatekeeper does not (``===``, ``{% include %}``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable, Mapping

import jinja2
from jinja2 import meta, nodes
from jinja2.sandbox import SandboxedEnvironment

from .nunjucks_filters import BUILTIN_FILTERS, environment_filters, load
from .nunjucks_operators import OPERATOR_FILTERS, TESTS, JSUndefined, js_range, printed, with_js_operators
from .value import code_units, js_string

__all__ = ["BUILTIN_FILTERS", "MARKS", "JSUndefined", "Names", "RenderError", "auto_raw", "names", "prompt_vars",
           "render", "render_prompt", "render_value"]

MARKS = ("{{", "{%", "{#")


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


@lru_cache(maxsize=1)
def _env() -> SandboxedEnvironment:
    env = _JSEnvironment(autoescape=False, keep_trailing_newline=True, finalize=printed, undefined=JSUndefined)
    env.filters = environment_filters(env.filters)
    env.filters.update(OPERATOR_FILTERS)  # names no template can write: only with_js_operators' calls reach them
    env.tests = dict(TESTS)
    env.globals = {"range": js_range, "cycler": env.globals["cycler"], "joiner": env.globals["joiner"]}  # nunjucks' globals
    return env


class NotRead(ValueError):
    """nunjucks that promptfoo renders and gatekeeper does not read (JavaScript's strict ``===``, a template
    read from a file)."""


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
    return env.from_string(with_js_operators(parsed)), reads_env


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
    """The names a template uses; a ValueError when nunjucks would not parse it (NotRead: nunjucks would, and
    gatekeeper does not read it)."""
    try:
        parsed = _env().parse(template)
        filters = frozenset(f.name for f in parsed.find_all(nodes.Filter))
        lenient = _env().overlay()  # knows every filter named, so that finding the vars compiles
        lenient.filters = {**_env().filters, **{name: load for name in filters}}
        vars = frozenset(meta.find_undeclared_variables(lenient.parse(template)))
    except jinja2.TemplateSyntaxError as e:  # TemplateAssertionError too (an unknown test)
        if re.search(r"[=!]==", template):
            raise NotRead(f"line {e.lineno}: JavaScript's strict === or !==; write == or != (loose), or the test "
                          "sameas(...)") from None
        raise ValueError(f"line {e.lineno}: {e.message}") from None
    for tag in parsed.find_all((nodes.Include, nodes.Import, nodes.FromImport, nodes.Extends)):
        raise NotRead(f"line {tag.lineno}: {{% {type(tag).__name__.lower().replace('fromimport', 'from')} %}} reads a file "
                      "relative to the folder promptfoo is run from, which gatekeeper cannot know; write the file's text in")
    for cut in parsed.find_all(nodes.Slice):
        raise ValueError(f"line {cut.lineno}: nunjucks has no slices ([a:b])")
    _jinja_only(template)
    methods = tuple(f"{c.node.attr}()" if isinstance(c.node, nodes.Getattr) else "[...]()"
                    for c in parsed.find_all(nodes.Call) if isinstance(c.node, (nodes.Getattr, nodes.Getitem)))
    return Names(vars, filters, methods)


def _jinja_only(template: str) -> None:
    """What Jinja2 parses and nunjucks does not: a test's argument without parentheses (``x is sameas 3``), a
    number written with an exponent or ``_`` (``1e3``)."""
    tokens = [t for t in _env().lex(template) if t[1] != "whitespace"]
    for k, (line, kind, value) in enumerate(tokens):
        if kind in ("integer", "float") and re.search("[eE_]", value):
            raise ValueError(f"line {line}: nunjucks does not parse the number {value}; write it out plainly")
        if kind == "name" and value == "is":
            rest = tokens[k + 1:k + 4]
            if rest and rest[0][1:] == ("name", "not"):
                rest = rest[1:]
            if len(rest) >= 2 and rest[0][1] == "name" and rest[1][1] in ("name", "string", "integer", "float", "lbracket", "lbrace") \
                    and rest[1][2] not in ("else", "or", "and"):
                raise ValueError(f"line {line}: nunjucks reads a test's argument only in parentheses "
                                 f"(is {rest[0][2]}(...))")


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
