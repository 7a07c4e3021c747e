"""The kinds of failure the CLI maps to exit codes."""

from __future__ import annotations

from .evidence import CrashRecord


class GatekeeperError(Exception):
    """Bad input or configuration: the CLI prints the message and exits 2, having written nothing."""


class LedgerIntegrityError(GatekeeperError):
    """The ledger's chain or rows do not match: someone edited it."""


class LedgerReadError(Exception):
    """The database failed while the ledger was read without SQLAlchemy (``ledger.reader``); ``orig`` holds the
    driver's error, as SQLAlchemy's DBAPIError does, so a damaged file is reported the same either way."""

    def __init__(self, orig: Exception):
        super().__init__(str(orig))
        self.orig = orig


class EngineCrash(GatekeeperError):
    """An engine took a request and failed it: a server that closed the connection without an answer, answered
    5xx, or died after it had answered. Evidence about the side it happened on, so the gate records it with the
    case (``gate/crashes.py``) instead of aborting; elsewhere it stops the command like any engine error."""

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
