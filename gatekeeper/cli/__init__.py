"""The command line: parses, calls the library, prints. No logic lives here.

One module per command group; this one builds ``app`` from them (``gatekeeper = "gatekeeper.cli:app"``).
Heavy imports (torch, transformers, mlx) happen only inside command bodies, never at start-up.

Imports: errors, signing, workspace, battery, engines, gate, ledger, traffic, runtime, setup, openfeature.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from . import battery, evidence, flags, flagserve, hybrid, ledger, live, setup
from .common import Settings

app = typer.Typer(help="Decide, with evidence, whether an LLM inference optimization may be switched on.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)


@app.callback()
def main(
    ctx: typer.Context,
    workspace: Annotated[Optional[Path], typer.Option(
        "--workspace", envvar="GATEKEEPER_WORKSPACE", help="Workspace folder (default: the current directory).")] = None,
    ledger: Annotated[Optional[str], typer.Option(
        "--ledger", help="SQLAlchemy URL of the ledger (default: sqlite:///WORKSPACE/ledger/evidence.db).")] = None,
) -> None:
    ctx.obj = Settings(workspace, ledger)


app.add_typer(setup.models_app, name="models")
app.add_typer(ledger.ledger_app, name="ledger")
app.add_typer(battery.battery_app, name="battery")
app.add_typer(flagserve.flags_app, name="flags")
# the order of the commands in --help
app.command()(setup.init)
app.command()(flags.status)
app.command()(flags.flip)
app.command("hash")(flags.hash_)
app.command()(flags.pin)
app.command()(evidence.evaluate)
app.command()(evidence.calibrate)
app.command()(evidence.measure)
app.command()(evidence.analyze)
app.command()(hybrid.replay)
app.command()(live.proxy)
app.command()(live.forensics)

__all__ = ["app"]
