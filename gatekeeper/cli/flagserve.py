"""Flag serving: the ledger's flag states over OpenFeature's remote evaluation protocol (``flags serve``)."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from .common import EngineName, Json, Settings, reporting

flags_app = typer.Typer(help="Serve flag states to OpenFeature clients.", no_args_is_help=True)


@flags_app.command("serve")
@reporting
def serve(
    ctx: typer.Context,
    listen: Annotated[str, typer.Option(help="HOST:PORT to listen on; point OFREP clients at http://HOST:PORT.")]
    = "127.0.0.1:8016",
    engine: EngineName = "auto",
    json_: Json = False,
) -> None:
    """Serve each flag's state from the verified ledger over OFREP (read-only; Ctrl-C stops). A ledger that does
    not verify is served as an error on every flag, never as its last state."""
    from ..openfeature import ofrep
    from ..openfeature.resolve import Resolver

    settings: Settings = ctx.obj
    ws = settings.open_workspace()

    def ready(url: str, snapshot) -> None:
        if json_:
            typer.echo(json.dumps({"url": url, "ofrep": f"{url}{ofrep.PREFIX}", "flags": sorted(snapshot.flags),
                                   "error": snapshot.error}))
            return
        typer.echo(f"gatekeeper flags: serving {len(snapshot.flags)} flag(s) of {ws.root} over OFREP at {url} "
                   "(read-only; Ctrl-C stops)")
        if snapshot.error:
            typer.echo(f"warning: every evaluation is an error for now: {snapshot.error}", err=True)

    with Resolver(ws.root, ledger=settings.ledger, engine=engine) as resolver:
        ofrep.serve(resolver, listen, ready)
