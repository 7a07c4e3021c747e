"""The assertion battery: selected suites and cases, validated before anything runs."""

from __future__ import annotations

from dataclasses import dataclass

from .checks import validate_suite
from .errors import GatekeeperError
from .identity import digest
from .partition import missing_vars
from .workspace import Case, Suite, Workspace


@dataclass(frozen=True)
class Item:
    suite: Suite
    case: Case

    @property
    def case_id(self) -> str:
        return f"{self.suite.suite}/{self.case.id}"


def load(ws: Workspace, suites: list[str] | None = None, limit: int | None = None) -> list[Item]:
    """Cases of the chosen suites in file order; ``limit`` caps the cases per suite."""
    available = ws.suites
    chosen = suites or list(available)
    unknown = [s for s in chosen if s not in available]
    if unknown:
        raise GatekeeperError(f"unknown suite {unknown[0]!r} (suites in {ws.root / 'assertions'}: {', '.join(available)}); fix --suite")
    problems = [p for name in chosen for p in validate_suite(available[name]) + missing_vars(available[name])]
    if problems:
        where = ", ".join(str(available[n].path) for n in chosen)
        raise GatekeeperError(f"battery invalid ({where}):\n  " + "\n  ".join(problems))
    items = [Item(available[name], case) for name in chosen for case in available[name].cases[:limit]]
    if limit is not None and limit < 1:
        raise GatekeeperError("--limit must be at least 1")
    return items


def battery_digest(ws: Workspace, items: list[Item]) -> str:
    """Content digest of exactly what runs: suites (with segment file texts) and the chosen cases."""
    suites = {i.suite.suite: i.suite for i in items}
    return digest({
        name: {
            "suite": s.model_dump(mode="json", by_alias=True),
            "texts": [ws.segment_text(s, seg) for seg in s.prompt],
            "cases": [i.case.id for i in items if i.suite.suite == name],
        }
        for name, s in sorted(suites.items())
    })
