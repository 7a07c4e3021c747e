"""Battery commands: mine a battery for power, and turn captured traffic into candidate cases."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from ..errors import GatekeeperError
from . import tables
from .common import EngineName, Json, Settings, Suites, emit, reporting
from .progress import progress

battery_app = typer.Typer(help="Mine the assertion battery for power; size it for a margin; make candidate cases from "
                               "captured traffic.",
                          no_args_is_help=True)
Captures = Annotated[Optional[list[Path]], typer.Option("--capture", help="A capture (JSONL) whose calls are candidates (repeatable).")]


@battery_app.command("from-capture")
@reporting
def from_capture(
    ctx: typer.Context,
    capture: Annotated[Path, typer.Argument(help="A capture written by 'gatekeeper proxy' or the runtime (JSONL).")],
    out: Annotated[Path, typer.Option(help="Folder for the candidate suites (created).")] = Path("candidates"),
    flag: Annotated[str, typer.Option(help="The flag the cases will gate (its policy's gate kind decides whether "
                                            "cases need assertions).")] = "prefix_cache",
    assertions: Annotated[Optional[Path], typer.Option(help="A YAML list of assertions given to every case.")] = None,
    max_tokens: Annotated[int, typer.Option(help="Tokens each case generates.")] = 32,
    json_: Json = False,
) -> None:
    """Turn captured calls into candidate cases per stage: the shared prefix static, each call's rest a case."""
    from ..traffic.captures import cases

    if max_tokens < 1:
        raise GatekeeperError("--max-tokens must be at least 1")
    ws = ctx.obj.open_workspace()
    gate = ws.policy(flag).gate
    given = cases.read_assertions(assertions) if assertions is not None else []
    found = cases.stages(capture)
    written = cases.write(found, out, max_tokens=max_tokens, assertions=given, gate=gate)
    report = {"capture": str(capture), "written": [str(p) for p in written],
              "stages": {st.name: {"cases": len(st.cases), "static_chars": len(st.prefix)} for st in found}}
    emit(json_, report, lambda: tables.print_candidates(report))


@battery_app.command("mine")
@reporting
def mine(
    ctx: typer.Context,
    suite: Suites = None,
    capture: Captures = None,
    cases: Annotated[Optional[int], typer.Option(help="Budget: keep this many cases.")] = None,
    seconds: Annotated[Optional[float], typer.Option(help="Budget: keep cases worth this many flag-off model seconds.")] = None,
    max_tokens: Annotated[Optional[int], typer.Option(help="Decode candidates this long (mining picks each suite's "
                                                           "length up to it; default: each suite's own).")] = None,
    faults: Annotated[Optional[str], typer.Option(help="Also run every candidate flag on with these planted faults "
                                                       "(comma-separated: shift, drop, other_prefix, noise:S) and keep "
                                                       "first the cases whose outputs they change.")] = None,
    engine: EngineName = "auto",
    out: Annotated[Path, typer.Option(help="Folder for the mined suites (created).")] = Path("mined"),
    json_: Json = False,
) -> None:
    """Run every candidate case once flag off, score its near-ties per second, and write the best subset as suites."""
    from ..battery.suites import Item, read
    from ..engines.faults import parse
    from ..gate.power import mine as mining
    from ..gate.state import pipeline
    from ..traffic.captures import cases as captured
    from ..workspace import Suite

    if max_tokens is not None and max_tokens < 1:
        raise GatekeeperError("--max-tokens must be at least 1")
    mining.check_budget(cases, seconds)  # before minutes of model time
    try:
        planted = [parse(f) for f in faults.split(",")] if faults else []
    except ValueError as e:
        raise GatekeeperError(f"--faults {e}") from None
    settings: Settings = ctx.obj
    ws = settings.open_workspace()
    candidates = [] if capture and not suite else [
        mining.Candidate(i, f"{i.suite.path.relative_to(ws.root) if i.suite.path else i.suite.suite}#{i.case.id}")
        for i in read(ws, suite)]
    for path in capture or []:
        for st in captured.stages(path):
            s = Suite.model_validate(st.suite(None, max_tokens or 32, []))
            candidates += [mining.Candidate(Item(s, case), c["source"]) for case, c in zip(s.cases, st.cases)]
    with settings.opened_ledger(ws, create=False) as ledger:
        force = pipeline.in_force(ws, ledger)
    with progress(len(candidates) * (1 + len(planted)), enabled=not json_, what="battery mine") as advance:
        scored, identity = mining.run(ws, engine, candidates, force=force, max_tokens=max_tokens, faults=planted,
                                      progress=advance)
    mined = mining.select(scored, cases=cases, seconds=seconds, identity=identity, engine=engine)
    written = mining.write(ws, mined, out)
    report = {**mined.to_dict(), "written": [str(p) for p in written]}
    emit(json_, report, lambda: tables.print_mined(report))


@battery_app.command("size")
@reporting
def size(
    ctx: typer.Context,
    flag: Annotated[str, typer.Option(help="The flag (a non_inferiority or assertion_equivalence policy).")],
    margin: Annotated[Optional[float], typer.Option(help="The margin to size for (default: the policy's).")] = None,
    evaluation: Annotated[Optional[int], typer.Option(
        help="The evaluation whose discordance to use (default: the flag's last finished one; none: assume none).")] = None,
    max_tv: Annotated[Optional[float], typer.Option(
        "--max-tv", help="Size sampled suites for this total-variation bound (every position class and stage) instead (default: the policy's "
                         "max_tv, where it sets one): the samples per case it needs.")] = None,
    json_: Json = False,
) -> None:
    """The cases the policy's margin needs at its power and at the alpha the next look at the change spends, and the
    smallest margin the battery supports now;
    for sampled suites with --max-tv (or the policy's max_tv), the samples per case that bound needs."""
    from ..gate.power import sizing
    from ..gate.stats import looks

    settings: Settings = ctx.obj
    ws = settings.open_workspace()
    ws.policy(flag)  # unknown flag: exit 2
    record, history = None, []
    with settings.opened_ledger(ws, create=False) as ledger:
        if ledger is not None:
            if evaluation is None:  # the newest finished one
                evaluation = next((e["id"] for e in ledger.evaluations() if e["flag"] == flag
                                   and e["status"] in ("PASS", "FAIL", "INCONCLUSIVE")), None)
            record = ledger.evaluation(evaluation) if evaluation is not None else None
            history = ledger.history(flag)
    if evaluation is not None and record is None:
        raise GatekeeperError(f"no evaluation {evaluation} in {settings.ledger_url(ws)}; see 'gatekeeper ledger list'")
    result = (sizing.coupled(ws, flag, max_tv, record) if max_tv is not None or ws.policy(flag).max_tv is not None
              else sizing.size(ws, flag, margin, record, looks.following(history, record)))
    emit(json_, result.to_dict(), lambda: typer.echo(result.line()))
