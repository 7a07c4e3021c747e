"""Calibration: the gate's measured power to say no.

Runs the flag-on configuration of a cache flag with planted faults of graded size and kind
(``engines/faults.py``) and records, for each, the share of cases the gate flags against the
flag-off reference (an evaluation's own flag-off run, ``--evaluation``, or one made here), by
outputs and by drift (``DriftRule``). A zero-size fault must flag nothing; a battery that misses
large faults gives a PASS that means little. A case stops at its first flag (``Watch``), and the
stage prefixes are pinned once for every fault run, so a calibration costs a few flag-on runs. A
served evaluation is calibrated through its twin (``twin.py``). The record goes into the ledger,
linked to the evaluation, where a policy's ``min_power`` looks for it before a flip.
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from ...engines.faults import Fault, graded
from ...engines.registry import check_profile
from ...errors import GatekeeperError
from ...evidence import CaseResult, EvaluationRecord, Run
from ...summaries import CalibrationSummary, DriftRuleRecord, FaultRow, TwinRecord
from ...workspace import Workspace
from .. import kinds, planning
from ..enable import current
from ..run import graders as graders_
from ..run import runs
from ..run.plans import Plan
from . import twin


@dataclass
class Calibration:
    calibration_id: int | None
    flag: str
    evaluation_id: int | None
    engine: str
    cases: int
    faults: list[FaultRow]  # per fault: spec, kind, size, flagged, share, cached tokens, seconds
    seconds: dict[str, float]  # reference run, faults, cost per flag-on run
    drift_rule: DriftRuleRecord  # when a fault counts as flagged by drift (DriftRule)
    mode: str = "full"  # early: each case of a fault run stopped at its first flag; full: every case decoded whole
    twin: TwinRecord | None = None  # measured on a served evaluation's twin (twin.check): its weights and theirs

    def to_dict(self) -> CalibrationSummary:
        return CalibrationSummary(calibration_id=self.calibration_id, flag=self.flag, evaluation_id=self.evaluation_id,
                                  engine=self.engine, cases=self.cases, faults=self.faults, seconds=self.seconds,
                                  drift_rule=self.drift_rule, mode=self.mode, twin=self.twin)


def plan(ws: Workspace, flag: str, engine: str, suites: list[str] | None, limit: int | None, *, force,
         evaluation: EvaluationRecord | None, ledger, twin: str | None = None, skip_unsupported: bool = False) -> Plan:
    """The evaluation's plan (its engine, suites and limit when one is named), checked to be current; with
    ``twin``, the served evaluation's suites and limit on the twin engine. ``skip_unsupported``: leave out
    promptfoo assertions gatekeeper cannot evaluate (a named evaluation that left them out does too)."""
    if twin is not None and evaluation is None:
        raise GatekeeperError("--twin calibrates a served evaluation through an in-process engine on the same weights: "
                              "add --evaluation ID (the served engine's evaluation)")
    if evaluation is not None:
        if evaluation["flag"] != flag:
            raise GatekeeperError(f"evaluation {evaluation['id']} is for {evaluation['flag']!r}, not {flag!r}")
        config = evaluation["config"]
        engine, suites, limit = twin or config["engine"], config.get("suites"), config.get("limit")
        skip_unsupported = skip_unsupported or config.get("skip_unsupported", False)
        if twin is not None and not evaluation["identity"]["on"]["engine"].get("servers"):
            raise GatekeeperError(f"evaluation {evaluation['id']} ran on an in-process engine ({config['engine']}): "
                                  "calibrate it directly (drop --twin)")
        stale = [p for p in current.evidence_problems(ws, ledger, flag, {**evaluation, "status": "PASS"})
                 if p.startswith("stale:")]
        if stale:
            raise GatekeeperError(f"{stale[0]}; calibrate a current evaluation (gatekeeper evaluate --flag {flag})")
    p = planning.plan(ws, flag, engine, suites, limit, force=force, skip_unsupported=skip_unsupported)
    if not p.exercises_cache:
        raise GatekeeperError(f"calibrate plants faults in the prefix cache's restored states; {flag} does not turn "
                              "the cache on (calibrate --flag prefix_cache)")
    adapter = check_profile(p.configs["on"].profile)
    if not adapter.faults:
        raise GatekeeperError(f"{p.configs['on'].profile.where}: the {adapter.name} adapter cannot plant faults (its cache "
                              "is not in this process, e.g. a server's); calibrate with an in-process engine (torch, "
                              "mlx or llamacpp), or a served evaluation through one on the same weights: "
                              "--evaluation ID --twin ENGINE")
    return p


def twin_of(evaluation: EvaluationRecord, model, name: str) -> TwinRecord:
    """The twin's weights checked against those the served evaluation reported (``twin.check``)."""
    if model.weights is None:
        raise GatekeeperError(f"--twin {name}: a twin loads weights in this process (torch, mlx or llamacpp), not a server's")
    return twin.check(evaluation["identity"]["on"]["engine"], model.weights, name)


def reference(evaluation: EvaluationRecord) -> Run:
    """The evaluation's first flag-off run, case by case."""
    return {r["case_id"]: r["result"] for r in evaluation["case_results"] if r["config"] == "off" and r["repeat"] == 0}


DRIFT_FACTOR = 10  # with no drift bound in the policy: drift above this many times the unfaulted run's at a step


@dataclass(frozen=True)
class DriftRule:
    """When a planted fault counts as flagged by drift: any drift where the policy requires ``bit_exact``,
    drift above its ``max_drift``, else drift above ``DRIFT_FACTOR`` times the unfaulted flag-on run's."""

    kind: str  # bit_exact | max_drift | relative
    value: float

    @classmethod
    def of(cls, policy) -> "DriftRule":
        if policy.require == "bit_exact":
            return cls("bit_exact", 0.0)
        if policy.max_drift is not None:
            return cls("max_drift", policy.max_drift)
        return cls("relative", DRIFT_FACTOR)

    def exceeded(self, drift: float, unfaulted: float) -> bool:
        if self.kind == "bit_exact":
            return drift > 0
        if self.kind == "max_drift":
            return drift > self.value
        return drift > 0 and drift > self.value * unfaulted

    def describe(self) -> str:
        return {"bit_exact": "any drift (the policy requires bit_exact)",
                "max_drift": f"drift above the policy's max_drift {self.value:g}",
                "relative": f"drift above {self.value:g}x the unfaulted flag-on run's at the same step"}[self.kind]


class Watch:
    """Stops a case of a fault run at its first flag (a flagged case needs no more): a token that departs
    from the reference, or a step whose drift the rule flags (outputs only without a rule). Records which one it was."""

    def __init__(self, ref: CaseResult, unfaulted: dict[tuple[int, int], float], rule: DriftRule | None):
        self.ref, self.unfaulted, self.rule = ref, unfaulted, rule
        self.fired: str | None = None  # outputs | drift

    def turn(self, n: int):
        turns = self.ref["turns"]
        want, top2 = (turns[n]["tokens"], turns[n]["top2"] or []) if n < len(turns) else ([], [])

        def until(tokens: list[int], margins: list | None) -> bool:
            s = len(tokens) - 1
            if s >= len(want) or tokens[s] != want[s]:
                self.fired = "outputs"
            elif self.rule and margins and s < len(top2):
                drift = kinds.step_drift(top2[s], margins[s])
                if drift is not None and self.rule.exceeded(drift, self.unfaulted.get((n + 1, s), 0.0)):
                    self.fired = "drift"
            return self.fired is not None

        return until


def run(p: Plan, models: dict, ref: Run | None,
        progress: Callable[[str], None] = lambda label: None, *, full: bool = False,
        faults: Sequence[Fault] = ()) -> Calibration:
    """Every graded fault (or only ``faults``, after the unfaulted run) on a fresh flag-on session each; a fault
    the adapter cannot plant is listed as such.
    The unfaulted run (noise 0) runs whole; the others stop each case at its first flag unless ``full``."""
    seconds: dict[str, float] = {}
    with contextlib.ExitStack() as stack:
        graders = _graders(p, models, stack)
        if ref is None:
            t0 = time.perf_counter()
            ref = _reference(p, models, progress, graders)
            seconds["reference"] = round(time.perf_counter() - t0, 3)
        layer = stack.enter_context(tempfile.TemporaryDirectory(prefix="gatekeeper-calibration-"))
        # The stage prefixes are pinned once (by the unfaulted run) and loaded by every fault run from
        # this result layer: faults act on what a hit restores, never on the pins themselves.
        early = models["on"].early_stop and not full
        rows = _faults(p, models["on"], ref, progress, early, Path(layer), graders, graded(faults))
    return _summary(p, rows, seconds, early)


def reference_run(p: Plan, models: dict, progress: Callable[[str], None] = lambda label: None) -> Run:
    """The flag-off run ``run`` compares its fault runs with when it is given none, made alone (so that one decode can
    serve several readers, e.g. mining's fault probes)."""
    with contextlib.ExitStack() as stack:
        return _reference(p, models, progress, _graders(p, models, stack))


def _graders(p: Plan, models: dict, stack: contextlib.ExitStack):
    # model-graded assertions are graded as evaluate grades them, so outcomes compare with a recorded reference
    graders = graders_.open(p.grading, p.ws.root, models.values())
    if graders is not None:
        stack.enter_context(graders)
    return graders


def _reference(p: Plan, models: dict, progress: Callable[[str], None], graders) -> Run:
    off = p.configs["off"]
    return _run(models["off"].session(cache=off.cache), p, off.render, "reference", progress, graders=graders)


def _faults(p: Plan, model, ref: Run, progress, early: bool, layer: Path,
            graders, faults: list[Fault]) -> list[FaultRow]:
    on = p.configs["on"]
    rows: list[FaultRow] = []
    rule = DriftRule.of(p.policy)
    unfaulted: dict[str, dict[tuple[int, int], float]] = {}
    for fault in faults:
        if fault.kind not in model.faults:
            rows.append({**fault.to_dict(), "supported": False})
            continue
        zero = fault.kind == "noise" and fault.size == 0
        watches = {i.case_id: Watch(ref[i.case_id], unfaulted.get(i.case_id, {}), rule)
                   for i in p.items} if early and not zero else {}
        t0 = time.perf_counter()
        results = _run(model.session(cache=True, fault=fault, results=layer), p, on.render, fault.spec, progress, watches,
                       graders)
        elapsed = time.perf_counter() - t0
        if zero:
            unfaulted = {cid: kinds.drifts(ref[cid], r) for cid, r in results.items()}
        by_drift = [cid for cid, r in results.items()
                    if any(rule.exceeded(d, unfaulted.get(cid, {}).get(at, 0.0))
                           for at, d in kinds.drifts(ref[cid], r).items())]
        by_outputs = [cid for cid, r in results.items()
                      if (watches[cid].fired == "outputs" if cid in watches else
                          kinds.token_diff(ref[cid], r, model.detokenize) is not None)]
        flagged = [cid for cid in results if cid in by_outputs or cid in by_drift]
        n = len(results)
        rows.append({**fault.to_dict(), "supported": True, "flagged": len(flagged), "cases": n,
                     "share": round(len(flagged) / n, 4), "flagged_cases": flagged,
                     "by_outputs": len(by_outputs), "share_outputs": round(len(by_outputs) / n, 4),
                     "by_drift": len(by_drift), "share_drift": round(len(by_drift) / n, 4),
                     "stopped_early": sum(w.fired is not None for w in watches.values()),
                     # an engine that plants faults is in process: it reports its cached tokens
                     "cached_tokens": sum(t["cached_tokens"] or 0 for r in results.values() for t in r["turns"]),
                     "seconds": round(elapsed, 3)})
    return rows


def _summary(p: Plan, rows: list[FaultRow], seconds: dict[str, float], early: bool) -> Calibration:
    rule = DriftRule.of(p.policy)
    zero = next((r for r in rows if r["spec"] == "noise:0" and r["supported"]), None)
    if zero is not None and zero["flagged"]:
        raise GatekeeperError(f"calibration: an exact copy of the restored state flagged {zero['flagged']} cases "
                              f"({', '.join(zero['flagged_cases'])}; {zero['by_outputs']} by outputs, {zero['by_drift']} "
                              f"by {rule.describe()}): the unfaulted flag-on run already differs, so no fault size can be "
                              "measured; check the evaluation's baseline and the policy's drift bound")
    timed = [r["seconds"] for r in rows if r["supported"]]
    seconds["faults"] = round(sum(timed), 3)
    if zero is not None and zero["seconds"]:
        seconds["per_flag_on_run"] = round(sum(timed) / zero["seconds"], 2)  # the cost, in flag-on runs
    return Calibration(None, p.flag, None, p.engine_name, len(p.items), rows, seconds,
                       {"kind": rule.kind, "value": rule.value, "rule": rule.describe()},
                       "early" if early else "full")


def _run(session, p: Plan, render, label: str, progress: Callable[[str], None],
         watches: dict[str, Watch] | None = None, graders=None) -> Run:
    with session:
        runs.pin_stage_prefixes(session, p, render)
        out: Run = {}
        for item in p.items:
            progress(f"{label} {item.case_id}")
            out[item.case_id] = runs.run_case(session, p.ws, item, render, (watches or {}).get(item.case_id), graders)
        return out
