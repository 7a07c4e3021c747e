"""An evaluation's plan, made and checked before anything loads: the flag's two configurations from the pipeline in
force (``state/``), the battery read once per workspace object (``read_battery``), the gate kind and its options,
each side's server and the reference arm's checked (``run/sides.py``, ``arms/independent.py``), and what identifies
each configuration's outputs (``identity``). The orchestrator (``evaluator.py``) runs a plan; calibration, mining,
sizing and ``current`` make or read one without it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any
from weakref import WeakKeyDictionary

from ..battery import suites as battery
from ..engines.base import Engine
from ..errors import GatekeeperError
from ..identity import digest
from ..workspace import EngineProfile, Load, Workspace
from . import kinds
from .arms import independent
from .run import graders as graders_
from .run import production, sides
from .run.plans import Plan
from .state import pipeline, switches
from .stats import sequential

SEQUENTIAL = "--sequential, --max-cases, --max-seconds"  # the options of a sequential evaluation, as errors name them


def plan(ws: Workspace, flag: str, engine: str = "auto", suites: list[str] | None = None,
         limit: int | None = None, *, force: switches.InForce, candidate: str | Path | None = None,
         skip_unsupported: bool = False, load: Load | None = None, captured: list[list[int] | str] | None = None,
         grading: bool = True, budget: sequential.Budget | None = None) -> Plan:
    """``force``: the pipeline in force (flag states from the ledger); the flag-off side is it with
    the evaluated flag off, the flag-on side is that with the flag's change. ``load``: the production
    load (``load.in_force``), ``captured`` its capture's prompts. ``budget``: a sequential evaluation, case by
    case until the rule decides or the budget is spent (``evaluator._run_sequential``)."""
    from ..engines.registry import check_profile

    policy, switch = ws.policy(flag), switches.of(flag)
    rest = switch.without(force)
    base = pipeline.engine_profile(ws, engine, rest)  # validates the profile before anything is loaded
    cand = switch.candidate(candidate)
    configs = switch.configs(ws, engine, rest, base, cand)
    for c in configs.values():
        cls = check_profile(c.profile)  # an override the adapter does not understand: exit 2 before loading
        if load is not None:
            _check_loadable(cls, c.profile, load)
    items, digest_ = read_battery(ws, suites, limit, skip_unsupported)
    # graded assertions and no grader named: exit 2 before loading (``grading`` False: the caller grades nothing)
    grader_spec = graders_.spec(ws, policy, items) if grading else None
    if unknown := sorted(set(policy.margins) - {i.suite.suite for i in items}):
        raise GatekeeperError(f"policies/{flag}.yaml: field 'margins' names suites this battery does not run "
                              f"({', '.join(unknown)}); name suites of assertions/ or drop them")
    change = policy.change.model_dump(mode="json", exclude_none=True) if policy.change else None
    p = Plan(ws=ws, flag=flag, policy=policy, items=items, engine_name=engine, battery_digest=digest_, configs=configs,
             kind=kinds.KINDS[policy.gate](policy, switch.labels), exercises_cache=switch.exercises_cache,
             candidate=cand, load=load, captured=captured, grading=grader_spec, sequential=budget,
             config={"engine": engine, "suites": suites, "limit": limit,
                     "render": {k: c.render for k, c in configs.items()}, "candidate": cand, "change": change,
                     **({"skip_unsupported": True} if skip_unsupported else {}),
                     **({"load": production.identity(ws, load, digest_)} if load else {}),
                     **({"sequential": dataclasses.asdict(budget)} if budget else {})})
    independent.check(p)
    sides.check(p)  # each side reaches the server the flag says, or exit 2 before anything runs
    if budget is not None:
        _check_sequential(p, budget)
    return p


def _check_sequential(p: Plan, budget: sequential.Budget) -> None:
    """Exit 2 before anything runs unless a sequential rule can judge this flag within this budget."""
    policy, where = p.policy, f"policies/{p.flag}.yaml"
    if budget.max_cases is not None and budget.max_cases < 1:
        raise GatekeeperError(f"--max-cases {budget.max_cases}: the budget is a number of cases, at least 1")
    if budget.max_seconds is not None and not budget.max_seconds > 0:
        raise GatekeeperError(f"--max-seconds {budget.max_seconds:g}: the budget is seconds of running cases, above 0")
    if budget.seed < 0:
        raise GatekeeperError(f"--seed {budget.seed}: a seed is a whole number, 0 or more")
    if policy.gate == "byte_equivalence":
        raise GatekeeperError(f"{SEQUENTIAL}: {where} gates {p.flag} by byte_equivalence, which needs every case identical, "
                              "so there is no loss to bound and nothing to stop early on; run the whole battery without them")
    if policy.margin == 0:
        asks = ("identical assertion outcomes" if policy.gate == "assertion_equivalence"
                else "improvements that outweigh every loss")
        raise GatekeeperError(f"{SEQUENTIAL}: {where} has margin 0 ({policy.gate}), which asks for {asks}; a sequential "
                              "rule bounds a loss against a margin above 0: set field 'margin' above 0, or run the whole "
                              "battery without them")
    if policy.margins:
        raise GatekeeperError(f"{SEQUENTIAL}: {where} field 'margins' judges each suite on its own pairs (Bonferroni); "
                              "the sequential rule judges one margin over the battery: remove 'margins' or run without them")
    if p.load is not None:
        raise GatekeeperError(f"{SEQUENTIAL}: under a load the flag-off battery runs alone first and each run keeps "
                              "background traffic beside it, which a case-by-case run cannot keep apart; drop the load "
                              "(evaluate --load, the policy's 'load') or run without them")
    if p.ws.engine(p.engine_name).executor == "ray":
        raise GatekeeperError(f"{SEQUENTIAL}: executor: ray runs each side's battery on its actors in one go; "
                              "evaluate in this process (a profile without 'executor: ray') or run without them")


# Workspace object -> (suites, limit, skip_unsupported) -> the battery's items and digest. A workspace object
# reads its files once (the OpenFeature resolver opens a new one per resolution), so neither can go stale.
_batteries: WeakKeyDictionary[Workspace, dict[tuple[Any, ...], tuple[list[battery.Item], str]]] = WeakKeyDictionary()


def read_battery(ws: Workspace, suites: list[str] | None, limit: int | None,
                 skip_unsupported: bool) -> tuple[list[battery.Item], str]:
    """The battery's items and digest, read once per workspace object and choice of suites."""
    key = (tuple(suites) if suites else None, limit, skip_unsupported)
    memo = _batteries.setdefault(ws, {})
    if key not in memo:
        items = battery.read(ws, suites, limit, skip_unsupported=skip_unsupported)
        memo[key] = items, battery.battery_digest(ws, items)
    return memo[key]


def _check_loadable(cls: type[Engine], profile: EngineProfile, load: Load) -> None:
    """Exit 2 before anything runs unless this engine can be put under ``load``."""
    if cls.background is Engine.background:
        raise GatekeeperError(f"{profile.where}: the {cls.name} adapter runs the model in this process, one request at "
                              "a time: a load (policy 'load', evaluate --load) needs a served engine (adapter http)")
    if load.concurrency <= profile.concurrency:
        raise GatekeeperError(f"load concurrency {load.concurrency} leaves no room for background traffic beside the "
                              f"{profile.concurrency} cases {profile.where} runs at once; raise the load's concurrency")


def identity(p: Plan, config: str, engine_identity: dict[str, Any], grader: dict[str, Any] | None = None) -> dict[str, Any]:
    """What makes one configuration's outputs what they are (and, with graded assertions, their outcomes: the grader)."""
    c = p.configs[config]
    out = {
        "engine": engine_identity,
        "profile": c.profile.model_dump(mode="json"),
        "battery_digest": p.battery_digest,
        "policy_digest": digest(p.policy.model_dump(mode="json")),
        "render": c.render,
        "decoding": {s.suite: s.decoding.model_dump(mode="json") for s in {i.suite.suite: i.suite for i in p.items}.values()},
        "flags": {p.flag: config},
    }
    if sampled := [i.suite.suite for i in p.items if not i.suite.decoding.plain]:
        from ..engines.registry import sampler_chain

        out["sampler"] = {"suites": sorted(set(sampled)), **(sampler_chain(c.profile) or {})}
    served = sides.reaches(c.profile, c.cache)
    if served is not None:  # the server this side's requests go to
        out["reaches"] = served
    if p.candidate is not None:
        out["candidate"] = p.candidate
    if p.load is not None:
        out["load"] = p.config["load"]
    if p.config["change"] is not None:
        out["change"] = p.config["change"]
    if grader is not None:
        out["grader"] = grader
    return out
