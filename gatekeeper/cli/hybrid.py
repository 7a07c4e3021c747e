"""Hybrid-model commands: replay a trace under snapshot placement policies."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from ..errors import GatekeeperError
from . import tables
from .common import EngineName, Json, Settings, emit, reporting
from .progress import progress


@reporting
def replay(
    ctx: typer.Context,
    trace: Annotated[Optional[Path], typer.Argument(help="A capture: JSONL, one request a line.")] = None,
    engine: EngineName = "auto",
    policy: Annotated[Optional[list[str]], typer.Option(
        help="Snapshot placement (repeatable): tail, interval:N or boundaries, '+erase' for the single-slot "
             "erase rule. Default: each of the three with and without it.")] = None,
    scenario: Annotated[Optional[str], typer.Option(help="A built-in trace instead of TRACE: interleave or synthetic.")] = None,
    simulate: Annotated[bool, typer.Option(help="Token counts only, no model: the same plan, policy and limits.")] = False,
    tiny_hybrid: Annotated[bool, typer.Option(help="Run on a tiny random hybrid model built locally, not the profile's model.")] = False,
    max_tokens: Annotated[int, typer.Option(help="Tokens generated per request.")] = 8,
    scale: Annotated[float, typer.Option(help="Scenario prompt lengths times this.")] = 1.0,
    requests: Annotated[int, typer.Option(help="Requests in the synthetic scenario.")] = 1000,
    json_: Json = False,
) -> None:
    """Replay a trace under snapshot placement policies: restores, reuse against the bound, snapshot bytes, parity."""
    from ..traffic.captures import replay as replaying

    if (trace is None) == (scenario is None):
        raise GatekeeperError("give a trace file or --scenario interleave|synthetic (one of them)")
    if max_tokens < 1 or scale <= 0 or requests < 1:
        raise GatekeeperError("--max-tokens and --requests must be at least 1 and --scale above 0")
    specs = replaying.policies(policy)
    settings: Settings = ctx.obj
    ws = settings.open_workspace()
    profile = ws.engine(engine)
    if tiny_hybrid:
        from ..setup.tiny_hybrid import ensure

        profile = profile.model_copy(update={"model": str(ensure())})
    make = replaying.maker(profile, ws.root, simulate=simulate)
    if scenario is not None:
        traces = replaying.scenario(scenario, scale=scale, requests=requests)
    else:
        assert trace is not None  # checked above: a trace or a scenario
        readers: list = []  # text lines need the model's tokenizer: loaded on the first one

        def tokenize(text: str) -> list[int]:
            if not readers:
                readers.append(make(specs[0]))
            return readers[0].tokenize(text)

        try:
            traces = {trace.name: replaying.from_capture(trace, None if simulate else tokenize)}
        finally:
            for reader in readers:
                reader.close()
    runs = len(specs) * (1 if simulate else 2) * sum(len(t) for t in traces.values())
    with progress(runs, enabled=not json_, what="replay") as advance:
        report = replaying.replay(traces, specs, make, parity=not simulate, max_tokens=max_tokens,
                                  advance=lambda: advance("replaying"))
    report.update(engine=engine, simulated=simulate, source=str(trace) if trace else f"scenario:{scenario}")
    emit(json_, report, lambda: tables.print_replay(report))
