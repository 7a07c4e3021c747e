"""The nunjucks a config's prompts run: the config's custom filters, and the vars a prompt's template reads.

A config's ``nunjucksFilters`` are found as promptfoo's readFilters finds them; a prompt may apply nunjucks' own
filters and those (a chat none of the custom ones, as promptfoo renders a chat's messages without them), and
any other filter is refused. A template sees each var as promptfoo passes it, not as text, so a var it reads
must be text, and must not itself hold nunjucks, which promptfoo renders first and gatekeeper does not.
"""

from __future__ import annotations

import glob as globbing
import os
from pathlib import Path

from ...errors import GatekeeperError
from ...js import nunjucks
from ...workspace import JS_SUFFIXES
from .files import has_magic
from .prompts import Prompt


def custom_filters(config: dict, path: Path) -> dict[str, str]:
    """The config's ``nunjucksFilters`` as promptfoo's readFilters finds them (each path joined to the config's
    folder, a glob allowed): name -> file:///ABSOLUTE/PATH of a JavaScript module exporting the function."""
    filters = config.get("nunjucksFilters")
    if filters is None:
        return {}
    if not isinstance(filters, dict):
        raise GatekeeperError(f"{path}: field 'nunjucksFilters': a mapping of filter name to a JavaScript file; fix it")
    out = {}
    for name, ref in filters.items():
        where = f"{path}: field 'nunjucksFilters.{name}'"
        if not isinstance(ref, str) or not ref:
            raise GatekeeperError(f"{where}: the path of a JavaScript file exporting the filter function; fix it")
        if ref.startswith("file://"):
            raise GatekeeperError(f"{where}: promptfoo joins {ref!r} to the config's folder as it is, so 'file://' finds no "
                                  "file and the filter is not defined; write the path without 'file://'")
        joined = os.path.normpath(f"{path.parent}/{ref}")  # node's path.join: an absolute path is joined too
        files = sorted(p for p in globbing.glob(joined) if Path(p).is_file()) if has_magic(ref) else \
            [joined] if Path(joined).is_file() else []
        if len(files) != 1:
            found = "matches no file" if not files else f"matches {len(files)} files"
            raise GatekeeperError(f"{where}: {ref} {found} (relative to {path.parent}); name the one JavaScript file "
                                  "that exports the filter")
        if not files[0].lower().endswith(JS_SUFFIXES):
            raise GatekeeperError(f"{where}: {ref}: a nunjucks filter is a JavaScript module ({', '.join(JS_SUFFIXES)}) "
                                  "exporting a function; fix the path")
        out[name] = f"file://{Path(files[0]).resolve()}"
    return out


def prompt_filters(prompt: Prompt, custom: dict[str, str], config: dict) -> dict[str, str]:
    """The custom filters the prompt's templates apply (name -> file://PATH). A filter neither nunjucks nor the
    config defines, or a custom one in a chat (which promptfoo renders without them), is refused."""
    used: dict[str, str] = {}
    for seg in prompt.segments:
        if not seg.nunjucks:
            continue
        for name in sorted(nunjucks.names(seg.text).filters):
            if prompt.chat and name in nunjucks.BUILTIN_FILTERS:
                continue  # a chat is rendered with nunjucks' own filters, a custom one of that name or not
            if name in custom and prompt.chat:
                raise GatekeeperError(f"{prompt.where}: a chat message uses the custom filter {name!r}: promptfoo renders "
                                      "a chat's messages without custom filters, and then renders the chat's JSON text "
                                      "as one template instead, which gatekeeper does not do; apply the filter in a text "
                                      "prompt, or write the value out")
            if name in custom:
                used[name] = custom[name]
            elif name not in nunjucks.BUILTIN_FILTERS:
                fix = ("promptfoo 0.123.1 reads custom filters from 'nunjucksFilters' and ignores this config's "
                       "'filters'; rename the key to 'nunjucksFilters'" if "filters" in config else
                       "define it under 'nunjucksFilters' (NAME: path/to/filter.js), or remove it")
                raise GatekeeperError(f"{prompt.where}: the prompt uses the nunjucks filter {name!r}, which neither "
                                      f"nunjucks nor the config defines, so promptfoo fails every test with 'filter not "
                                      f"found: {name}'; {fix}")
    return used


def template_vars(prompt: Prompt) -> set[str]:
    """The vars the prompt's nunjucks segments read (they see a var as promptfoo passes it, not as text)."""
    return {v for seg in prompt.segments if seg.nunjucks for v in nunjucks.names(seg.text).vars}


def is_text_var(value: object, expand: bool) -> bool:
    """Whether promptfoo hands a var to a template as text: a string, or a list of strings expanded into one
    test each (values already read from their ``file://`` files)."""
    return isinstance(value, str) or (expand and isinstance(value, list) and bool(value)
                                      and all(isinstance(v, str) for v in value))


def var_template(prompt: Prompt, case_vars: dict[str, str]) -> str | None:
    """The first var a text prompt's template reads that itself holds nunjucks once promptfoo has prepared it
    (promptfoo renders it as a template first, gatekeeper does not); None when there is none."""
    if prompt.chat:  # a chat's messages see the vars as they are
        return None
    prepared = nunjucks.prompt_vars(case_vars)
    return next((name for name in sorted(template_vars(prompt))
                 if any(mark in str(prepared.get(name, "")) for mark in nunjucks.MARKS)), None)
