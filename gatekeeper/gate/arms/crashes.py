"""Crashes as evidence: a server that took a case's request and failed it (a dropped connection, a 5xx,
a process that died) is recorded with the case, the side and what the server said, and decides the verdict
before any comparison does.

- A crash on the flag-on side only: FAIL. The flag-off side answered the same requests, so the crash comes
  with the flag.
- A crash on the flag-off side (alone or on both sides): INCONCLUSIVE. The baseline itself is broken, so
  nothing can be blamed on the flag.

Never PASS: a case without an answer was not compared.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from ...evidence import Crash as Record
from ...evidence import Run
from ..kinds import Decision

SHOWN = 5  # reasons name this many crashes; the ledger keeps every one with its case


@dataclass
class Crash:
    side: str  # off | on | alone
    run: int
    case: str
    record: Record


def found(runs: dict[str, list[Run]]) -> list[Crash]:
    """Every crashed case of every run (config -> one {case id: result} per repeat)."""
    return [Crash(side, r, cid, res["crash"]) for side, repeats in runs.items() for r, results in enumerate(repeats)
            for cid, res in results.items() if "crash" in res]


def decide(crashes: Iterable[Crash]) -> Decision | None:
    """The verdict crashes force, with a reason per crash; None when nothing crashed."""
    crashes = list(crashes)
    if not crashes:
        return None
    baseline = [c for c in crashes if c.side != "on"]
    reasons = [_reason(c) for c in (baseline or crashes)[:SHOWN]]
    rest = len(baseline or crashes) - SHOWN
    if rest > 0:
        reasons.append(f"crashed: and {rest} more, each recorded with its case in the ledger")
    if baseline:
        return "INCONCLUSIVE", reasons + ["crashed: the flag-off side crashed, so it is no baseline: nothing can be "
                                          "blamed on the flag; read the server's log, fix or restart it, and evaluate again"]
    return "FAIL", reasons + ["crashed: the flag-on side crashed where the flag-off side answered the same requests"]


def _reason(c: Crash) -> str:
    r = c.record
    request = ", ".join(f"{k} {v}" for k, v in r.get("request", {}).items() if k != "prompt_digest")
    side = {"off": "the flag-off side", "on": "the flag-on side"}.get(c.side, "the flag-off side, run alone")
    return (f"crashed: {c.case} on {side} ({c.side}#{c.run}, turn {r.get('turn')}): {r.get('message')} "
            f"[request: {request or 'n/a'}; said: {r.get('said')}]")
