"""The flags as a team deciding a flip needs them: each flag's state and the evidence in force, what is stale and
why, what a flip still needs (a passing evaluation, approvals, power, age) and the exact commands to run. Signing
stays in the terminal: the page only says what to type.
"""

from __future__ import annotations

import shlex
from typing import Mapping

from ..engines.registry import identity
from ..errors import GatekeeperError
from ..gate import guard
from ..gate.enable import current
from ..gate.enable.flip import approvers_since_last_flip
from ..gate.state import flags as flag_states
from ..gate.state import pipeline
from ..gate.state.flags import FlagState
from ..summaries import NotRequired, TypedDict  # typing's, or typing_extensions' before 3.11
from ..workspace import Workspace


class Approvals(TypedDict):
    """The approvals a flip of the flag has and needs, and by whom."""

    recorded: int
    required: int
    signed: bool
    by: NotRequired[list[str]]  # absent while no evaluation of the flag has passed


class NextFlip(TypedDict):
    """What turning a flag on (again) needs now, and the commands that do it."""

    evaluation_id: int | None  # its newest passing evaluation
    needs: list[str]
    approvals: Approvals
    commands: list[str]


class FlagRow(FlagState):
    """A flag as the flags page shows it: its state, the evidence in force, what a flip still needs."""

    flag: str
    description: str
    gate: str
    pipeline_hash: str | None
    pipeline_hash_error: str | None
    evidence_problems: list[str]
    evidence_current: bool | None
    currency_error: str | None
    next: NextFlip | None
    live: Mapping[str, object] | None  # gate.guard.live: what the guard compared since the flip it watched
    safely_on: bool


def flags_view(ws: Workspace, ledger, engine: str, trusted: bool) -> list[FlagRow]:
    """One row per policy. ``ledger``: None while nothing was recorded. ``trusted``: the ledger verified; a flag is
    shown as safely on only then."""
    states = flag_states.states(ws, ledger)
    force = pipeline.in_force(ws, ledger)
    try:
        _, pipeline_hash = pipeline.version(ws, force, identity(pipeline.engine_profile(ws, engine, force),
                                                                workspace_root=ws.root))
        hash_error = None
    except GatekeeperError as e:
        pipeline_hash, hash_error = None, str(e)
    rows: list[FlagRow] = []
    for flag, st in states.items():
        policy = ws.policy(flag)
        row: FlagRow = {"flag": flag, **st, "description": policy.description, "gate": policy.gate,
                        "pipeline_hash": pipeline_hash, "pipeline_hash_error": hash_error,
                        "evidence_problems": [], "evidence_current": None, "currency_error": None, "next": None,
                        # what the guard compared since the flip it watched: the ledger's alone
                        "live": guard.live(ledger, flag), "safely_on": False}
        try:  # currency asks the engines what they are now: an engine that cannot be reached is said beside the facts
            if st["state"] == "on" and st["evaluation_id"] is not None:
                problems = current.evidence_problems(ws, ledger, flag, ledger.evaluation(st["evaluation_id"]))
                row["evidence_problems"], row["evidence_current"] = problems, not problems
            if st["state"] == "off" or row["evidence_current"] is False:
                row["next"] = _next_flip(ws, ledger, flag)
        except GatekeeperError as e:
            row["currency_error"] = str(e)
        row["safely_on"] = (st["state"] == "on" and trusted and row["evidence_current"] is not False
                           and row["currency_error"] is None)
        rows.append(row)
    return rows


def _next_flip(ws: Workspace, ledger, flag: str) -> NextFlip:
    """What turning ``flag`` on (again) needs now, from its newest passing evaluation, and the commands that do it."""
    policy = ws.policy(flag)
    approvals = policy.approvals
    newest = _newest_pass(ledger, flag) if ledger is not None else None
    sign = " --sign KEY" if approvals.signed else ""
    where = f"--workspace {shlex.quote(str(ws.root))} "
    if newest is None:
        return {"evaluation_id": None, "needs": [f"a passing evaluation: none of {flag} has passed yet"],
                "approvals": {"recorded": 0, "required": approvals.required, "signed": approvals.signed},
                "commands": [f"gatekeeper {where}evaluate --flag {flag}"]}
    record = ledger.evaluation(newest)
    needs = current.evidence_problems(ws, ledger, flag, record)
    approvers = approvers_since_last_flip(ledger, flag, newest, signed_only=approvals.signed)
    commands = []
    if any(p.startswith(("stale:", "expired:")) for p in needs):
        commands.append(f"gatekeeper {where}evaluate --flag {flag}")
    elif any(p.startswith("underpowered:") for p in needs):
        commands.append(f"gatekeeper {where}calibrate --flag {flag} --evaluation {newest}")
    if not needs:
        left = approvals.required - len(approvers)
        needs = [f"{left} more approval{'s' if left != 1 else ''} by distinct operators"
                 + (" (signed)" if approvals.signed else "")
                 + ("" if approvals.evaluator_may_approve else f", not {record['operator']} who ran it")] if left > 0 else []
        commands += [f"gatekeeper {where}flip {flag} on --evaluation {newest} --operator NAME --reason 'WHY'{sign}",
                     f"gatekeeper {where}ledger attest {newest} --sign KEY --output {flag}-{newest}.intoto.json"]
    return {"evaluation_id": newest, "needs": needs, "commands": commands,
            "approvals": {"recorded": len(approvers), "required": approvals.required, "signed": approvals.signed,
                          "by": sorted(approvers)}}


def _newest_pass(ledger, flag: str) -> int | None:
    from sqlalchemy import text

    from ..ledger.database import read

    with read(ledger.engine) as conn:
        return conn.execute(text(
            "SELECT e.id FROM evaluation e JOIN verdict v ON v.evaluation_id = e.id WHERE e.flag = :f AND "
            "v.verdict = 'PASS' ORDER BY e.id DESC LIMIT 1"), {"f": flag}).scalar()
