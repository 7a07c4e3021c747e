"""The pipeline in force: what the ledger's flag states mean for how prompts render, which engine
profile runs with which weights, and the pipeline-version hash over all of it.

Three flags are built in: ``prefix_cache`` turns the engine's prefix cache on, ``static_first``
renders prompts partitioned instead of as written (in a workspace that governs the partition, i.e.
has its policy; one without renders partitioned), and ``adapter`` installs the LoRA adapter its
evaluation approved, by content digest. Every other flag declares its ``change`` in its policy;
a flag that is on applies the change its evaluation approved, in flag-name order, and two flags
that change one profile field are refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from ...battery import partition
from ...battery.suites import all_suites
from ...errors import GatekeeperError
from ...identity import directory_digest, pipeline_hash, pipeline_parts
from ...workspace import Change, EngineProfile, Workspace
from . import flags, switches
from .switches import InForce


def in_force(ws: Workspace, ledger, forced: Mapping[str, str] | None = None) -> InForce:
    """Flag states from the ledger (``forced`` overrides some), and what they mean."""
    recorded = flags.states(ws, ledger)
    states: dict[str, str] = {flag: s["state"] for flag, s in recorded.items()}
    for flag, state in (forced or {}).items():
        if flag not in states:
            raise GatekeeperError(f"unknown flag {flag!r}; flags with a policy in {ws.root / 'policies'}: "
                                  f"{', '.join(states) or 'none'}")
        if state not in ("on", "off"):
            raise GatekeeperError(f"flag {flag}: state must be 'on' or 'off', not {state!r}")
        states[flag] = state
    render: partition.Mode = "as_written" if states.get(switches.StaticFirst.name) == "off" else "partitioned"
    adapter = None
    if states.get(switches.Adapter.name) == "on":
        evaluation_id = recorded[switches.Adapter.name]["evaluation_id"]
        if recorded[switches.Adapter.name]["state"] != "on" or evaluation_id is None:
            raise GatekeeperError("the adapter flag can be forced off, not on: it installs the adapter its flip approved")
        candidate = ledger.evaluation(evaluation_id)["config"]["candidate"]
        adapter = {**candidate, "evaluation_id": evaluation_id}
    changes = {}
    for flag in sorted(states):
        policy = ws.policies[flag]
        if states[flag] != "on" or policy.change is None:
            continue
        # Recorded on: what its evaluation approved (an edited policy does not change a running
        # pipeline; its evidence reads stale instead). Forced on: the policy's change as written.
        eid = recorded[flag]["evaluation_id"] if recorded[flag]["state"] == "on" else None
        approved = ledger.evaluation(eid)["config"].get("change") if eid is not None else None
        changes[flag] = Change.model_validate(approved) if approved else policy.change
    return InForce(states, render, adapter, changes)


def engine_profile(ws: Workspace, name: str, force: InForce) -> EngineProfile:
    """The engine profile in force: declared changes applied, the installed adapter checked
    against its approved digest."""
    profile = switches.apply(ws, ws.engine(name), force.changes)
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
    decoding = {s.stage: s.decoding.model_dump(mode="json") for s in sorted(all_suites(ws).values(), key=lambda s: s.stage)}
    # A declared flag that is on enters with the change it applies, not only its state.
    states: dict[str, Any] = {  # flag -> its state, or its state and change
        f: ({"state": s, "change": force.changes[f].model_dump(mode="json", exclude_none=True)} if f in force.changes else s)
        for f, s in force.states.items()}
    parts = pipeline_parts(states, engine_identity, force.render, decoding)
    return parts, pipeline_hash(parts, flags.hash_parts(ws))
