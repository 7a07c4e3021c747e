"""Ledger commands: list, show, verify and export the recorded evidence."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from ..errors import GatekeeperError
from . import tables
from .common import Json, Settings, emit, reporting

ledger_app = typer.Typer(help="Read, verify and export the evidence ledger.", no_args_is_help=True)


@ledger_app.command("list")
@reporting
def ledger_list(ctx: typer.Context, limit: Annotated[Optional[int], typer.Option(help="Newest N only.")] = None,
                json_: Json = False) -> None:
    """Evaluations, newest first, with their derived status."""
    settings: Settings = ctx.obj
    ws = settings.open_workspace()
    with settings.opened_ledger(ws, create=False) as ledger:
        evaluations = ledger.evaluations(limit=limit) if ledger else []
    emit(json_, {"evaluations": evaluations}, lambda: tables.print_evaluations(evaluations))


def _evaluation(settings: Settings, ws, evaluation_id: int) -> dict:
    """One evaluation's record, or the error that points at ``gatekeeper ledger list``."""
    with settings.opened_ledger(ws, create=False) as ledger:
        record = ledger.evaluation(evaluation_id) if ledger else None
    if record is None:
        raise GatekeeperError(f"no evaluation {evaluation_id} in {settings.ledger_url(ws)}; see 'gatekeeper ledger list'")
    return record


@ledger_app.command("show")
@reporting
def ledger_show(ctx: typer.Context, evaluation_id: Annotated[int, typer.Argument(metavar="ID")],
                json_: Json = False) -> None:
    """One evaluation with all its evidence."""
    settings: Settings = ctx.obj
    record = _evaluation(settings, settings.open_workspace(), evaluation_id)
    emit(json_, record, lambda: tables.print_evaluation(record))


@ledger_app.command("verify")
@reporting
def ledger_verify(ctx: typer.Context, json_: Json = False) -> None:
    """Recheck the hash chain and every record against its entry; exit 1 naming the first bad entry."""
    settings: Settings = ctx.obj
    ws = settings.open_workspace()
    with settings.opened_ledger(ws, create=False) as ledger:
        if ledger is None:
            raise GatekeeperError(f"no ledger at {settings.ledger_url(ws)}; nothing has been recorded yet")
        report = ledger.verify()
    data = {"ok": report.ok, "entries": report.entries, "first_bad_seq": report.first_bad_seq, "problem": report.problem}
    emit(json_, data, lambda: tables.print_verify(data))
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
    from ..ledger.export import FORMATS, render

    if format_ not in FORMATS:
        raise GatekeeperError(f"--format must be one of {', '.join(FORMATS)}, not {format_!r}")
    if output is not None and (output.is_dir() or not output.parent.is_dir()):
        raise GatekeeperError(f"--output {output}: name a file in an existing folder")
    settings: Settings = ctx.obj
    text = render(_evaluation(settings, settings.open_workspace(), evaluation_id), format_)
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
