"""An evaluation's status, derived from its records: nothing is ever updated in place."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

if TYPE_CHECKING:
    from gatekeeper.summaries import Decided, Starter

RUNNING = "running"
ABORTED = "aborted"


def process_alive(pid: int, host: str) -> bool:
    """Whether the process that started an evaluation still runs (only knowable on its own host)."""
    if host != socket.gethostname() or pid <= 0:
        return False
    if os.name != "posix":
        return True  # no cheap liveness probe: assume alive rather than call a live run dead
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    # A killed process its parent has not reaped yet is a zombie: it will write nothing more.
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


def derive_status(started: Starter, verdict: Decided | None, aborted: Mapping[str, object] | None) -> str:
    """PASS/FAIL/INCONCLUSIVE from a verdict; ``aborted`` from an abort record or a dead starter; else ``running``."""
    if verdict is not None:
        return verdict["verdict"]
    if aborted is not None:
        return ABORTED
    return RUNNING if process_alive(started["pid"], started["host"]) else ABORTED
