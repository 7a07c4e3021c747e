"""The gate: run the battery under a flag's two configurations, compare, decide, record.

What "off" and "on" are depends on the flag: ``prefix_cache`` turns the engine's cache on,
``static_first`` renders prompts partitioned instead of as written, ``adapter`` installs a
candidate LoRA adapter, and any other flag applies the ``change`` its policy declares to the
pipeline in force. What must hold between them is the policy's gate kind (``kinds.py``). The run
is three steps: run every configuration (a fresh engine session per configuration and repeat),
compare each case, decide.

Everything goes into the ledger as it happens, so an interrupted run leaves an
``aborted`` evaluation and never a verdict.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, TypeVar, cast

from ..battery import partition
from ..battery import suites as battery
from ..engines.base import Engine, plus
from ..errors import described
from ..evidence import CaseResult, Comparison, Run
from ..summaries import (
    DistanceSummary,
    LookSummary,
    NotObservable,
    OutcomeSummary,
    ReferenceSummary,
    SamplingSummary,
    SequentialSummary,
    StageTelemetry,
    Statistics,
    StrengthSummary,
    SuiteCensus,
    Tokens,
)
from . import decide, kinds, planning
from .arms import controls as controls_
from .arms import crashes as crashes_
from .arms import forced
from .arms import probes as probes_
from .arms import reference as reference_
from .run import graders as graders_
from .run import production, sides
from .run import runs as runs_
from .run.plans import ALONE, Config, Plan
from .stats import coupling, distance, looks, paired, pit, sequential, unpaired
from .stats import pairs as pairs_


@dataclass
class Outcome:
    """What ``evaluate`` hands back to the CLI."""

    evaluation_id: int
    flag: str
    verdict: str
    reasons: list[str]
    cases: int
    assertions: int
    differing_cases: list[str]
    equal: dict[str, int]
    tokens: Tokens
    seconds: dict[str, float]
    cacheable_share: dict[str, float]
    exercised_share: float
    passes: dict[str, int]  # assertions passed, flag off (first run) and on
    model_seconds: float
    overhead_seconds: float
    telemetry: dict[str, dict[str, StageTelemetry]]  # per side, per stage
    # byte equivalence: the top-2 logit drift off#0~on#0 (kinds.Strength as a dict), None for other kinds
    strength: StrengthSummary | None = None
    near_ties: dict[str, SuiteCensus] = field(default_factory=dict)  # per suite, the flag-off baseline's
    # the cache probes: per probe, equal | differs | baseline_unstable | crashed | skipped (why); and their seconds
    probes: dict[str, str] = field(default_factory=dict)
    probe_seconds: float = 0.0
    reached: dict[str, list[str]] = field(default_factory=dict)  # served sides: the servers that answered each
    # kinds judged on paired outcomes: flips, the bound on the loss and what the margin needs (gate/stats/paired.py)
    paired: Statistics | None = None
    # teacher-forced: KL(off||on), same top-1, delta-p and the A/A floor (gate/arms/forced.py); or {not_observable}
    distance: DistanceSummary | NotObservable | None = None
    # the reference arm: each arm against a cache-free read of its answers (gate/arms/reference.py); or {not_observable}
    reference: ReferenceSummary | NotObservable | None = None
    # sampled decoding: coupled steps, mismatches and the TV bounds they certify per position class and stage (gate/stats/coupling.py)
    sampling: SamplingSummary | None = None
    # evaluate --max-cases/--max-seconds: the rule, its parameters, its bounds and where it stopped (gate/stats/sequential.py)
    sequential: SequentialSummary | None = None
    # gates judged from a bound: which look at this change the evaluation is and the alpha it spent (gate/stats/looks.py)
    looks: LookSummary | None = None

    def to_dict(self) -> OutcomeSummary:
        return cast(OutcomeSummary, dict(self.__dict__))


class Parted(enum.Enum):
    """Why a case's flag-off runs parted, as far as the figures show: the likeliest cause, typed (its reason says it to
    a person). ``KEYLESS``: a sampled case's same keyed draws gave other tokens, so the draws do not follow their keys
    and the sides are compared by their distributions (``stats/unpaired.py``)."""

    CACHED = "cached"
    COLLAPSE = "collapse"
    WARM_UP = "warm_up"
    KEYLESS = "keyless"
    NEAR_TIE = "near_tie"
    UNKNOWN = "unknown"


KEYLESS = ("sampling: the same keyed draws gave other tokens, so the engine's draws do not follow their keys (its seeds "
           "ignored, or dependent on the batch or on call order)")


def _actors(p: Plan, models: dict[str, Engine]):
    """``executor: ray``: the Ray actors that run the cases (``ray_executor.Actors``); None runs them here.
    Read from the named profile: a declared change in force rebuilds the profile without it."""
    profile = p.ws.engine(p.engine_name)
    if profile.executor != "ray":
        return None
    from .run import ray_executor

    return ray_executor.Actors(p, models, profile)


def _cacheable_share(model: Engine, p: Plan) -> dict[str, float]:
    """Tokens before the first dynamic byte, over all prompt tokens, as written vs partitioned."""
    totals: dict[partition.Mode, list[int]] = {"as_written": [0, 0], "partitioned": [0, 0]}
    for item in p.items:
        values = {**item.case.vars, **(item.case.turns[0] if item.case.turns else {})}
        pieces = partition.pieces(p.ws, item.suite, values)
        for mode in totals:
            r = partition.render(model, pieces, mode)
            totals[mode][0] += r.static_tokens
            totals[mode][1] += len(r.tokens)
    return {m: round(s / t, 4) if t else 0.0 for m, (s, t) in totals.items()}


def identities(models: dict[str, Engine], p: Plan, graders: graders_.Graders | None = None) -> dict[str, Any]:
    grader = graders.identity() if graders else None
    return {config: planning.identity(p, config, models[config].identity(), grader) for config in ("off", "on")}


def evaluate(p: Plan, ledger, models: dict[str, Engine], operator: str,
             progress: Callable[[str], None] = lambda label: None) -> Outcome:
    """Run, compare and decide; every step is appended to the ledger as it happens."""
    t_start = time.perf_counter()
    runs_.check_decoding(p, models)
    shares = _cacheable_share(models["off"], p)
    with contextlib.ExitStack() as stack:
        graders = graders_.open(p.grading, p.ws.root, models.values())  # once per evaluation; None: nothing to grade
        if graders is not None:
            stack.enter_context(graders)
        actors = _actors(p, models)  # executor: ray: started, loaded and checked before anything is written
        evaluation_id = ledger.start_evaluation(p.flag, operator, p.policy.gate, identities(models, p, graders),
                                                {**p.config, "baseline_repeats": p.policy.baseline_repeats,
                                                 "concurrency": {k: m.concurrency for k, m in models.items()},
                                                 **(actors.config if actors else {})})
        try:
            # a gate judged from a bound spends its look's share of alpha (gate/stats/looks.py): its kind judges at that
            look = looks.take(ledger.history(p.flag), evaluation_id, p.policy.gate, p.policy.margin, p.policy.alpha)
            if look is not None:
                p = dataclasses.replace(p, kind=type(p.kind)(p.policy.model_copy(update={"alpha": look.alpha_spent}),
                                                             p.kind.sides))
            runs = (Runs(**actors.run(p, ledger, evaluation_id, progress)) if actors
                    else _run_sequential(p, ledger, models, evaluation_id, progress, graders) if p.sequential
                    else _run(p, ledger, models, evaluation_id, progress, graders))
            if runs.ran is not None:  # sequential: the cases not run are counted nowhere, not even as skipped
                p = dataclasses.replace(p, items=runs.ran)
            moved = _distance(p, models, runs, progress)
            read = _reference(p, models, runs, progress)
            outcome = _decide(p, ledger, models, evaluation_id, runs, shares, time.perf_counter() - t_start, moved, read)
            outcome.looks = look.to_dict() if look is not None else None
        except BaseException as e:  # Ctrl-C, SIGTERM, a crash: the evaluation is aborted, never a verdict
            ledger.abort_evaluation(evaluation_id, f"{type(e).__name__}: {e}".strip(": "))
            raise
    ledger.finish_evaluation(evaluation_id, outcome.verdict, outcome.reasons, outcome.to_dict())
    return outcome


def steps(p: Plan, cases: int) -> int:
    """The progress steps an evaluation of ``cases`` cases reports: each case of each run, each run's cache probes,
    each case read teacher-forced for the distance, and each case and the probes read by the reference arm."""
    probing = probes_.why_not(p) is None
    probed = sum(config != ALONE for config, _ in p.schedule) if probing else 0
    read = cases + probing if p.policy.reference else 0
    return cases * len(p.schedule) + probed + (cases if p.policy.distance else 0) + read


@dataclass
class Runs:
    results: dict[str, list[Run]]  # config -> one per repeat
    seconds: dict[str, float]
    model_s: float
    probes: dict[str, list[probes_.Probed]] = field(default_factory=dict)  # config -> one per repeat
    controls: dict[str, Any] | None = None  # sampled: the flag-on run's control draws (gate/arms/controls.py)
    ran: list[battery.Item] | None = None  # sequential: the cases run, in their order (None: the whole battery)
    rule: sequential.Sequential | None = None  # sequential: the rule's state where it stopped
    failed: list[str] = field(default_factory=list)  # steps after the cases that raised: each, and what it raised


def _run(p: Plan, ledger, models: dict[str, Engine], evaluation_id: int, progress: Callable[[str], None],
         graders: graders_.Graders | None = None) -> Runs:
    """Every configuration and repeat, each on a fresh session; each case recorded as it finishes.
    Under a load, each run but the one alone keeps the load's background traffic in flight beside it."""
    runs = Runs({config: [] for config, _ in p.schedule}, {config: 0.0 for config, _ in p.schedule}, 0.0)
    probing = probes_.why_not(p) is None
    for config, repeat in p.schedule:
        c = p.configs["off" if config == ALONE else config]
        model = models["off" if config == ALONE else config]
        with model.session(cache=c.cache) as session, _background(p, model, c, config):
            # Registered in both configurations: an aligned prefill plan splits at these boundaries either way.
            runs_.pin_stage_prefixes(session, p, c.render)
            results: Run = {}
            t0 = time.perf_counter()
            for item, result in runs_.cases(session, p, c.render, workers=1 if config == ALONE else None, graders=graders):
                _recorded(runs, results, ledger, evaluation_id, config, repeat, item.case_id, result, progress)
            runs.seconds[config] += time.perf_counter() - t0
            if config != ALONE and probing:  # after the battery, in every run, in one order
                _probe(runs, session, p, ledger, evaluation_id, config, repeat, progress)
            if (config, repeat) == ("on", 0):
                runs.controls = controls_.run(session, p, c.render)
        runs.results[config].append(results)
    return runs


def _recorded(runs: Runs, results: Run, ledger, evaluation_id: int, config: str, repeat: int, case_id: str,
              result: CaseResult, progress: Callable[[str], None]) -> None:
    """One case's result, as it finishes: in the ledger, in its run, and in the model seconds."""
    progress(f"{config}#{repeat} {case_id}")
    runs.model_s += sum(t["prefill_s"] + t["decode_s"] for t in result["turns"])
    ledger.add_case_result(evaluation_id, case_id, config, repeat, result)
    results[case_id] = result


def _probe(runs: Runs, session, p: Plan, ledger, evaluation_id: int, config: str, repeat: int,
           progress: Callable[[str], None]) -> None:
    """The cache probes at the end of one run, on its session, each recorded as a case is."""
    progress(f"{config}#{repeat} cache probes")
    probed = probes_.run(session, p, p.configs[config].render)
    for pid, result in probed.results.items():
        ledger.add_case_result(evaluation_id, pid, config, repeat, result)
    runs.probes.setdefault(config, []).append(probed)


def _run_sequential(p: Plan, ledger, models: dict[str, Engine], evaluation_id: int, progress: Callable[[str], None],
                    graders: graders_.Graders | None = None) -> Runs:
    """The battery in a seeded random order (clusters kept together), until the rule (gate/stats/sequential.py) decides
    or the budget is spent; each case recorded as it finishes, as in ``_run``.

    Every run of the schedule gets its session once and keeps it open; the cases go in rounds, each round run on
    every side in the schedule's order (off#0, off#1, on#0), and after a round the rule reads each cluster whose
    cases have all run. Why this scheme: each session still sees its cases in one order from first to last (its
    prefix cache fills as in a whole run) and runs them through ``runs_.cases`` as ``_run`` does, so a case's
    result is what a whole run would give it; a round is as many cases as the engines run at once, so a served
    engine keeps its concurrency and an in-process one is looked at after every case. The rule is anytime-valid,
    so looking after every round costs nothing, and the cases after the stop are never run."""
    budget = p.sequential
    assert budget is not None  # plan() set it
    keys = [pairs_.cluster_of(p.policy.cluster, i) for i in p.items]
    ordered = [p.items[n] for n in sequential.order(keys, budget.seed)]
    limit = min(len(ordered), budget.max_cases or len(ordered))
    size = max(m.concurrency for m in models.values())
    rule = sequential.Sequential("equivalence" if p.policy.gate == "assertion_equivalence" else "non_inferiority",
                                 p.policy.margin, p.kind.policy.alpha, budget, len(p.items),
                                 "cases" if p.policy.cluster == "case" else "clusters")
    ran: list[battery.Item] = []
    runs = Runs({config: [] for config, _ in p.schedule}, {config: 0.0 for config, _ in p.schedule}, 0.0, ran=ran, rule=rule)
    sizes = {k: keys.count(k) for k in dict.fromkeys(keys)}
    done: dict[str, list[battery.Item]] = {}
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        sessions = []
        for config, repeat in p.schedule:  # no load here (plan refuses one): every run is a side of the comparison
            c = p.configs[config]
            session = stack.enter_context(models[config].session(cache=c.cache))
            runs_.pin_stage_prefixes(session, p, c.render)
            runs.results[config].append({})
            sessions.append((config, repeat, c, session))
        stopped: sequential.Stop | None = None
        while stopped is None:
            chunk = ordered[len(ran):min(len(ran) + size, limit)]
            for config, repeat, c, session in sessions:
                t1 = time.perf_counter()
                for item, result in runs_.cases(session, p, c.render, graders=graders, items=chunk):
                    _recorded(runs, runs.results[config][repeat], ledger, evaluation_id, config, repeat, item.case_id,
                              result, progress)
                runs.seconds[config] += time.perf_counter() - t1
            ran += chunk
            for item in chunk:
                key = pairs_.cluster_of(p.policy.cluster, item)
                done.setdefault(key, []).append(item)
                if len(done[key]) == sizes[key]:  # the cluster is whole: one observation
                    found = pairs_.pairs_of(done[key], runs.results["off"][0], runs.results["on"][0], p.policy.cluster)
                    rule.observe([x for pairs in found.values() for x in pairs], cases=sizes[key])
            spent = time.perf_counter() - t0
            stopped = ("decided" if rule.decision != "continue" else "battery_exhausted" if len(ran) == len(ordered)
                       else "max_cases" if len(ran) >= limit
                       else "max_seconds" if budget.max_seconds is not None and spent >= budget.max_seconds else None)
        rule.stop(stopped, round(time.perf_counter() - t0, 3))
        probed_plan = dataclasses.replace(p, items=ran)
        if probes_.why_not(probed_plan) is None:  # after the cases run, in every run, in one order (as in _run)
            for config, repeat, _, session in sessions:
                _probe(runs, session, probed_plan, ledger, evaluation_id, config, repeat, progress)
        for config, repeat, c, session in sessions:
            if (config, repeat) == ("on", 0):
                runs.controls = controls_.run(session, probed_plan, c.render)
    return runs


def _background(p: Plan, model: Engine, c: Config, config: str):
    """The load's background traffic for one run (nothing for the run alone, or without a load)."""
    if p.load is None or config == ALONE:
        return contextlib.nullcontext()
    prompts = production.prompts(p.ws, p.load, model, p.items, c.render, p.captured)
    return model.background(c.cache, prompts, p.load.concurrency - model.concurrency)


def _distance(p: Plan, models: dict[str, Engine], runs: Runs,
              progress: Callable[[str], None]) -> distance.Compared | str | None:
    """The teacher-forced distance (gate/arms/forced.py), or why it cannot be read; None where the policy wants none."""
    if not p.policy.distance:
        return None
    if why := next((w for w in (m.unscored() for m in models.values()) if w), None):  # nothing is sent to ask
        return f"an engine here gives no next-token distributions to read teacher-forced: {why}"
    return _after_cases(runs, "distance", "the teacher-forced step",
                        lambda: forced.measure(p, models, runs.results["off"][0], progress))


def _reference(p: Plan, models: dict[str, Engine], runs: Runs,
               progress: Callable[[str], None]) -> reference_.Read | str | None:
    """The reference arm's reading (gate/arms/reference.py), or why it cannot be read; None where the policy wants none."""
    if not p.policy.reference:
        return None
    return _after_cases(runs, "reference", "the reference step",
                        lambda: reference_.read(p, models, runs.results, progress, runs.probes))


Found = TypeVar("Found", distance.Compared, reference_.Read)


def _after_cases(runs: Runs, name: str, what: str, step: Callable[[], Found | str]) -> Found | str:
    """A step after the cases, timed; what it raises is recorded (``runs.failed``) and becomes why it cannot be read,
    so a verdict still comes."""
    t0 = time.perf_counter()
    try:
        found = step()
    except Exception as e:  # noqa: BLE001 - recorded with its error, and a verdict still comes
        runs.failed.append(f"{name}: {described(e)}")
        return f"{what} failed: {described(e)}"
    if not isinstance(found, str):
        found.seconds = round(time.perf_counter() - t0, 3)
    return found


def _decide(p: Plan, ledger, models: dict[str, Engine], evaluation_id: int, runs: Runs,
            shares: dict[str, float], wall: float, moved: distance.Compared | str | None = None,
            read: reference_.Read | str | None = None) -> Outcome:
    """Compare every case (baseline repeats with each other, off with on), each comparison recorded, and let the
    judges decide (``decide.py``)."""
    detok = models["off"].detokenize
    reference, on = runs.results["off"][0], runs.results["on"][0]
    crashed = crashes_.found(runs.results) + crashes_.found({k: [r.results for r in v] for k, v in runs.probes.items()})
    unstable: dict[str, str] = {}  # case id -> why
    keyless: list[str] = []  # sampled cases whose flag-off repeats parted under the same keys (no other cause seen)
    differing, equal = [], {"baseline": 0, "off_on": 0}
    for item in p.items:
        cid = item.case_id
        if any(c.case == cid for c in crashed):  # no answer to compare: the crash rule decides
            ledger.add_comparison(evaluation_id, cid, False, {"pair": "off#0~on#0",
                                                              "crash": [c.record for c in crashed if c.case == cid]})
            continue
        for r, other in enumerate(runs.results["off"][1:], 1):
            diff = kinds.token_diff(reference[cid], other[cid], detok)
            ledger.add_comparison(evaluation_id, cid, diff is None, {"pair": f"off#0~off#{r}", **(diff or {})})
            if diff is None:
                equal["baseline"] += 1
            elif cid not in unstable:
                cause, unstable[cid] = _unstable(p, item, runs.results["off"], r, diff)
                keyless += [cid] if item.suite.decoding.sampled and cause is Parted.KEYLESS else []
        diff = p.kind.compare(reference[cid], on[cid], detok)
        ledger.add_comparison(evaluation_id, cid, diff is None, {"pair": "off#0~on#0", **(diff or {})})
        if diff is None:
            equal["off_on"] += 1
        else:
            differing.append((cid, diff))
    # a flag-off side whose draws do not follow their keys: its sampled answers are fresh draws each time, so the
    # sides are compared by their distributions (gate/stats/unpaired.py), not as an unstable baseline or token by token
    sampled = [i for i in p.items if i.suite.decoding.sampled and runs.results["off"][1:]]
    unkeyed = (unpaired.Unpaired(len(keyless), len(sampled), keyless[0])
               if keyless and not p.load and runs.rule is None else None)
    if unkeyed:
        unstable = {cid: why for cid, why in unstable.items() if cid not in keyless}
        differing = [(cid, d) for cid, d in differing if cid not in {i.case_id for i in sampled}]
    tokens_compared = [i for i in p.items if not (unkeyed and i.suite.decoding.sampled)]

    on_turns = [t for res in on.values() for t in res["turns"]]
    off_turns = [t for res in reference.values() for t in res["turns"]]
    strength = (kinds.strength([(i.case_id, reference[i.case_id], on[i.case_id]) for i in tokens_compared],
                               bool(differing)) if p.kind.numeric and tokens_compared else None)
    census = kinds.near_ties([(i.suite.suite, reference[i.case_id]) for i in p.items])
    g = models["on"].granularity  # a server caching whole KV blocks can serve no more than whole blocks
    pairs = pairs_.pairs_of(p.items, reference, on, p.policy.cluster)
    if strength is not None:  # an exact gate's flips are figures beside its drift, never its verdict
        strength = dataclasses.replace(strength, flips=paired.flip_counts(x for suite in pairs.values() for x in suite))
    evidence = kinds.Evidence(len(p.items), differing, {"off": _passes(reference), "on": _passes(on)},
                              _sum(t["cached_tokens"] for t in on_turns), sum(t["static_tokens"] // g * g for t in on_turns),
                              p.exercises_cache, p.policy.baseline_repeats, strength, pairs)
    baseline_cached = _sum(t["cached_tokens"] for t in off_turns) if p.exercises_cache else 0
    variant = _batch_variant(p, ledger, models, evaluation_id, runs) if p.load else []
    judged = (probes_.judge(p, runs.probes["off"], runs.probes["on"][0], detok,
                            lambda pid, same, detail: ledger.add_comparison(evaluation_id, pid, same, detail),
                            unpaired=unkeyed is not None)
              if runs.probes.get("on") else None)
    coupled = coupling.couple(p.items, reference, on, p.policy.alpha, models["on"].sampler(), runs.rule is not None)
    declared = pit.read(p.items, runs.results, read.reread if isinstance(read, reference_.Read) else None) if coupled else None
    checked = controls_.judge(runs.controls, reference, p.policy.alpha) if coupled else None
    verdict, reasons = decide.decide(decide.Compared(
        p, models, evidence, crashes_.decide(crashed), variant, unstable, judged, baseline_cached, runs.rule, moved, read,
        coupled, lambda: coupling.ignored(p.items, runs.results, p.policy.alpha), declared, checked, unkeyed,
        bool(tokens_compared), strength, census, runs.failed))
    reached = {cfg: sides.reached(runs.results[cfg][0]) for cfg in ("off", "on")}
    model_s = runs.model_s
    return Outcome(
        evaluation_id=evaluation_id, flag=p.flag, verdict=verdict, reasons=reasons,
        cases=len(p.items), assertions=sum(len(i.case.assert_) for i in p.items),
        differing_cases=[cid for cid, _ in differing], equal=equal,
        tokens={"prompt_off": sum(t["prompt_tokens"] for t in off_turns),
                "computed_on": None if evidence.cached is None else sum(t["prompt_tokens"] for t in on_turns) - evidence.cached,
                "cached_on": evidence.cached, "stable_prefix_bound": evidence.bound},
        seconds={"off": round(runs.seconds["off"] / p.policy.baseline_repeats, 3), "on": round(runs.seconds["on"], 3)},
        cacheable_share=shares, exercised_share=round(evidence.exercised, 4), passes=evidence.passes,
        model_seconds=round(model_s, 3), overhead_seconds=round(max(0.0, wall - model_s), 3),
        telemetry={"off": _telemetry(p, reference), "on": _telemetry(p, on)},
        strength=strength.to_dict() if strength else None, near_ties=census,
        probes=judged.status if judged else {}, probe_seconds=judged.seconds if judged else 0.0,
        reached={k: v for k, v in reached.items() if v},
        paired=p.kind.statistics(evidence) if runs.rule is None else None,
        sequential=runs.rule.to_dict() if runs.rule is not None else None,
        sampling=_sampling(coupled, declared, checked, unkeyed) if coupled else None,
        reference=NotObservable(not_observable=read) if isinstance(read, str) else read.to_dict() if read is not None else None,
        distance=(NotObservable(not_observable=moved) if isinstance(moved, str) else _distance_summary(moved)
                  if moved is not None else None),
    )


def _sampling(coupled: coupling.Coupled, declared: dict[str, pit.Side] | None, checked: controls_.Controls | None,
              unkeyed: unpaired.Unpaired | None) -> SamplingSummary:
    """The sampled decoding as the outcome records it: the coupling, then each side's draws against the declared
    decoding, the controls (not where the draws are unpaired) and the unpaired comparison."""
    out: SamplingSummary = {**coupled.to_dict(), "declared": pit.to_dict(declared) if declared else None,
                            "controls": checked.to_dict() if checked and not unkeyed else None,
                            "unpaired": unkeyed.to_dict() if unkeyed else None}
    return out


def _distance_summary(moved: distance.Compared) -> DistanceSummary:
    out: DistanceSummary = {**moved.to_dict(), "reason": moved.reason()}
    return out


def _unstable(p: Plan, item: battery.Item, off: list[Run], r: int, d: Comparison) -> tuple[Parted, str]:
    """The likeliest cause it can see of where the flag-off runs part, and the ``baseline_unstable:`` reason naming both."""
    cid = item.case_id
    where = ("assertion outcomes differ" if d.get("turn") is None else
             f"turn {d['turn']} first divergent token at position {d['first_divergent_position']} {kinds.divergence(d, ('off#0', f'off#{r}'))}")
    turn = (d.get("turn") or 1) - 1
    cached = [res[cid]["turns"][turn].get("cached_tokens") if turn < len(res[cid]["turns"]) else None for res in (off[0], off[r])]
    profile = p.configs["off"].profile
    first = next(i for i in p.items if i.suite.stage == item.suite.stage) is item
    kind = (Parted.CACHED if any(cached) else Parted.COLLAPSE if d.get("collapse")
            else Parted.WARM_UP if profile.adapter == "http" and profile.warm_up and first
            else Parted.KEYLESS if not item.suite.decoding.plain else Parted.NEAR_TIE if d.get("near_tie")
            else Parted.UNKNOWN)
    if kind is Parted.CACHED:
        cause = (f"server state: the flag-off server served {cached[0]} of this request's prompt tokens from a cache in "
                 f"off#0 and {cached[1]} in off#{r}, so it was not cold; turn its cache off for the flag-off side")
    elif kind is Parted.COLLAPSE:
        cause = ("server state: one run's top-2 margin collapsed where the other's did not, as when a state left by "
                 "an earlier request is reused; restart the server between runs to confirm")
    elif kind is Parted.WARM_UP:
        cause = (f"warm-up: it is the first case of stage {item.suite.stage}, sent right after gatekeeper's warm-up of "
                 f"the stage's static prefix; set 'warm_up: false' in {profile.where} to evaluate without it")
    elif kind is Parted.KEYLESS:
        cause = KEYLESS
    elif kind is Parted.NEAR_TIE:
        cause = "order or batching: a near-tie that identical requests resolved differently (float noise in the engine)"
    else:
        cause = "server state or nondeterminism the figures do not show; restart the server between runs to tell them apart"
    return kind, (f"baseline_unstable: {cid} gave different outputs on repeated flag-off runs (off#0 vs off#{r}: {where}); "
                  f"likeliest cause: {cause}")


def _batch_variant(p: Plan, ledger, models: dict[str, Engine], evaluation_id: int, runs: Runs) -> list[str]:
    """Cases whose flag-off answer under the load parts from the same case run alone: batching, not the
    flag, changed them. Each comparison is recorded; each reason names where they part and the fix."""
    detok, alone, loaded = models["off"].detokenize, runs.results[ALONE][0], runs.results["off"][0]
    fix = production.fix(models["off"].dialect_name)
    assert p.load is not None  # called only under a load
    out = []
    for item in p.items:
        cid = item.case_id
        diff = kinds.token_diff(alone[cid], loaded[cid], detok)
        ledger.add_comparison(evaluation_id, cid, diff is None, {"pair": f"{ALONE}#0~off#0", **(diff or {})})
        if diff is None:
            continue
        where = ("assertion outcomes differ" if diff.get("turn") is None else
                 f"turn {diff['turn']} first divergent token at position {diff['first_divergent_position']} "
                 f"{kinds.divergence(diff, ('alone', 'under load'))}")
        turn, position = diff.get("turn"), diff.get("first_divergent_position")
        if turn is not None and position is not None and production.seed_broken(alone[cid], loaded[cid], turn, position):
            out.append(f"seed_batched: {cid} under load (concurrency {p.load.concurrency}) parts from the same case run "
                       f"alone at a step where both read the same top-2 logits: {where}; batching changed the draw, "
                       f"not the numerics; {production.seed_fix(models['off'].dialect_name)}")
            continue
        out.append(f"batch_variant: {cid} under load (concurrency {p.load.concurrency}) parts from the same case run "
                   f"alone: {where}; batching, not the flag, changed it; {fix}")
    return out


def _telemetry(p: Plan, results: Run) -> dict[str, StageTelemetry]:
    """Per stage, what one side's calls cost, as its engine reports it."""
    out: dict[str, StageTelemetry] = {}
    for item in p.items:
        row = out.setdefault(item.suite.stage, StageTelemetry(calls=0, prompt_tokens=0, cached_tokens=0,
                                                              prefill_s=0.0, decode_s=0.0))
        for t in results[item.case_id]["turns"]:
            row["calls"] += 1
            for k in ("prompt_tokens", "prefill_s", "decode_s"):
                row[k] += t[k]
            row["cached_tokens"] = plus(row["cached_tokens"], t["cached_tokens"])
    for row in out.values():
        model_s = row["prefill_s"] + row["decode_s"]
        row["prefill_share"] = round(row["prefill_s"] / model_s, 4) if model_s else None
        row["prefill_s"], row["decode_s"] = round(row["prefill_s"], 6), round(row["decode_s"], 6)
    return out


def _sum(values: Iterator[int | None]) -> int | None:
    """A total, or None when any part was not reported."""
    total: int | None = 0
    for v in values:
        total = plus(total, v)
    return total


def _passes(results: Run) -> int:
    return sum(o["pass"] for r in results.values() for o in r["outcomes"])
