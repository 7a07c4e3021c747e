"""The review app: the ledger's evidence in a browser (``review``)."""

from __future__ import annotations

import json
import sys
from typing import Annotated, Optional

import typer

from .common import EngineName, Json, Settings, reporting


@reporting
def review(
    ctx: typer.Context,
    listen: Annotated[str, typer.Option(help="HOST:PORT to listen on (port 0: any free one).")] = "127.0.0.1:8017",
    allow_remote: Annotated[bool, typer.Option(
        "--allow-remote", help="Serve on a non-loopback address: anyone who reaches it reads the evidence.")] = False,
    allow_host: Annotated[Optional[list[str]], typer.Option(
        help="Another name browsers reach this server by (repeatable); other Host headers are refused.")] = None,
    engine: EngineName = "auto",
    json_: Json = False,
) -> None:
    """Serve the ledger's evidence to reviewers in a browser: flags and what a flip needs, evaluations, cases side by
    side, compare, integrity; every page also as JSON (add .json). Read-only; loopback unless --allow-remote;
    Ctrl-C stops."""
    from ..review import app
    from ..review.source import Source

    settings: Settings = ctx.obj
    ws = settings.open_workspace()
    sock = app.bind(listen, allow_remote)
    host = sock.getsockname()[0]
    if not app.loopback(host):
        typer.echo(f"warning: serving on {host}, not loopback: anyone who can reach it reads the ledger's evidence "
                   "(outputs, identities, operators); there is no login", err=True)
    source = Source(ws.root, settings.ledger_url(ws), engine)
    if not json_:  # the first check reads every entry once (about 14 s at 100,000 entries on two cores)
        typer.echo("gatekeeper review: checking the ledger's integrity before serving it...", err=True)

    def ready(url: str) -> None:
        view = source.view()
        if json_:
            typer.echo(json.dumps({"url": url, "integrity": view.ok, "entries": view.integrity.get("entries"),
                                   "problem": view.integrity.get("problem") or None}))
        else:
            typer.echo(f"gatekeeper review: {url} (read-only; Ctrl-C stops)")
            if not view.ok:
                typer.echo(f"warning: the ledger does not verify: {view.integrity.get('problem')}", err=True)
        sys.stdout.flush()

    try:
        app.serve(source, sock, app.served_hosts(sock, allow_host or []), ready)
    finally:
        source.close()
