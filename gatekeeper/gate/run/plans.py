"""An evaluation's plan: its two configurations (the engine profile, the prefix cache, how prompts render),
the battery, the gate kind and the order of its runs, validated before the ledger is touched."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...battery import partition
from ...battery import suites as battery
from ...workspace import EngineProfile, Load, Policy, Workspace
from .. import kinds
from ..stats.sequential import Budget
from . import graders as graders_

ALONE = "alone"  # under a load: the flag-off battery run alone, one case at a time


@dataclass
class Config:
    """One side of the comparison: the engine profile, the prefix cache, how prompts render."""

    profile: EngineProfile
    cache: bool
    render: partition.Mode


@dataclass(kw_only=True)
class Plan:
    """An evaluation, fully validated before the ledger is touched."""

    ws: Workspace
    flag: str
    policy: Policy
    items: list[battery.Item]
    engine_name: str
    battery_digest: str
    configs: dict[str, Config]  # "off" and "on"
    kind: kinds.GateKind
    exercises_cache: bool  # the flag turns the prefix cache on
    candidate: dict[str, str] | None = None  # adapter: the candidate's path and content digest
    config: dict[str, Any] = field(default_factory=dict)
    load: Load | None = None  # served engines: the production load both sides run under
    captured: list[list[int] | str] | None = None  # a capture load's prompts
    grading: graders_.Spec | None = None  # model-graded and similar assertions: what grades them (None: nothing to)
    sequential: Budget | None = None  # evaluate --max-cases/--max-seconds: case by case until decided (stats/sequential.py)

    @property
    def schedule(self) -> list[tuple[str, int]]:
        """The runs, in order: under a load, the battery alone first (the reference batching is judged by)."""
        runs = [("off", r) for r in range(self.policy.baseline_repeats)] + [("on", 0)]
        return [(ALONE, 0), *runs] if self.load else runs
