"""``gatekeeper init``: lay out a working workspace from the templates shipped in the package."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from ..errors import GatekeeperError

_FOLDERS = ("engines", "assertions", "policies", "prompts")


def init_workspace(directory: Path) -> list[Path]:
    """Copy the templates into ``directory``; existing files are kept, never overwritten."""
    if directory.exists() and not directory.is_dir():
        raise GatekeeperError(f"{directory}: exists and is not a folder; pick another path")
    templates = files("gatekeeper") / "templates"
    written: list[Path] = []
    for folder in _FOLDERS:
        for item in (templates / folder).iterdir():
            target = directory / folder / item.name
            if target.exists():
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(item.read_text(encoding="utf-8"), encoding="utf-8")
            written.append(target)
    ledger = directory / "ledger"
    ledger.mkdir(parents=True, exist_ok=True)
    if not (ledger / ".gitignore").exists():
        (ledger / ".gitignore").write_text("evidence.db*\n")
        written.append(ledger / ".gitignore")
    return written
