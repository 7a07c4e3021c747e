"""A promptfoo config's prompts, read as promptfoo 0.123.1's prompt processors read them
(battery/promptfoo/suites.py turns each into a suite).

``prompts`` is text, a list or a ``{file: label}`` mapping; a string is a file when promptfoo's maybeFilePath
says so (``file://`` optional), a glob gives one prompt per file (a glob matching nothing is the text itself),
a ``.txt`` file holds several prompts between ``---`` lines, each trimmed, ``.json``/``.yaml`` files hold a
chat (a list of messages, or a provider's ``{system, messages}``), ``.md``/``.j2`` one prompt as written and
``.jsonl`` one a line. What promptfoo would run as code, fetch, or send as a path's text is refused. Each prompt keeps promptfoo's label and id (what a test's
``prompts:`` names) and gets a name part for its suite; its messages are segments (battery/promptfoo/segments.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from ...errors import GatekeeperError
from ...js import yaml as jsyaml
from ...js.value import JSONError, js_trim, parse_json, stringify
from ...workspace import Segment, read_text, read_yaml
from .files import SCRIPT_SUFFIXES, glob_files, has_magic, warn
from .segments import _chat, _segment

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
    out: list[tuple[str, dict]] = []
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
        parts: list[str] = []
        buffer: list[str] = []
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
            text = stringify(read_yaml(file, jsyaml.load) if suffix != ".json" else parse_json(text))
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


def _is_json(text: str) -> bool:
    try:
        parse_json(text)
    except JSONError:
        return False
    return True


def _name(label: str | None) -> str:
    """A label as a suite/stage name part: letters, digits, '_' and '-', at most 48 characters."""
    return re.sub(r"[^A-Za-z0-9_]+", "-", label or "").strip("-")[:48].strip("-")


def matches(ref: str, prompt: Prompt) -> bool:
    """promptfoo's doesPromptRefMatch: a test's ``prompts:`` entry names a prompt by label or id."""
    names = [n for n in (prompt.label, prompt.id) if n]
    return any(n == ref or (ref.endswith("*") and n.startswith(ref[:-1])) or n.startswith(f"{ref}:") for n in names)
