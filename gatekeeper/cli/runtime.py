"""Runtime environments: Python environments an engine profile's ``python`` runs its adapter under (``runtime``)."""

from __future__ import annotations

from typing import Annotated

import typer

from .common import Json, emit, reporting
from .progress import LogLines

runtime_app = typer.Typer(help="Prepare Python environments for runtime upgrades.", no_args_is_help=True)


@runtime_app.command("prepare")
@reporting
def prepare(
    name: Annotated[str, typer.Argument(help="The environment's name; a profile's 'python: NAME' runs there.")],
    packages: Annotated[list[str], typer.Argument(help="What it holds, as pip requirements: 'transformers==4.52.1' ...")],
    json_: Json = False,
) -> None:
    """Make a Python environment under $GATEKEEPER_HOME/runtimes/NAME from the package registry (torch at the
    project's pin unless named), once, and print its python; an engine profile with 'python: NAME' then runs its
    adapter there, so an upgrade of the runtime is a declared change ({profile: {python: NAME}}) to evaluate."""
    from ..setup.runtimes import STEPS
    from ..setup.runtimes import prepare as make

    if json_:
        made = make(name, packages)
    else:  # a line per step on a terminal as in a log: pip's own output comes between them
        with LogLines(f"runtime prepare {name}", STEPS, stage=lambda label: label) as step:
            made = make(name, packages, step=step)
    emit(json_, made, lambda: typer.echo(f"{made['python']}\n" + ", ".join(f"{k} {v}" for k, v in made["versions"].items())))
