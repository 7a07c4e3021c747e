"""A promptfoo config's prompts, read as promptfoo 0.123.1's prompt processors read them (battery/promptfoo.py
turns each into a suite).

``prompts`` is text, a list or a ``{file: label}`` mapping; a string is a file when promptfoo's maybeFilePath
says so (``file://`` optional), a glob gives one prompt per file (a glob matching nothing is the text itself),
a ``.txt`` file holds several prompts between ``---`` lines, each trimmed, ``.json``/``.yaml`` files hold a
chat (a list of messages, or a provider's ``{system, messages}``), ``.md``/``.j2`` one prompt as written and ``.jsonl`` one a line. What promptfoo would run as code,
fetch, or send as a path's text is refused. Each prompt keeps promptfoo's label and id (what a test's
``prompts:`` names) and gets a name part for its suite. The file helpers here serve battery/promptfoo.py too.

A prompt whose only nunjucks is ``{{ var }}`` becomes ``{var}`` fields; any other nunjucks (tags, filters,
expressions, literal ``{word}`` braces) makes a nunjucks segment, rendered as promptfoo renders it with the
config's ``nunjucksFilters`` (a text prompt with a tag left open is literal text, as promptfoo wraps it in
``{% raw %}``). A chat's messages are rendered one by one without custom filters, as promptfoo renders a JSON
prompt; what promptfoo would render differently (a method call, a custom filter in a chat) is refused.
"""

from __future__ import annotations

import glob as globbing
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import GatekeeperError
from ..js import nunjucks, yaml as jsyaml
from ..js.value import JSONError, js_trim, parse_json
from ..workspace import JS_SUFFIXES, Segment, read_text, read_yaml

SCRIPT_SUFFIXES = (".js", ".cjs", ".mjs", ".ts", ".cts", ".mts", ".py", ".rb", ".go", ".sh", ".bash", ".exe", ".bat",
                   ".cmd", ".ps1", ".pl")
_WARNED: set[tuple[str, str]] = set()


def warn(where: str, message: str) -> None:
    """A note on stderr, once per place and message (stdout stays the --json document)."""
    if (where, message) not in _WARNED:
        _WARNED.add((where, message))
        print(f"warning: {where}: {message}", file=sys.stderr)


def has_magic(pattern: str) -> bool:
    return bool(re.search(r"[*?]|\[[^\]]+\]", pattern))


def glob_files(base: Path, pattern: str) -> list[Path]:
    """The files a glob matches, relative to ``base`` (``**`` any depth, as promptfoo's globSync), sorted."""
    return sorted(Path(p) for p in globbing.glob(str(Path(globbing.escape(str(base))) / pattern), recursive=True) if Path(p).is_file())


_SIMPLE_VAR = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")
_KEYWORDS = {"true", "false", "none", "null"}  # nunjucks' constants, not vars


def _segment(role: str, text: str, where: str, chat: bool = False) -> Segment:
    """One message of a prompt: ``{var}`` fields where its only nunjucks is ``{{ var }}``, else a nunjucks
    segment. ``chat``: a message of a JSON chat, which promptfoo renders without wrapping open tags."""
    from .partition import VAR

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
    from .partition import VAR

    try:
        used = nunjucks.names(text)
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


def _is_json(text: str) -> bool:
    try:
        parse_json(text)
    except JSONError:
        return False
    return True


_PATH_EXTENSIONS = (".cjs", ".cts", ".j2", ".js", ".json", ".jsonl", ".md", ".mjs", ".mts", ".py", ".ts", ".txt", ".yml", ".yaml")
PROMPT_DELIMITER = "---"  # promptfoo's separator of several prompts in one text file
PROMPT_KEYS = {"id", "label", "raw", "config", "display", "template"}


@dataclass(frozen=True)
class Prompt:
    """One prompt of a config: promptfoo's label (what a test's ``prompts:`` names), its id, the suite name
    part gatekeeper gives it, and its segments."""

    label: str
    id: str | None
    name: str
    segments: list[Segment]
    where: str = ""  # the config and field it came from, for messages
    chat: bool = False  # a JSON chat: promptfoo renders its messages without custom filters


def _maybe_path(s: str) -> bool:
    """promptfoo's maybeFilePath: when a prompt string is read as a file path rather than as the prompt."""
    if any(mark in s for mark in ("\n", "portkey://", "langfuse://", "helicone://")):
        return False
    tokens = s.split(":")
    last, before = tokens[-1], tokens[-2] if len(tokens) > 1 else None
    return (s.startswith("file://") or any(last.endswith(e) or (before or "").endswith(e) for e in _PATH_EXTENSIONS)
            or (len(s) >= 3 and s[-3] == ".") or (len(s) >= 4 and s[-4] == ".") or any(c in s for c in "*/\\"))


def _prompt_entries(config: dict, path: Path) -> list[tuple[str, dict]]:
    """promptfoo's normalizeInput: (field, {raw, label?, id?}) for each ``prompts`` entry."""
    prompts = config.get("prompts")
    if prompts is None:
        return [("prompts", {"raw": "{{prompt}}"})]  # promptfoo's default prompt: the test's 'prompt' var
    if isinstance(prompts, str):
        return [("prompts", {"raw": prompts})]
    if isinstance(prompts, dict) and prompts:  # {path: label}
        return [(f"prompts.{raw}", {"raw": raw, "label": label}) for raw, label in prompts.items()]
    if not isinstance(prompts, list) or not prompts:
        raise GatekeeperError(f"{path}: field 'prompts': a prompt, a list of prompts or a mapping of file to label; fix it")
    out = []
    for n, entry in enumerate(prompts):
        if isinstance(entry, str):
            out.append((f"prompts.{n}", {"raw": entry}))
        elif isinstance(entry, dict):
            unknown = sorted(set(entry) - PROMPT_KEYS)
            if unknown:
                raise GatekeeperError(f"{path}: field 'prompts.{n}.{unknown[0]}': not a promptfoo prompt key; remove it")
            if entry.get("config"):
                warn(str(path), f"field 'prompts.{n}.config' is ignored: provider settings; gatekeeper's engine profile and "
                            "the suite's decoding set these")
            out.append((f"prompts.{n}", {**entry, "raw": entry.get("raw") or entry.get("id"),
                                         "label": entry.get("label") or entry.get("display")}))
        else:
            raise GatekeeperError(f"{path}: field 'prompts.{n}': a prompt is text, a file or {{id: FILE, label: NAME}}; fix it")
    return out


def read_prompts(config: dict, path: Path) -> list[Prompt]:
    out: list[Prompt] = []
    for n, (field, entry) in enumerate(_prompt_entries(config, path), 1):
        raw, label = entry.get("raw"), entry.get("label")
        if not isinstance(raw, str) or not raw:
            raise GatekeeperError(f"{path}: field '{field}': a prompt is text or a file; fix it")
        if label is not None and not isinstance(label, str):
            raise GatekeeperError(f"{path}: field '{field}': a label is text; fix it")
        where = f"{path}: field '{field}'"
        if re.match(r"^[a-z][a-z0-9+.-]*://", raw, re.I) and not raw.startswith("file://"):
            raise GatekeeperError(f"{where}: {raw.split(chr(10))[0][:80]} is a remote prompt, fetched over the network, which "
                                  "gatekeeper does not do; copy the prompt into a text file beside the config and name it here")
        if raw.startswith("exec:"):
            raise GatekeeperError(f"{where}: the prompt is made by running a program, which gatekeeper does not do; write it out")
        if not _maybe_path(raw):
            out.append(_prompt(label or raw, entry.get("id"), _name(label) or f"prompt-{n}", raw, where))
            continue
        local = raw.removeprefix("file://")
        if (path.parent / local).is_dir():  # promptfoo reads no file from it and sends the path itself as the prompt
            raise GatekeeperError(f"{where}: {raw} is a folder, which promptfoo would send as the prompt text; name its "
                                  f"files with a glob ({local.rstrip('/')}/*.txt)")
        if has_magic(local):
            files = glob_files(path.parent, local)
            if files:  # promptfoo drops the label of a globbed entry: each file is named by itself
                out += [p for f in files for p in _file_prompts(f, None, path, where)]
            else:  # a pattern that matches nothing is the prompt's text (promptfoo's fallback)
                out.append(_prompt(label or raw, entry.get("id"), _name(label) or f"prompt-{n}", raw, where))
            continue
        out += _file_prompts(path.parent / local, label, path, where, raw)
    return out


def _file_prompts(file: Path, label: str | None, config: Path, where: str, raw: str | None = None) -> list[Prompt]:
    """The prompts of one prompt file, as promptfoo's processors for its extension read it."""
    shown = raw or str(file)
    suffix = file.suffix.lower()
    if suffix in SCRIPT_SUFFIXES or re.search(r"\.(c|m)?[jt]s:|\.py:", shown):
        raise GatekeeperError(f"{where}: {shown}: the prompt is made by running code, which gatekeeper does not do; "
                              "write the prompt out in a .txt (or JSON chat) file")
    if not file.is_file():
        raise GatekeeperError(f"{where}: {shown}: promptfoo reads this as a file path (it has a '/', a '.' near its end "
                              f"or a '*') and there is no such file (relative to {config.parent}); fix the path, or write "
                              "the prompt so that it does not look like a path")
    if suffix not in (".txt", ".md", ".j2", ".json", ".yaml", ".yml", ".jsonl"):
        raise GatekeeperError(f"{where}: {shown}: gatekeeper reads prompts from .txt, .md, .j2, .json, .yaml and .jsonl "
                              "files; save the prompt in one")
    text = read_text(file)
    absolute = str(file.resolve())
    stem = _name(label) or _name(file.stem) or "prompt"
    if suffix == ".txt":  # promptfoo's processTxtFile: split at lines that are '---', each part trimmed
        parts, buffer = [], []
        for line in [*re.split(r"\r?\n", text), PROMPT_DELIMITER]:
            if js_trim(line) == PROMPT_DELIMITER:
                part = js_trim("\n".join(buffer))
                if part:
                    parts.append(part)
                buffer = []
            else:
                buffer.append(line)
        labels = [f"{label}: {absolute}: {p}" if label else f"{absolute}: {p}" for p in parts]
    elif suffix == ".jsonl":
        parts = [line for line in re.split(r"\r?\n", text) if line]
        labels = [(f"{label}: {p}" if label else f"{absolute}: {p}") if len(parts) > 1 else label or absolute for p in parts]
    elif suffix in (".yaml", ".yml", ".json"):  # promptfoo keeps a YAML or JSON prompt as its JSON text
        try:
            text = json.dumps(read_yaml(file, jsyaml.load) if suffix != ".json" else json.loads(text),
                              ensure_ascii=False, separators=(",", ":"))
        except ValueError:
            pass  # promptfoo too keeps a file that does not parse as it is
        parts, labels = [text], [label or f"{absolute}: {text if suffix == '.json' else text[:80]}"]
    else:  # .md, .j2: the whole file, untrimmed
        parts, labels = [text], [label or f"{absolute}: {text[:50]}..."]
    if not parts:
        raise GatekeeperError(f"{where}: {shown} holds no prompt; write one")
    many = len(parts) > 1
    return [_prompt(lab, None, f"{stem}-{k}" if many else stem, p, f"{where} ({file.name}" + (f", prompt {k})" if many else ")"))
            for k, (p, lab) in enumerate(zip(parts, labels), 1)]


def _prompt(label: str, id: str | None, name: str, text: str, where: str) -> Prompt:
    """A chat (one segment a message), or else one user message; other JSON is refused: promptfoo would send it
    written out again."""
    try:
        data = json.loads(text) if text.lstrip().startswith(("[", "{")) else None
    except json.JSONDecodeError:
        data = None
    messages = _chat(data, where)
    if messages is not None:
        return Prompt(label, id, name, [_segment(role, content, where, chat=True) for role, content in messages], where, True)
    if _is_json(text):
        raise GatekeeperError(f"{where}: the prompt is JSON but not a chat: promptfoo renders each string in it and sends "
                              "the JSON written again (2-space indents, its own spacing and order), which gatekeeper does "
                              "not do; write the prompt as a chat (a list of {role, content}) or as plain text")
    return Prompt(label, id, name, [_segment("user", text, where)], where)


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


def _name(label: str | None) -> str:
    """A label as a suite/stage name part: letters, digits, '_' and '-', at most 48 characters."""
    return re.sub(r"[^A-Za-z0-9_]+", "-", label or "").strip("-")[:48].strip("-")


def matches(ref: str, prompt: Prompt) -> bool:
    """promptfoo's doesPromptRefMatch: a test's ``prompts:`` entry names a prompt by label or id."""
    names = [n for n in (prompt.label, prompt.id) if n]
    return any(n == ref or (ref.endswith("*") and n.startswith(ref[:-1])) or n.startswith(f"{ref}:") for n in names)


# --- custom filters and the vars a template reads ----------------------------------------------------


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
