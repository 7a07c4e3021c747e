"""Evidence commands: evaluate a flag (the gate), measure the prefill tax, analyze captured prompts."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Optional

import typer

from ..errors import GatekeeperError
from . import tables
from .common import (
    EngineName,
    Json,
    Limit,
    Operator,
    Settings,
    Suites,
    emit,
    reporting,
    sigterm_as_interrupt,
    writable_file,
)
from .progress import progress

SkipUnsupported = Annotated[bool, typer.Option(
    "--skip-unsupported", help="Leave out promptfoo assertions gatekeeper cannot evaluate (llm-rubric, javascript, ...); "
                               "evaluate's reasons list them (skipped:).")]


@reporting
def evaluate(
    ctx: typer.Context,
    flag: Annotated[str, typer.Option(help="The flag to evaluate (a policy in policies/).")],
    engine: EngineName = "auto",
    suite: Suites = None,
    limit: Limit = None,
    operator: Operator = None,
    candidate: Annotated[Optional[Path], typer.Option(
        help="adapter flag: the candidate LoRA adapter directory to compare with the current weights.")] = None,
    skip_unsupported: SkipUnsupported = False,
    load: Annotated[Optional[int], typer.Option(
        help="Run under this production load: N requests kept in flight on each side's server, background traffic "
             "beside the battery (default: the policy's 'load').")] = None,
    load_from: Annotated[Optional[str], typer.Option(
        help="The load's background traffic: 'battery' (its own prompts, the default) or a capture file to replay.")] = None,
    junit: Annotated[Optional[Path], typer.Option(
        help="Also write the verdict as JUnit XML here, one test case per battery case (and append a summary "
             "to $GITHUB_STEP_SUMMARY when it is set).")] = None,
    sequential: Annotated[bool, typer.Option(
        "--sequential", help="Run the cases in a seeded random order and stop as soon as an anytime-valid rule "
                             "decides (non_inferiority, or assertion_equivalence with a margin); implied by "
                             "--max-cases and --max-seconds.")] = False,
    max_cases: Annotated[Optional[int], typer.Option(
        help="Sequential: stop after at most N cases, INCONCLUSIVE if the rule has not decided.")] = None,
    max_seconds: Annotated[Optional[float], typer.Option(
        help="Sequential: stop after the round in which S seconds of running cases are spent, INCONCLUSIVE if the "
             "rule has not decided.")] = None,
    seed: Annotated[Optional[int], typer.Option(
        help="Sequential: the seed of the case order (default: a fresh one, recorded).")] = None,
    json_: Json = False,
) -> None:
    """Run the battery with the flag off (repeated) and on, compare, and record a verdict."""
    import getpass

    from ..gate import evaluator, planning
    from ..gate.run import production, runs
    from ..gate.state import pipeline
    from ..traffic.captures import capture

    settings: Settings = ctx.obj
    ws = settings.open_workspace()
    if junit is not None:
        writable_file(junit, "--junit")
    with settings.opened_ledger(ws, create=False) as ledger:
        force = pipeline.in_force(ws, ledger)
    # every input is checked before anything is written
    under = production.in_force(ws, flag, load, load_from)  # the production load both sides run under, if any
    replayed = production.source(ws, under) if under else None
    plan = planning.plan(ws, flag, engine, suite, limit, force=force, candidate=candidate, skip_unsupported=skip_unsupported,
                          load=under, captured=capture.prompts(replayed) if replayed else None,
                          budget=_budget(sequential, max_cases, max_seconds, seed))
    models = runs.open_engines(plan)
    total = evaluator.steps(plan, min(len(plan.items), max_cases or len(plan.items)))
    with (settings.opened_ledger(ws, create=True) as ledger, progress(total, enabled=not json_, what="evaluate") as advance,
          sigterm_as_interrupt()):
        try:
            outcome = evaluator.evaluate(plan, ledger, models, operator or getpass.getuser(), advance)
        except KeyboardInterrupt:
            typer.echo("interrupted: the evaluation is recorded as aborted (no verdict); the ledger is intact", err=True)
            raise typer.Exit(130) from None
        finally:
            runs.close_engines(models)
    if junit is not None or os.environ.get("GITHUB_STEP_SUMMARY"):
        _report_to_ci(settings, ws, outcome.evaluation_id, junit)
    emit(json_, outcome.to_dict(), lambda: tables.print_outcome(outcome))
    if outcome.verdict != "PASS":
        raise typer.Exit(1)


def _budget(on: bool, max_cases: Optional[int], max_seconds: Optional[float], seed: Optional[int]):
    """The sequential budget the options ask for (None: the whole battery, as always); a seed drawn when none is given."""
    import secrets

    from ..gate.stats.sequential import Budget

    if not (on or max_cases is not None or max_seconds is not None):
        if seed is not None:
            raise GatekeeperError("--seed orders a sequential evaluation's cases: add --sequential, --max-cases or "
                                  "--max-seconds, or drop --seed")
        return None
    return Budget(seed=secrets.randbelow(2**31) if seed is None else seed, max_cases=max_cases, max_seconds=max_seconds)


def _report_to_ci(settings: Settings, ws, evaluation_id: int, junit: Optional[Path]) -> None:
    """The recorded evaluation as CI reads it: a JUnit file, and a summary on the job's page."""
    from ..reports import junit as junit_

    with settings.opened_ledger(ws, create=False) as ledger:
        record = ledger.evaluation(evaluation_id)
    if junit is not None:
        junit.write_text(junit_.render(record), encoding="utf-8")
    summary = os.environ.get("GITHUB_STEP_SUMMARY")
    if summary:
        with open(summary, "a", encoding="utf-8") as f:
            f.write(junit_.summary(record))


@reporting
def calibrate(
    ctx: typer.Context,
    flag: Annotated[str, typer.Option(help="The cache flag to calibrate (a policy in policies/).")] = "prefix_cache",
    engine: EngineName = "auto",
    evaluation: Annotated[Optional[int], typer.Option(
        help="Calibrate this evaluation: its engine, suites, limit and flag-off run are used, and the record is linked to it.")] = None,
    suite: Suites = None,
    limit: Limit = None,
    operator: Operator = None,
    twin: Annotated[Optional[str], typer.Option(
        help="Calibrate a served evaluation (--evaluation) through this in-process engine profile on the same weights.")] = None,
    full: Annotated[bool, typer.Option("--full", help="Decode every case of every fault run whole (exact counts by "
                                       "outputs; by default a case stops at its first flag).")] = False,
    faults: Annotated[Optional[str], typer.Option(
        help="Only these planted faults, comma-separated (e.g. noise:1e-3,other_prefix; default: the whole graded "
             "ladder); the unfaulted run (noise:0) always runs first.")] = None,
    skip_unsupported: SkipUnsupported = False,
    json_: Json = False,
) -> None:
    """Plant faults of graded size in the flag-on run and record the share of cases the gate would flag."""
    import getpass

    from ..engines.faults import parse
    from ..gate.power import calibrate as calibration
    from ..gate.run import runs
    from ..gate.state import pipeline

    try:
        planted = [parse(f) for f in faults.split(",")] if faults else []
    except ValueError as e:
        raise GatekeeperError(f"--faults {e}") from None
    settings: Settings = ctx.obj
    ws = settings.open_workspace()
    with settings.opened_ledger(ws, create=False) as ledger:
        force = pipeline.in_force(ws, ledger)
        record = ledger.evaluation(evaluation) if ledger is not None and evaluation is not None else None
        if evaluation is not None and record is None:
            raise GatekeeperError(f"no evaluation {evaluation} in {settings.ledger_url(ws)}; see 'gatekeeper ledger list'")
        plan = calibration.plan(ws, flag, engine, suite, limit, force=force, evaluation=record, ledger=ledger, twin=twin,
                                skip_unsupported=skip_unsupported)
    # A twin's flag-off run is its own: the server's numerics are not the twin's.
    reference = calibration.reference(record) if record is not None and twin is None else None
    models = runs.open_engines(plan)
    try:
        twinned = None
        if twin is not None:
            assert record is not None  # calibration.plan refuses --twin without --evaluation
            twinned = calibration.twin_of(record, models["on"], twin)
        cases = len(plan.items) * (len(calibration.graded(planted)) + (reference is None))
        with progress(cases, enabled=not json_, what="calibrate") as advance:
            result = calibration.run(plan, models, reference, advance, full=full, faults=planted)
    finally:
        runs.close_engines(models)
    result.evaluation_id, result.twin = evaluation, twinned
    with settings.opened_ledger(ws, create=True) as ledger:  # written once every fault has run
        result.calibration_id = ledger.add_calibration(
            flag, evaluation, operator or getpass.getuser(),
            {"engine": plan.engine_name, "suites": plan.config["suites"], "limit": plan.config["limit"],
             **({"skip_unsupported": True} if plan.config.get("skip_unsupported") else {})},
            result.to_dict())
    emit(json_, result.to_dict(), lambda: tables.print_calibration(result.to_dict()))


@reporting
def measure(
    ctx: typer.Context,
    engine: EngineName = "auto",
    flag: Annotated[str, typer.Option(help="The flag whose state is set (a policy in policies/): the cache, or any declared change.")] = "prefix_cache",
    flag_state: Annotated[str, typer.Option(help="current (the ledger's), off or on.")] = "current",
    compare: Annotated[bool, typer.Option("--compare", help="Run off, then on, and print the reduction per stage.")] = False,
    suite: Suites = None,
    limit: Limit = None,
    capture: Annotated[Optional[Path], typer.Option(help="Write each rendered prompt to this local JSONL file.")] = None,
    operator: Operator = None,
    skip_unsupported: SkipUnsupported = False,
    json_: Json = False,
) -> None:
    """Run the battery's cases through the runtime and print the prefill tax per stage."""
    import getpass

    from ..traffic.captures import measure as measuring
    from ..traffic.captures.capture import check_path

    settings: Settings = ctx.obj
    ws = settings.open_workspace()
    p = measuring.plan(ws, flag, flag_state, compare, engine, suite, limit, skip_unsupported=skip_unsupported)
    if capture is not None:
        check_path(capture)
    with progress(len(p.items) * len(p.states), enabled=not json_, what="measure") as advance:
        m = measuring.measure(p, settings.ledger_url(ws), capture, advance)
    with settings.opened_ledger(ws, create=True) as ledger:  # written only once every run has finished
        measuring.record(m, p, ledger, operator or getpass.getuser(), capture is not None)
    emit(json_, m.to_dict(), lambda: tables.print_measurement(m.to_dict(), capture))


@reporting
def analyze(file: Annotated[Path, typer.Argument(help="A capture: JSONL, one request a line.")],
            json_: Json = False) -> None:
    """Read captured prompts and print the cacheable prefix share per stage and between consecutive requests."""
    from ..traffic.captures import analyze as analysis
    from ..traffic.captures import capture

    report = analysis.analyze(capture.read(file, content=False))
    emit(json_, {"file": str(file), **report}, lambda: tables.print_analysis(report))
