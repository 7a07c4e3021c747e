"""The pipeline in force: what the ledger's flag states mean for how prompts render and which
weights run, and the pipeline-version hash over all of it.

Three flags change the pipeline itself: ``prefix_cache`` turns the engine's prefix cache on,
``static_first`` renders prompts partitioned instead of as written (in a workspace that governs
the partition, i.e. has its policy; one without renders partitioned), and ``adapter`` installs the
LoRA adapter its evaluation approved, by content digest.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from . import flags, partition
from .errors import GatekeeperError
from .identity import directory_digest, pipeline_hash, pipeline_parts
from .workspace import EngineProfile, Workspace


@dataclass
class InForce:
    states: dict[str, str]  # flag -> on | off
    render: partition.Mode
    adapter: dict[str, Any] | None = None  # the installed candidate: path, digest, evaluation_id


def in_force(ws: Workspace, ledger, forced: Mapping[str, str] | None = None) -> InForce:
    """Flag states from the ledger (``forced`` overrides some), and what they mean."""
    recorded = flags.states(ws, ledger)
    states = {flag: s["state"] for flag, s in recorded.items()}
    for flag, state in (forced or {}).items():
        if flag not in states:
            raise GatekeeperError(f"unknown flag {flag!r}; flags with a policy in {ws.root / 'policies'}: "
                                  f"{', '.join(states) or 'none'}")
        if state not in ("on", "off"):
            raise GatekeeperError(f"flag {flag}: state must be 'on' or 'off', not {state!r}")
        states[flag] = state
    render: partition.Mode = "as_written" if states.get("static_first") == "off" else "partitioned"
    adapter = None
    if states.get("adapter") == "on":
        evaluation_id = recorded["adapter"]["evaluation_id"]
        if recorded["adapter"]["state"] != "on" or evaluation_id is None:
            raise GatekeeperError("the adapter flag can be forced off, not on: it installs the adapter its flip approved")
        candidate = ledger.evaluation(evaluation_id)["config"]["candidate"]
        adapter = {**candidate, "evaluation_id": evaluation_id}
    return InForce(states, render, adapter)


def engine_profile(ws: Workspace, name: str, force: InForce) -> EngineProfile:
    """The engine profile with the installed adapter, if any, checked against its approved digest."""
    profile = ws.engine(name)
    if force.adapter is None:
        return profile
    path = Path(force.adapter["path"])
    now = directory_digest(path) if path.is_dir() else None
    if now != force.adapter["digest"]:
        raise GatekeeperError(
            f"adapter: evaluation {force.adapter['evaluation_id']} approved {path} with digest "
            f"{force.adapter['digest'][:16]}…, but it {'now has digest ' + now[:16] + '…' if now else 'is gone'}; "
            "evaluate the new adapter and flip again, or run: gatekeeper flip adapter off --reason ...")
    return profile.model_copy(update={"adapter_path": str(path)})


def version(ws: Workspace, force: InForce, engine_identity: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The pipeline-version hash's parts and the hash over those the policies name."""
    decoding = {s.stage: s.decoding.model_dump(mode="json") for s in sorted(ws.suites.values(), key=lambda s: s.stage)}
    parts = pipeline_parts(force.states, engine_identity, force.render, decoding)
    return parts, pipeline_hash(parts, flags.hash_parts(ws))
