"""Calibration: the gate's measured power to say no.

Runs the flag-on configuration of a cache flag with planted faults of graded size and kind
(``engines/faults.py``) and records, for each, the share of cases whose outputs the gate would
have flagged against the flag-off reference: an evaluation's own flag-off run (``--evaluation``),
or one made here. A zero-size fault must flag nothing; a battery that misses large faults gives a
PASS that means little. The record goes into the ledger, linked to the evaluation, where a policy's
``min_power`` looks for it before a flip.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from . import evaluator, flags, kinds
from ..engines.registry import check_profile
from ..engines.faults import graded
from ..errors import GatekeeperError
from ..workspace import Workspace


@dataclass
class Calibration:
    calibration_id: int | None
    flag: str
    evaluation_id: int | None
    engine: str
    cases: int
    faults: list[dict[str, Any]]  # per fault: spec, kind, size, flagged, share, cached tokens, seconds
    seconds: dict[str, float] = field(default_factory=dict)  # reference run, faults, cost per flag-on run

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def plan(ws: Workspace, flag: str, engine: str, suites: list[str] | None, limit: int | None, *, force,
         evaluation: dict[str, Any] | None, ledger) -> evaluator.Plan:
    """The evaluation's plan (its engine, suites and limit when one is named), checked to be current."""
    if evaluation is not None:
        if evaluation["flag"] != flag:
            raise GatekeeperError(f"evaluation {evaluation['id']} is for {evaluation['flag']!r}, not {flag!r}")
        config = evaluation["config"]
        engine, suites, limit = config["engine"], config.get("suites"), config.get("limit")
        stale = [p for p in flags.evidence_problems(ws, flag, {**evaluation, "status": "PASS"},
                                                    lambda ev: evaluator.identity_now(ws, ev, ledger)) if p.startswith("stale:")]
        if stale:
            raise GatekeeperError(f"{stale[0]}; calibrate a current evaluation (gatekeeper evaluate --flag {flag})")
    p = evaluator.plan(ws, flag, engine, suites, limit, force=force)
    if not p.exercises_cache:
        raise GatekeeperError(f"calibrate plants faults in the prefix cache's restored states; {flag} does not turn "
                              "the cache on (calibrate --flag prefix_cache)")
    adapter = check_profile(p.configs["on"].profile)
    if not adapter.faults:
        raise GatekeeperError(f"{p.configs['on'].profile.where}: the {adapter.name} adapter cannot plant faults (its cache "
                              "is not in this process, e.g. a server's); calibrate with an in-process engine: torch, "
                              "mlx or llamacpp")
    return p


def reference(evaluation: dict[str, Any]) -> dict[str, dict]:
    """The evaluation's first flag-off run, case by case."""
    return {r["case_id"]: r["result"] for r in evaluation["case_results"] if r["config"] == "off" and r["repeat"] == 0}


def run(p: evaluator.Plan, models: dict, ref: dict[str, dict] | None,
        progress: Callable[[str], None] = lambda label: None) -> Calibration:
    """Every graded fault on a fresh flag-on session each; a fault the adapter cannot plant is listed as such."""
    seconds: dict[str, float] = {}
    off, on = p.configs["off"], p.configs["on"]
    if ref is None:
        t0 = time.perf_counter()
        ref = _run(models["off"].session(cache=off.cache), p, off.render, "reference", progress)
        seconds["reference"] = round(time.perf_counter() - t0, 3)
    model, rows = models["on"], []
    for fault in graded():
        if fault.kind not in model.faults:
            rows.append({**fault.to_dict(), "supported": False})
            continue
        t0 = time.perf_counter()
        results = _run(model.session(cache=True, fault=fault), p, on.render, fault.spec, progress)
        flagged = [cid for cid, r in results.items() if kinds.token_diff(ref[cid], r, model.detokenize) is not None]
        rows.append({**fault.to_dict(), "supported": True, "flagged": len(flagged), "cases": len(results),
                     "share": round(len(flagged) / len(results), 4), "flagged_cases": flagged,
                     "cached_tokens": sum(t["cached_tokens"] for r in results.values() for t in r["turns"]),
                     "seconds": round(time.perf_counter() - t0, 3)})
    zero = next((r for r in rows if r["spec"] == "noise:0" and r["supported"]), None)
    if zero is not None and zero["flagged"]:
        raise GatekeeperError(f"calibration: an exact copy of the restored state changed {zero['flagged']} cases "
                              f"({', '.join(zero['flagged_cases'])}): the flag-on run is not repeatable, so no fault "
                              "size can be measured; check the evaluation's baseline")
    timed = [r["seconds"] for r in rows if r["supported"]]
    seconds["faults"] = round(sum(timed), 3)
    if zero is not None and zero["seconds"]:
        seconds["per_flag_on_run"] = round(sum(timed) / zero["seconds"], 2)  # the cost, in flag-on runs
    return Calibration(None, p.flag, None, p.engine_name, len(p.items), rows, seconds)


def _run(session, p: evaluator.Plan, render, label: str, progress: Callable[[str], None]) -> dict[str, dict]:
    with session:
        evaluator._pin_stage_prefixes(session, p, render)
        out = {}
        for item in p.items:
            progress(f"{label} {item.case_id}")
            out[item.case_id] = evaluator.run_case(session, p.ws, item, render)
        return out
