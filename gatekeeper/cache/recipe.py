"""The recipe: which stage prefixes are pinned, where each ends and what it holds.

A plain JSON file in the workspace (``recipe.json``), written by ``gatekeeper pin``, that travels
with the pipeline. Per stage: the prefix boundary in tokens, the content hash of those tokens and
the model/adapter digests it was made with. The states themselves live in the result layer on each
machine; a recipe that no longer matches what the workspace renders now says so, stage by stage.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from ..errors import GatekeeperError
from .results import content_hash

FILE = "recipe.json"
VERSION = 1


def entries(prefixes: dict[str, Sequence[int]], identity: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The recipe's per-stage entries for these static prefixes under this engine identity."""
    return {stage: {"boundary": len(tokens), "content_hash": content_hash(tokens),
                    "model_digest": identity.get("model_digest"), "adapter_digest": identity.get("adapter_digest")}
            for stage, tokens in sorted(prefixes.items()) if tokens}


def write(root: Path, prefixes: dict[str, Sequence[int]], identity: dict[str, Any]) -> dict[str, Any]:
    recipe = {"version": VERSION, "engine": identity.get("engine"), "stages": entries(prefixes, identity)}
    (root / FILE).write_text(json.dumps(recipe, indent=2, sort_keys=True) + "\n")
    return recipe


# field -> (what it must be, the check); a stage entry has exactly these
_STAGE_FIELDS = {
    "boundary": ("a non-negative integer", lambda v: type(v) is int and v >= 0),
    "content_hash": ("a string", lambda v: isinstance(v, str)),
    "model_digest": ("a string or null", lambda v: v is None or isinstance(v, str)),
    "adapter_digest": ("a string or null", lambda v: v is None or isinstance(v, str)),
}
_TOP_FIELDS = ("version", "engine", "stages")


def read(root: Path) -> dict[str, Any] | None:
    """The workspace's recipe, or None when it has none; a file that is not one is an error naming the field."""
    path = root / FILE
    if not path.exists():
        return None

    def bad(problem: str) -> GatekeeperError:
        return GatekeeperError(f"{path}: {problem}; rewrite it with: gatekeeper pin")

    try:
        raw = path.read_bytes()
    except OSError as e:
        raise bad(f"cannot be read ({e.strerror or e})") from None
    try:
        recipe = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise bad(f"not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start})") from None
    except RecursionError:
        raise bad("not usable JSON (nested too deeply)") from None
    except ValueError as e:
        raise bad(f"not valid JSON ({e})") from None
    if not isinstance(recipe, dict) or recipe.get("version") != VERSION or not isinstance(recipe.get("stages"), dict):
        raise bad(f"not a version {VERSION} recipe (field 'version' or 'stages')")
    if unknown := sorted(set(recipe) - set(_TOP_FIELDS)):
        raise bad(f"field {unknown[0]!r}: unknown key (a recipe has {', '.join(_TOP_FIELDS)})")
    if recipe.get("engine") is not None and not isinstance(recipe["engine"], str):
        raise bad("field 'engine': not a string")
    for stage, entry in recipe["stages"].items():
        if not isinstance(entry, dict):
            raise bad(f"field 'stages.{stage}': {type(entry).__name__}, not an object "
                      f"{{{', '.join(_STAGE_FIELDS)}}}")
        if unknown := sorted(set(entry) - set(_STAGE_FIELDS)):
            raise bad(f"field 'stages.{stage}.{unknown[0]}': unknown key (a stage has {', '.join(_STAGE_FIELDS)})")
        for name, (want, ok) in _STAGE_FIELDS.items():
            if name not in entry:
                raise bad(f"field 'stages.{stage}.{name}': missing")
            if not ok(entry[name]):
                raise bad(f"field 'stages.{stage}.{name}': {entry[name]!r:.40} is not {want}")
    return recipe


def stale(recipe: dict[str, Any], prefixes: dict[str, Sequence[int]], identity: dict[str, Any]) -> dict[str, str]:
    """Stage -> what no longer matches (boundary, content, model, adapter, or not pinned); empty if current."""
    now = entries(prefixes, identity)
    problems = {}
    for stage in sorted(set(recipe["stages"]) | set(now)):
        old, new = recipe["stages"].get(stage), now.get(stage)
        if old is None or new is None:
            problems[stage] = "not in the recipe" if old is None else "no static prefix now"
            continue
        changed = [field for field in ("boundary", "content_hash", "model_digest", "adapter_digest")
                   if old.get(field) != new[field]]
        if changed:
            problems[stage] = ", ".join(changed) + " changed"
    return problems
