"""The files a promptfoo config names, found as promptfoo finds them, and the notes reading a config prints.

A ``file://`` reference is relative to the config that holds it (missing is exit 2 naming the file and line),
a glob matches as promptfoo's globSync (``**`` any depth), a reference fetched over the network is refused
(evidence must not depend on what a server returns today), and a warning goes to stderr once per place and
message. These helpers serve the prompts and the tests alike.
"""

from __future__ import annotations

import glob as globbing
import re
import sys
from pathlib import Path

from ...errors import GatekeeperError

SCRIPT_SUFFIXES = (".js", ".cjs", ".mjs", ".ts", ".cts", ".mts", ".py", ".rb", ".go", ".sh", ".bash", ".exe", ".bat",
                   ".cmd", ".ps1", ".pl")
REMOTE = re.compile(r"^(https?|huggingface|hf|az|s3|gs)://", re.I)
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


def _line(path: Path, needle: str) -> int | None:
    """The line of ``path`` where ``needle`` first appears, for messages about parsed values."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    at = text.find(needle)
    return text.count("\n", 0, at) + 1 if at >= 0 else None


def _at(path: Path, needle: str) -> str:
    line = _line(path, needle)
    return f"{path}" + (f", line {line}" if line else "")


def _file(ref: str, base: Path, within: Path) -> Path:
    """A ``file://`` reference relative to the config that holds it; missing is exit 2 naming where."""
    path = (base / ref.removeprefix("file://")).resolve()
    if not path.is_file():
        raise GatekeeperError(f"{_at(within, ref)}: {ref} not found (relative to {base}); fix the path")
    return path


def _remote(ref: str, within: Path, field: str, fix: str) -> None:
    if REMOTE.match(ref):
        raise GatekeeperError(f"{_at(within, ref)}: field '{field}': {ref} is fetched over the network, which gatekeeper "
                              f"does not do (evidence must not depend on what a server returns today); {fix}")
