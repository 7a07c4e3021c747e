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

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

from pydantic import ValidationError

from ..battery import partition
from ..battery.load import all_suites
from ..errors import GatekeeperError
from ..identity import directory_digest, pipeline_hash, pipeline_parts
from ..workspace import Change, EngineProfile, Workspace
from . import flags


@dataclass
class InForce:
    states: dict[str, str]  # flag -> on | off
    render: partition.Mode
    adapter: dict[str, Any] | None = None  # the installed candidate: path, digest, evaluation_id
    changes: dict[str, Change] = field(default_factory=dict)  # declared flags that are on -> their change

    @property
    def cache(self) -> bool:
        return self.states.get("prefix_cache") == "on"

    def without(self, flag: str) -> "InForce":
        """The same pipeline with ``flag`` off (the flag-off side of its evaluation; for ``adapter``
        that side is the current weights, so an installed adapter stays)."""
        states = {**self.states, flag: "off"} if flag in self.states else dict(self.states)
        changes = {f: c for f, c in self.changes.items() if f != flag}
        render = "as_written" if flag == "static_first" else self.render
        return replace(self, states=states, render=render, changes=changes)


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


def apply(ws: Workspace, profile: EngineProfile, changes: Mapping[str, Change]) -> EngineProfile:
    """``profile`` with each declared change applied, in flag order: engine migrations first, then
    profile overrides merged in. Two changes of one field are an error naming both flags."""
    claimed: dict[str, str] = {}  # dotted field -> the flag that changes it
    for flag in sorted(changes):
        for path in changes[flag].fields():
            other = next((f for p, f in claimed.items() if p == path or p.startswith(path + ".") or path.startswith(p + ".")), None)
            if other is not None:
                raise GatekeeperError(
                    f"flags {other} and {flag} are both on and both change '{path}' (policies/{other}.yaml, "
                    f"policies/{flag}.yaml); turn one off (gatekeeper flip {flag} off --reason ...) or change distinct fields")
            claimed[path] = flag
    applied = tuple(sorted(changes))
    for flag in applied:
        engine = changes[flag].engine
        if engine is not None:
            profile = ws.engine(engine)
    data = profile.model_dump(mode="json")
    for flag in applied:
        override = changes[flag].profile
        if override is not None:
            data = _merge(data, override)
    if not applied:
        return profile
    try:
        return EngineProfile.model_validate({**data, "name": profile.name, "changed_by": applied})
    except ValidationError as e:
        where = ", ".join(f"policies/{f}.yaml" for f in applied)
        problems = "; ".join(f"{'.'.join(map(str, x['loc'])) or 'profile'}: {x['msg']}" for x in e.errors())
        raise GatekeeperError(f"{where}: field 'change': engines/{profile.name}.yaml with the change is not a valid "
                              f"profile ({problems}); fix the change") from None


def _merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``override`` laid over it; mappings merge key by key (``options``, ``cache``)."""
    out = dict(base)
    for k, v in override.items():
        out[k] = _merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), dict) else v
    return out


def engine_profile(ws: Workspace, name: str, force: InForce) -> EngineProfile:
    """The engine profile in force: declared changes applied, the installed adapter checked
    against its approved digest."""
    profile = apply(ws, ws.engine(name), force.changes)
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
