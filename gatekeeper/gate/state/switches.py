"""What each flag switches: the three built-in flags and a declared change, each one object that says its
gate kind, how reasons name its two sides, the two configurations it compares, and its effect on the
pipeline in force. ``plans``, ``pipeline`` and the evaluator ask the flag instead of testing its name.

- ``prefix_cache``: the engine's prefix cache, off and on; byte equivalence (the cache must be exercised).
- ``static_first``: prompts rendered as written, then partitioned static-first; assertion equivalence.
- ``adapter``: the current weights, then a candidate LoRA adapter (``--candidate DIR``); non-inferiority.
- any other flag: the pipeline in force without and with the ``change`` its policy declares.

Policies are checked against ``workspace.BUILTIN_FLAGS`` (the gate each built-in flag takes, what it
changes); the objects here take both from that table, so a built-in flag is declared once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Mapping

from pydantic import ValidationError

from ...battery import partition
from ...errors import GatekeeperError
from ...identity import directory_digest
from ...workspace import BUILTIN_FLAGS, Change, EngineProfile, Workspace
from ..run.plans import Config


@dataclass(frozen=True)
class InForce:
    """The pipeline in force: each flag's state and what the states mean (``pipeline.in_force`` reads them)."""

    states: dict[str, str]  # flag -> on | off
    render: partition.Mode
    adapter: dict[str, Any] | None = None  # the installed candidate: path, digest, evaluation_id
    changes: dict[str, Change] = field(default_factory=dict)  # declared flags that are on -> their change

    @property
    def cache(self) -> bool:
        return self.states.get(PrefixCache.name) == "on"

    def without(self, flag: str) -> InForce:
        """The same pipeline with ``flag`` off (the flag-off side of its evaluation)."""
        return of(flag).without(self)


class Switch:
    """A flag's change. The base is a declared change; built-in flags override what differs."""

    name: ClassVar[str] = ""  # a built-in flag's name; "": declared in its policy
    exercises_cache: ClassVar[bool] = False  # the flag turns the prefix cache on: it must be shown to serve

    def __init__(self, flag: str):
        self.flag = flag

    @property
    def labels(self) -> tuple[str, str]:
        """How reasons name the flag-off and flag-on sides."""
        return f"without {self.flag}", f"with {self.flag}"

    def candidate(self, path: str | Path | None) -> dict[str, str] | None:
        """The candidate's path and content digest (only ``adapter`` takes one)."""
        if path is not None:
            raise GatekeeperError(f"--candidate is for the adapter flag (a candidate LoRA, gated by non_inferiority); "
                                  f"{self.flag} does not take one: drop --candidate")
        return None

    def without(self, force: InForce) -> InForce:
        """The pipeline in force with this flag off: its evaluation's flag-off side (for ``adapter``, the
        current weights: an installed adapter stays)."""
        states = {**force.states, self.flag: "off"} if self.flag in force.states else dict(force.states)
        return InForce(states, force.render, force.adapter, {f: c for f, c in force.changes.items() if f != self.flag})

    def configs(self, ws: Workspace, engine: str, rest: InForce, base: EngineProfile,
                candidate: dict[str, str] | None) -> dict[str, Config]:
        """The flag-off and flag-on configurations: ``rest`` (the pipeline in force without this flag, whose
        profile is ``base``), and that with the flag's change."""
        policy = ws.policy(self.flag)
        assert policy.change is not None  # a flag that is not built in declares its change (Policy validates it)
        changed = apply(ws, ws.engine(engine), {**rest.changes, self.flag: policy.change})
        if rest.adapter is not None:
            changed = changed.model_copy(update={"adapter_path": base.adapter_path})
        return {"off": Config(base, rest.cache, rest.render), "on": Config(changed, rest.cache, rest.render)}


class PrefixCache(Switch):
    name = "prefix_cache"
    exercises_cache = True

    @property
    def labels(self) -> tuple[str, str]:
        return "with the flag off", "with the flag on"

    def configs(self, ws: Workspace, engine: str, rest: InForce, base: EngineProfile,
                candidate: dict[str, str] | None) -> dict[str, Config]:
        return {"off": Config(base, False, rest.render), "on": Config(base, True, rest.render)}


class StaticFirst(Switch):
    name = "static_first"

    @property
    def labels(self) -> tuple[str, str]:
        return "as written", "partitioned"

    def without(self, force: InForce) -> InForce:
        off = super().without(force)
        return InForce(off.states, "as_written", off.adapter, off.changes)

    def configs(self, ws: Workspace, engine: str, rest: InForce, base: EngineProfile,
                candidate: dict[str, str] | None) -> dict[str, Config]:
        return {"off": Config(base, False, "as_written"), "on": Config(base, False, "partitioned")}


class Adapter(Switch):
    name = "adapter"

    @property
    def labels(self) -> tuple[str, str]:
        return "with the current weights", "with the candidate"

    def candidate(self, path: str | Path | None) -> dict[str, str] | None:
        if path is None:
            raise GatekeeperError(f"{self.flag} compares the current weights with a candidate LoRA adapter: "
                                  "add --candidate PATH (the adapter directory)")
        resolved = Path(path).expanduser().resolve()
        if not resolved.is_dir():
            raise GatekeeperError(f"--candidate {resolved}: not a directory; point it at a LoRA adapter directory")
        return {"path": str(resolved), "digest": directory_digest(resolved)}

    def configs(self, ws: Workspace, engine: str, rest: InForce, base: EngineProfile,
                candidate: dict[str, str] | None) -> dict[str, Config]:
        assert candidate is not None  # candidate() refused a plan without one
        return {"off": Config(base, False, rest.render),
                "on": Config(base.model_copy(update={"adapter_path": candidate["path"]}), False, rest.render)}


BUILTIN: dict[str, type[Switch]] = {s.name: s for s in (PrefixCache, StaticFirst, Adapter)}
assert set(BUILTIN) == set(BUILTIN_FLAGS), "each flag of workspace.BUILTIN_FLAGS has its Switch"


def of(flag: str) -> Switch:
    """The switch behind ``flag``: a built-in one, or its policy's declared change."""
    return BUILTIN.get(flag, Switch)(flag)


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
