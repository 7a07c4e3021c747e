"""The kinds of failure the CLI maps to exit codes."""

from __future__ import annotations

import traceback
from pathlib import Path

from .evidence import CrashRecord

_PACKAGE = Path(__file__).resolve().parent  # gatekeeper's own code: where a bug, not a runtime, raised (origin)


class GatekeeperError(Exception):
    """Bad input or configuration: the CLI prints the message and exits 2, having written nothing."""


class LedgerIntegrityError(GatekeeperError):
    """The ledger's chain or rows do not match: someone edited it."""


class Superseded(GatekeeperError):
    """A flip made on the last flip of its flag (``add_flip(after=...)``) found that another one came after it: a
    fleet's other proxy rolled the flag back first, or a person flipped it."""


class LedgerReadError(Exception):
    """The database failed while the ledger was read without SQLAlchemy (``ledger.reader``); ``orig`` holds the
    driver's error, as SQLAlchemy's DBAPIError does, so a damaged file is reported the same either way."""

    def __init__(self, orig: Exception):
        super().__init__(str(orig))
        self.orig = orig


class EngineCrash(GatekeeperError):
    """An engine took a request and failed it: a server that closed the connection without an answer, answered
    5xx, or died after it had answered. Evidence about the side it happened on, so the gate records it with the
    case (``gate/arms/crashes.py``) instead of aborting; elsewhere it stops the command like any engine error."""

    def __init__(self, message: str, *, url: str, said: str, request: dict | None = None):
        super().__init__(message)
        self.url, self.said, self.request = url, said, request or {}

    @classmethod
    def raised(cls, where: str, said: str, prompt_tokens: int, max_tokens: int) -> "EngineCrash":
        """An in-process runtime (or a worker's) that raised while generating: a crash on its side, as a 5xx is."""
        return cls(f"{where}: the runtime raised {said} while generating: a crash, with the request made",
                   url=where, said=said, request={"prompt_tokens": prompt_tokens, "max_tokens": max_tokens})

    def record(self) -> CrashRecord:
        return CrashRecord(url=self.url, said=self.said, request=self.request, message=str(self))


class InternalError(Exception):
    """An exception raised in gatekeeper's own code: a bug, never evidence about an engine (no ``crashed:``, no
    verdict). ``where`` names the module and line; the CLI exits 3 with it."""

    def __init__(self, message: str, where: str):
        super().__init__(message)
        self.where = where


def origin(e: BaseException) -> tuple[str, bool]:
    """Where ``e`` was raised: ``package/module.py:LINE`` of its innermost frame, and whether that frame is gatekeeper's
    own code (an exception torch raises on what gatekeeper handed it, as ``bool(tensor)``, is gatekeeper's)."""
    if isinstance(e, InternalError):
        return e.where, True
    frames = traceback.extract_tb(e.__traceback__)
    if not frames:
        return "?", False
    path = Path(frames[-1].filename)
    ours = _PACKAGE in path.parents
    name = path.relative_to(_PACKAGE.parent).as_posix() if ours else "/".join(path.parts[-2:])
    return f"{name}:{frames[-1].lineno}", ours


def described(e: BaseException) -> str:
    """``Type: message (at where)``, the one line a crash, an internal error or a failed step is reported with."""
    where, _ = origin(e)
    return f"{type(e).__name__}: {e} (at {where})"


def internal(e: BaseException) -> InternalError | None:
    """``e`` as an InternalError when gatekeeper's own code raised it; None when the runtime (or anything else) did."""
    where, ours = origin(e)
    return InternalError(f"{type(e).__name__}: {e}", where) if ours else None

