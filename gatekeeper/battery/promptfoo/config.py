"""One promptfoo config file as promptfoo reads it: its top-level keys, its ``$ref`` pointers, its ``defaultTest``.

Each top-level key is read, passed over (it chooses or describes providers and reports, which the engine and the
ledger replace), warned of (promptfoo uses it, what is graded stays the same) or refused (it changes what is
graded: exit 2 with the fix); ``$ref`` pointers (``assertionTemplates``) are resolved within the file, as
promptfoo's json-schema-ref-parser does; ``defaultTest``, inline or a ``file://`` file, is checked as a test is,
and a test's keys and options are named here too. ``referenced`` lists the local files a config reads, so that
files kept beside a config in assertions/ are not taken for suites.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import unquote

from ...errors import GatekeeperError
from ...js import yaml as jsyaml
from ...workspace import read_yaml
from .files import REMOTE, _file, _line, glob_files, has_magic, warn

SUFFIXES = (".promptfoo.yaml", ".promptfoo.yml")
# top-level keys: read; silent (they choose or describe providers and reports, which the engine and the
# ledger replace); warned (promptfoo uses them, gatekeeper does not, what is graded stays the same);
# refused (they change what is graded and gatekeeper cannot honour them: the fix)
READ_KEYS = {"prompts", "tests", "defaultTest", "nunjucksFilters"}
SILENT_KEYS = {"description", "tags", "metadata", "providers", "targets", "outputPath", "sharing", "env",
               "writeLatestResults", "tracing", "assertionTemplates"}
WARNED_KEYS = {"evaluateOptions": "run settings (repeat, delay, concurrency); gatekeeper's own policy sets these",
               "commandLineOptions": "defaults for promptfoo's command line; gatekeeper has its own",
               "derivedMetrics": "metrics computed from assertion scores; gatekeeper records each assertion's outcome"}
REFUSED_KEYS = {"scenarios": "list the tests themselves under 'tests'",
                "extensions": "hooks run JavaScript or Python", "redteam": "generate the tests first ('promptfoo redteam generate')",
                "plugins": "generate the tests first ('promptfoo redteam generate')",
                "strategies": "generate the tests first ('promptfoo redteam generate')"}
TEST_KEYS = {"description", "vars", "assert", "options", "threshold", "metadata", "provider", "providers", "prompts"}
# test options: changing what is graded (refused), read (grading settings and expansion), and the rest promptfoo
# uses for running, not grading (ignored)
CHANGES_OUTPUT = ("prefix", "suffix", "transformVars", "storeOutputAs")
GRADING_OPTIONS = ("provider", "rubricPrompt", "factuality")
OUTPUT_TRANSFORMS = ("transform", "postprocess")  # promptfoo runs the first set on the output (battery/transform.py)
RUN_OPTIONS = {"disableVarExpansion", "disableDefaultAsserts", "disableConversationVar", "runSerially", "repeat"}


def is_config(path: Path) -> bool:
    return path.name.endswith(SUFFIXES)


def config_name(path: Path) -> str:
    name = path.name
    for suffix in SUFFIXES:
        name = name.removesuffix(suffix)
    return name


def _read(path: Path) -> dict:
    """The config with its ``$ref`` pointers resolved; its top-level keys read, ignored, warned of or refused."""
    data = read_yaml(path, jsyaml.load)
    if not isinstance(data, dict):
        raise GatekeeperError(f"{path}: expected a promptfoo config (a mapping with 'tests', 'prompts', ...) at the top level")
    for key in data:
        if key in REFUSED_KEYS:
            raise GatekeeperError(f"{path}: field '{key}': not supported by gatekeeper; {REFUSED_KEYS[key]}, and remove it")
        if key in WARNED_KEYS:
            warn(str(path), f"field '{key}' is ignored: {WARNED_KEYS[key]}")
        elif key not in READ_KEYS | SILENT_KEYS:
            warn(str(path), f"field '{key}' is ignored: not a promptfoo config key (promptfoo ignores it too); check its spelling")
    providers = data.get("providers", data.get("targets"))
    if isinstance(providers, list) and any(isinstance(p, dict) and "prompts" in p for p in providers):
        warn(str(path), "a provider's 'prompts' is ignored: the engine profile replaces the providers, and it runs every prompt")
    return _deref(data, path)


def _deref(data: Any, path: Path) -> Any:
    """``{$ref: "#/a/b"}`` replaced by what the pointer names (its other keys merged over it), as promptfoo's
    json-schema-ref-parser does within one file; a reference to another file is refused."""

    def resolve(node: Any, trail: tuple[str, ...]) -> Any:
        if isinstance(node, list):
            return [resolve(v, trail) for v in node]
        if not isinstance(node, dict):
            return node
        ref = node.get("$ref")
        if not isinstance(ref, str):
            return {k: resolve(v, trail) for k, v in node.items()}
        if not ref.startswith("#"):
            raise GatekeeperError(f"{path}: $ref {ref!r}: gatekeeper resolves references within the file (#/...); "
                              "copy the referenced part into this file or load it with file://")
        if ref in trail:
            raise GatekeeperError(f"{path}: $ref {ref!r} refers to itself; fix the reference")
        target: Any = data
        for part in [unquote(p).replace("~1", "/").replace("~0", "~") for p in ref[1:].split("/")[1:]]:
            if isinstance(target, dict) and part in target:
                target = target[part]
            elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
                target = target[int(part)]
            else:
                raise GatekeeperError(f"{path}, line {_line(path, ref)}: $ref {ref!r}: no such entry in the file; fix the reference")
        target = resolve(target, (*trail, ref))
        extra = {k: resolve(v, trail) for k, v in node.items() if k != "$ref"}
        return {**target, **extra} if extra and isinstance(target, dict) else target

    return resolve(data, ())


def _mapping(value: Any, where: str, field: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise GatekeeperError(f"{where}: field '{field}' must be a mapping (gatekeeper reads no vars files); fix it")
    return value


def _default_test(config: dict, path: Path) -> dict:
    default = config.get("defaultTest") or {}
    if isinstance(default, str):
        if not default.startswith("file://"):
            raise GatekeeperError(f"{path}: field 'defaultTest': a string must be a file:// reference (promptfoo's rule); fix it")
        file = _file(default, path.parent, path)
        default = _deref(read_yaml(file, jsyaml.load), file) or {}
    default = _mapping(default, str(path), "defaultTest")
    _test_keys(default, f"{path}: defaultTest", set(TEST_KEYS) - {"description"})
    return default


def _test_keys(raw: dict, where: str, allowed: set[str]) -> None:
    for key in sorted(set(raw) - allowed):
        if key == "assertScoringFunction":
            raise GatekeeperError(f"{where}: field 'assertScoringFunction': not supported by gatekeeper (a JavaScript or "
                                  "Python function scores the test); remove it")
        if key == "providerOutput":
            raise GatekeeperError(f"{where}: field 'providerOutput': not supported by gatekeeper (a fixed output, no model "
                                  "runs); remove it")
        raise GatekeeperError(f"{where}: field '{key}': not a promptfoo test key; remove it or check its spelling")


def referenced(path: Path, config: dict | None = None) -> set[Path]:
    """The local files a config reads (tests, prompts, vars, values), so that files kept beside a config in
    assertions/ are not taken for suites."""
    data = config if config is not None else read_yaml(path, jsyaml.load)
    out: set[Path] = set()

    def add(ref: str) -> None:
        local = ref.removeprefix("file://").split("#")[0]
        if "\n" in local or REMOTE.match(local) or not local:
            return
        out.update(m.resolve() for m in (glob_files(path.parent, local) if has_magic(local) else [path.parent / local]) if m.is_file())

    def walk(node: Any, bare: bool) -> None:
        if isinstance(node, str) and (bare or node.startswith("file://")):
            add(node)
        elif isinstance(node, dict):
            for k, v in node.items():
                walk(k, bare)
                walk(v, bare and k in ("id", "raw", "path"))
        elif isinstance(node, list):
            for v in node:
                walk(v, bare)

    if isinstance(data, dict):
        walk({k: v for k, v in data.items() if k not in ("prompts", "tests")}, False)
        walk(data.get("prompts"), True)
        walk(data.get("tests"), True)
    return out
