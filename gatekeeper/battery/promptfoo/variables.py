"""A promptfoo test's vars as promptfoo passes them: ``file://`` vars read, array vars expanded one case each.

A ``file://`` var is its text file's text, trimmed, and a globbed one (with var expansion on) the list of its
files' texts; a var whose value is a list of strings gives one case per item (promptfoo's
generateVarCombinations); a value that is not text reaches the prompt as compact JSON. A var read from a
script, YAML, PDF or image is refused: gatekeeper reads vars from text files.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

from ...errors import GatekeeperError
from ...js.value import js_string, js_trim, stringify
from ...workspace import read_text
from .files import glob_files, has_magic

_VAR_CODE_OR_DATA = (".js", ".mjs", ".cjs", ".ts", ".py", ".rb", ".yaml", ".yml", ".pdf", ".png", ".jpg", ".jpeg", ".gif", ".webp")


def _var_value(value: Any, base: Path, where: str, expand: bool = True) -> Any:
    """A ``file://`` var read as promptfoo reads it: the file's text, trimmed; a glob (with var expansion on)
    is the list of its files' texts, one case each (promptfoo's generateVarCombinations)."""
    if not (isinstance(value, str) and value.startswith("file://")):
        return value
    ref = value[len("file://"):]
    if has_magic(ref) and expand:
        files = glob_files(base, ref)
        if not files:
            raise GatekeeperError(f"{where}: var {value!r} matches no file (relative to {base}); fix the pattern")
        texts = [_var_file(f, value, where) for f in files]
        return texts if len(texts) > 1 else texts[0]
    if has_magic(ref) or Path(ref).suffix.lower() in _VAR_CODE_OR_DATA:
        raise GatekeeperError(f"{where}: var {value!r}: gatekeeper reads a var from text files, not a script, YAML, PDF or "
                              "image" + (", and a glob only with var expansion on" if has_magic(ref) else "")
                              + "; put the text in a .txt file")
    path = (base / ref).resolve()
    if not path.is_file():
        raise GatekeeperError(f"{where}: var {value!r} not found (relative to {base}); fix the path")
    return js_trim(read_text(path))  # promptfoo trims a text var file


def _var_file(path: Path, value: str, where: str) -> str:
    if path.suffix.lower() in _VAR_CODE_OR_DATA:
        raise GatekeeperError(f"{where}: var {value!r} matches {path.name}: gatekeeper reads a var from text files, not a "
                              "script, YAML, PDF or image; narrow the pattern to text files")
    return js_trim(read_text(path))


def _combinations(vars: dict, expand: bool) -> list[dict]:
    """promptfoo's generateVarCombinations: a var whose value is a list of strings gives one test per item."""
    keys = list(vars)
    choices = [vars[k] if expand and isinstance(vars[k], list) and vars[k] and isinstance(vars[k][0], str) else [vars[k]]
               for k in keys]
    return [dict(zip(keys, combo)) for combo in itertools.product(*choices)]


def _prompt_var(v: Any) -> str:
    return v if isinstance(v, str) else stringify(v) if isinstance(v, (dict, list)) else js_string(v)
