"""Flag states and the power of their evidence, derived from the ledger alone: each flag's state (its latest
flip, else off), the parts its pipeline-version hash covers, and whether an evaluation's calibrations show
the detection power a policy wants. The acts that change a state are ``enable/flip.py``; whether evidence is
current is ``enable/current.py``.
"""

from __future__ import annotations

from typing import Literal, Sequence, TypedDict

from ...shadows import LiveEvidence
from ...summaries import Calibrated, CalibrationSummary
from ...workspace import HASH_PARTS, MinPower, Workspace


class FlagState(TypedDict):
    """A flag's state: its latest flip (the evaluation it enabled, who flipped it, when), else off."""

    state: Literal["on", "off"]
    evaluation_id: int | None
    operator: str | None
    since: str | None


class StatusRow(FlagState):
    """A flag as ``gatekeeper status`` reports it: its state, whether the evidence in force is current, and what the
    guard compared since the flip it watched."""

    flag: str
    evidence_current: bool | None
    evidence_problems: list[str]
    currency_error: str | None
    live: LiveEvidence | None  # gate.guard.live's record, as gate.guard.line reads it


def states(ws: Workspace, ledger) -> dict[str, FlagState]:
    """Every policy's flag with its state: the latest flip, else the policy's default (off)."""
    flips = ledger.flag_states() if ledger else {}
    out: dict[str, FlagState] = {}
    for flag in ws.policies:
        last = flips.get(flag)
        out[flag] = {"state": last["state"], "evaluation_id": last.get("evaluation_id"), "operator": last["operator"],
                     "since": last["at"]} if last else {"state": "off", "evaluation_id": None, "operator": None, "since": None}
    return out


def hash_parts(ws: Workspace) -> list[str]:
    """The union of every policy's ``hash_parts``, in canonical order."""
    wanted = {p for policy in ws.policies.values() for p in policy.hash_parts}
    return [p for p in HASH_PARTS if p in wanted]


def power_problems(min_power: MinPower, flag: str, evaluation_id: int, calibrations: Sequence[Calibrated]) -> list[str]:
    """Why no calibration of this evaluation shows the power the policy wants; empty when one does."""
    if not calibrations:
        return [f"underpowered: evaluation {evaluation_id} has no calibration; the policy wants planted noise of "
                f"{min_power.noise:g} flagged in {min_power.share:.0%} of cases: run gatekeeper calibrate "
                f"--flag {flag} --evaluation {evaluation_id}"]
    best = max(detected(c["result"], min_power.noise) for c in calibrations)
    if best < min_power.share:
        return [f"underpowered: the calibrations of evaluation {evaluation_id} flag planted noise of "
                f"{min_power.noise:g} in at most {best:.0%} of cases; the policy wants {min_power.share:.0%}"]
    return []


def detected(result: CalibrationSummary, noise: float) -> float:
    """The share flagged at the largest planted noise no bigger than ``noise`` (0 if none was planted)."""
    rows = [r for r in result["faults"] if r["kind"] == "noise" and r.get("supported") and 0 < r["size"] <= noise * (1 + 1e-9)]
    return max(rows, key=lambda r: r["size"])["share"] if rows else 0.0
