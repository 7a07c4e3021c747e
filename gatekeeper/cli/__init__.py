"""The command line: parses, calls the library, prints. No logic lives here.

One module per command group; this one builds ``app`` from them (``gatekeeper = "gatekeeper.cli:app"``).
A command's module is imported, and its click command built, only when that command runs (or ``--help``
lists them all), so ``status`` never pays for ``evaluate``'s imports. Heavy imports (torch, transformers,
mlx) happen only inside command bodies, never at start-up.

The groups: ``evidence`` (evaluate, calibrate, measure, analyze), ``flags`` (status, flip, hash, pin),
``flagserve`` (flags serve), ``battery`` (battery mine, from-capture, size), ``ledger`` (the ledger commands:
list, show, verify, export, diff, attest ...), ``live`` (proxy, forensics), ``hybrid`` (replay), ``review``,
``runtime`` (runtime prepare) and ``setup`` (init, models prepare); what they share (``common``: settings, errors,
output, option types), their human-readable output (``tables``) and long work's progress (``progress``).

Imports: errors, evidence, summaries, shadows, signing, workspace, battery, engines, gate, ledger, reports, traffic, runtime, setup, openfeature, review.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, MutableMapping
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from typer.core import TyperGroup

from .common import Settings

# Command -> (module of gatekeeper.cli, attribute): a command function, or a Typer app for a command group.
# In the order of the commands in --help.
COMMANDS: dict[str, tuple[str, str]] = {
    "init": ("setup", "init"),
    "status": ("flags", "status"),
    "flip": ("flags", "flip"),
    "hash": ("flags", "hash_"),
    "pin": ("flags", "pin"),
    "evaluate": ("evidence", "evaluate"),
    "calibrate": ("evidence", "calibrate"),
    "measure": ("evidence", "measure"),
    "analyze": ("evidence", "analyze"),
    "replay": ("hybrid", "replay"),
    "proxy": ("live", "proxy"),
    "forensics": ("live", "forensics"),
    "models": ("setup", "models_app"),
    "ledger": ("ledger", "ledger_app"),
    "battery": ("battery", "battery_app"),
    "flags": ("flagserve", "flags_app"),
    "review": ("review", "review"),
    "runtime": ("runtime", "runtime_app"),
}


def _build(name: str) -> Any:
    """The click command (or group) ``name``, made by typer from its function or app."""
    module, attribute = COMMANDS[name]
    target = getattr(importlib.import_module(f"{__name__}.{module}"), attribute)
    holder = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    holder.callback()(lambda: None)  # a group, so the command keeps its name
    if isinstance(target, typer.Typer):
        holder.add_typer(target, name=name)
    else:
        holder.command(name)(target)
    group = typer.main.get_command(holder)
    assert isinstance(group, TyperGroup)  # a Typer with a callback builds a group
    return group.commands[name]


class _Commands(MutableMapping):
    """Name -> click command, each built on first use; iterating names builds nothing."""

    def __init__(self) -> None:
        self._built: dict[str, Any] = {}

    def __getitem__(self, name: str) -> Any:
        if name not in self._built:
            if name not in COMMANDS:
                raise KeyError(name)
            self._built[name] = _build(name)
        return self._built[name]

    def __setitem__(self, name: str, command: Any) -> None:
        self._built[name] = command

    def __delitem__(self, name: str) -> None:
        raise TypeError("gatekeeper's commands cannot be removed")

    def __iter__(self) -> Iterator[str]:
        return iter(dict.fromkeys([*COMMANDS, *self._built]))

    def __len__(self) -> int:
        return len(set(COMMANDS) | set(self._built))


class _LazyGroup(TyperGroup):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.commands = _Commands()

    def list_commands(self, ctx: Any) -> list[str]:
        return list(self.commands)


app = typer.Typer(help="Decide, with evidence, whether an LLM inference optimization may be switched on.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False, cls=_LazyGroup)


@app.callback()
def main(
    ctx: typer.Context,
    workspace: Annotated[Optional[Path], typer.Option(
        "--workspace", envvar="GATEKEEPER_WORKSPACE", help="Workspace folder (default: the current directory).")] = None,
    ledger: Annotated[Optional[str], typer.Option(
        "--ledger", help="SQLAlchemy URL of the ledger (default: sqlite:///WORKSPACE/ledger/evidence.db).")] = None,
) -> None:
    ctx.obj = Settings(workspace, ledger)


__all__ = ["app"]
