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


def read(root: Path) -> dict[str, Any] | None:
    """The workspace's recipe, or None when it has none."""
    path = root / FILE
    if not path.exists():
        return None
    try:
        recipe = json.loads(path.read_text())
    except ValueError as e:
        raise GatekeeperError(f"{path}: not valid JSON ({e}); rewrite it with: gatekeeper pin") from None
    if not isinstance(recipe, dict) or recipe.get("version") != VERSION or not isinstance(recipe.get("stages"), dict):
        raise GatekeeperError(f"{path}: not a version {VERSION} recipe (field 'version' or 'stages'); "
                              "rewrite it with: gatekeeper pin")
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
