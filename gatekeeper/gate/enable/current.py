"""Whether an evaluation is still evidence for its flag now: a PASS, younger than the policy allows, whose
flag-off identity is still the identity that configuration has today (recomputed from the workspace and the
pipeline in force), with the detection power the policy wants, that holds at the alpha its look at the change was
allotted and that no later FAIL of the same change contradicts (``looks``). ``status``, ``flip``, ``calibrate`` and
the OpenFeature resolver ask this module.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any

from ...evidence import EvaluationRecord
from ...identity import canonical_json
from ...workspace import Workspace
from .. import planning
from ..run import graders as graders_
from ..run import production
from ..state import flags, pipeline
from ..stats import looks


def _age_hours(iso: str, now: datetime) -> float:
    stamp = datetime.fromisoformat(iso.replace("Z", "+00:00"))
    return (now - stamp).total_seconds() / 3600


def evidence_problems(ws: Workspace, ledger, flag: str, evaluation: EvaluationRecord | None,
                      now: datetime | None = None) -> list[str]:
    """Why this evaluation cannot (or can no longer) justify turning ``flag`` on; empty when it can."""
    if evaluation is None:
        return ["no_evaluation: no such evaluation; name a passing one with --evaluation ID (see 'gatekeeper ledger list')"]
    eid = evaluation["id"]
    if evaluation["flag"] != flag:
        return [f"wrong_flag: evaluation {eid} is for {evaluation['flag']!r}, not {flag!r}"]
    if evaluation["status"] != "PASS":
        return [f"not_passed: evaluation {eid} is {evaluation['status']}; only PASS enables a flip"]
    problems = []
    policy = ws.policy(flag)
    verdict = evaluation["verdict_record"]
    assert verdict is not None  # a PASS has its verdict record
    age = _age_hours(verdict["finished_at"], now or datetime.now(timezone.utc))
    if age > policy.approvals.max_age_hours:
        problems.append(f"expired: evaluation {eid} is {age:.1f} h old; the policy accepts {policy.approvals.max_age_hours:g} h")
    now_json = json.loads(canonical_json(identity_now(ws, evaluation, ledger)))  # compare as stored: plain JSON types
    if evaluation["identity"]["off"] != now_json and (diff := _diff(evaluation["identity"]["off"], now_json)):
        # each kind of change holds its paths (a dict, a list or an ordered set: keys added or removed) or one path
        changed = sorted({path for paths in diff.to_dict().values() for path in ([paths] if isinstance(paths, str) else paths)})
        problems.append(f"stale: the configuration changed since evaluation {eid}: {', '.join(map(str, changed))}")
    if policy.min_power is not None:
        problems += flags.power_problems(policy.min_power, flag, eid, evaluation.get("calibrations") or [])
    # the change's whole history, not its best run: the alpha this look was allotted, and no FAIL after it
    problems += looks.problems(ledger.history(flag), eid)
    return problems


def identity_now(ws: Workspace, evaluation: EvaluationRecord, ledger) -> dict[str, Any]:
    """The flag-off identity that ``evaluation``'s configuration (engine, suites, limit, candidate)
    has today, with the pipeline in force as the ledger says, the evaluated flag taken as off. Asked for
    every flag (``status``, ``flip``): the battery is read once per workspace object (``planning.read_battery``)."""
    from ...engines import registry

    config = evaluation["config"]
    force = pipeline.in_force(ws, ledger, {evaluation["flag"]: "off"})
    candidate = (config.get("candidate") or {}).get("path")
    # the load in force is the policy's: evidence gathered under another (evaluate --load) reads stale
    p = planning.plan(ws, evaluation["flag"], config["engine"], config.get("suites"), config.get("limit"),
                      force=force, candidate=candidate, skip_unsupported=config.get("skip_unsupported", False),
                      load=production.in_force(ws, evaluation["flag"]))
    grader = graders_.identity(p.grading, ws.root) if p.grading else None  # a changed grader reads stale
    return planning.identity(p, "off", registry.identity(p.configs["off"].profile, workspace_root=ws.root), grader)


def _diff(a: Any, b: Any):
    from deepdiff import DeepDiff  # only when something changed: the import costs status and flip 0.15 s

    return DeepDiff(a, b, ignore_order=True)


