"""What every command shares: the global settings, error reporting, output, the option types."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import typer

from ..errors import GatekeeperError, InternalError, origin

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
        from ..workspace import Workspace

        return Workspace(self.workspace)

    def ledger_url(self, ws) -> str:
        return self.ledger or f"sqlite:///{ws.ledger_path}"

    def open_ledger(self, ws, *, create: bool):
        """The ledger; with ``create=False`` a missing SQLite file gives None instead of a new database."""
        from ..ledger import open_ledger

        return open_ledger(self.ledger_url(ws), create=create)

    def opened_ledger(self, ws, *, create: bool):
        """``open_ledger`` for a ``with`` block, which closes it; a missing ledger is None there."""
        ledger = self.open_ledger(ws, create=create)
        return contextlib.nullcontext() if ledger is None else ledger

    def reading_ledger(self, ws):
        """``opened_ledger(ws, create=False)`` for commands that only read flag states and evaluations: a SQLite
        ledger at the current schema is read without SQLAlchemy (``ledger.reader``), anything else as there."""
        from ..ledger.reader import open_reader

        ledger = open_reader(self.ledger_url(ws))
        return contextlib.nullcontext() if ledger is None else ledger


INTERNAL_ERROR = 3  # exit code of a crash: neither a verdict (0/1) nor bad input (2)


def _say(json_: bool, message: str) -> None:
    if json_:
        typer.echo(json.dumps({"error": message}))
    else:
        typer.echo(f"error: {message}", err=True)


def reporting(fn: Callable) -> Callable:
    """Turn a GatekeeperError into exit 2 with its message (as {"error": ...} under --json), and any other
    exception into exit 3 with one line saying it is a bug, never a traceback and never exit 1 (a FAIL)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        import click

        try:
            return fn(*args, **kwargs)
        except GatekeeperError as e:
            _say(bool(kwargs.get("json_")), str(e))
            raise typer.Exit(2) from None
        except (typer.Exit, typer.Abort, click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
            raise
        except Exception as e:  # noqa: BLE001 - the one place a crash is caught
            if os.environ.get("GATEKEEPER_DEBUG"):
                raise  # the traceback, for whoever fixes it
            if _damaged_database(e):  # input, not a bug: a ledger file SQLite cannot read
                _say(bool(kwargs.get("json_")), f"the ledger cannot be read: {_first_line(getattr(e, 'orig', e))}; "
                     "'gatekeeper ledger verify' says what is wrong with it")
                raise typer.Exit(2) from None
            where, _ = origin(e)  # an InternalError from a worker carries the worker's module and line
            detail = _first_line(e)
            kind = "" if isinstance(e, InternalError) else f"{type(e).__name__}{': ' if detail else ''}"
            _say(bool(kwargs.get("json_")), f"internal error, a bug in gatekeeper: {kind}{detail} at {where}; "
                 "please report it (GATEKEEPER_DEBUG=1 shows the traceback)")
            raise typer.Exit(INTERNAL_ERROR) from None

    return wrapper


def _first_line(e: BaseException) -> str:
    return (str(e).splitlines() or [""])[0]


def _damaged_database(e: Exception) -> bool:
    """A SQLite file that is damaged or not a database, raised through SQLAlchemy or the ledger's own reader."""
    import sqlite3

    from ..errors import LedgerReadError

    orig: BaseException | None = None
    if isinstance(e, LedgerReadError):
        orig = e.orig
    elif "sqlalchemy" in sys.modules:
        from sqlalchemy.exc import DBAPIError

        if isinstance(e, DBAPIError):
            orig = e.orig
    return (isinstance(orig, sqlite3.DatabaseError)
            and any(w in str(orig) for w in ("malformed", "not a database", "could not decode", "Could not decode")))


def writable_file(path: Path, option: str) -> None:
    """Exit 2 before any work unless ``path`` names a file in an existing folder."""
    if path.is_dir() or not path.parent.is_dir():
        raise GatekeeperError(f"{option} {path}: name a file in an existing folder")


def emit(json_: bool, data: Any, human: Callable[[], None]) -> None:
    if json_:
        typer.echo(json.dumps(data, indent=2, default=str))
    else:
        human()


class sigterm_as_interrupt:
    """SIGTERM takes the same path as Ctrl-C, so the evaluation is recorded as aborted."""

    def __enter__(self):
        import signal

        def handler(signum, frame):
            raise KeyboardInterrupt("SIGTERM")

        self.previous = signal.signal(signal.SIGTERM, handler)

    def __exit__(self, *exc):
        import signal

        signal.signal(signal.SIGTERM, self.previous)
