"""The assertion battery: selected suites and cases, validated before anything runs.

Assertion values are templated from the case's vars here (``{{ var }}``, as promptfoo does); promptfoo
suites arrive templated already, from their typed vars. A promptfoo assertion gatekeeper cannot
evaluate stops the load (exit 2) unless the workspace skips them (``evaluate --skip-unsupported``);
the skipped ones are then listed in the evaluation's reasons (``skipped:``).
"""

from __future__ import annotations

from dataclasses import dataclass

from . import nunjucks
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


def load(ws: Workspace, suites: list[str] | None = None, limit: int | None = None, *,
         skip_unsupported: bool = False) -> list[Item]:
    """Cases of the chosen suites in file order; ``limit`` caps the cases per suite; ``skip_unsupported``
    leaves out promptfoo assertions gatekeeper cannot evaluate instead of refusing them."""
    available = ws.suites
    chosen = suites or list(available)
    unknown = [s for s in chosen if s not in available]
    if unknown:
        raise GatekeeperError(f"unknown suite {unknown[0]!r} (suites in {ws.root / 'assertions'}: {', '.join(available)}); fix --suite")
    rendered = {name: _templated(available[name]) for name in chosen}
    problems = [p for name in chosen for p in rendered[name][1] + validate_suite(rendered[name][0]) + missing_vars(available[name])]
    if problems:
        where = ", ".join(str(available[n].path) for n in chosen)
        raise GatekeeperError(f"battery invalid ({where}):\n  " + "\n  ".join(problems))
    if limit is not None and limit < 1:
        raise GatekeeperError("--limit must be at least 1")
    items = [Item(available[name], case) for name in chosen for case in rendered[name][0].cases[:limit]]
    ids = {i.case.id for i in items}
    unsupported = [f"{available[name].path}: {s}" for name in chosen for s in available[name].skipped if s.split(": assertion ")[0] in ids]
    if unsupported and not skip_unsupported:
        raise GatekeeperError("promptfoo assertions gatekeeper cannot evaluate deterministically:\n  " + "\n  ".join(unsupported)
                              + "\nremove them, or pass --skip-unsupported to evaluate without them")
    return items


def skipped(items: list[Item]) -> list[str]:
    """``skipped:`` reasons: the promptfoo assertions of these cases that were left out."""
    ids = {(i.suite.suite, i.case.id) for i in items}
    suites = {i.suite.suite: i.suite for i in items}
    return [f"skipped: {name}/{s}" for name, suite in suites.items() for s in suite.skipped
            if (name, s.split(": assertion ")[0]) in ids]


def _templated(suite: Suite) -> tuple[Suite, list[str]]:
    """The suite with each case's assertion values rendered from its vars (the last turn's win), and problems."""
    if suite.promptfoo is not None:
        return suite, []
    cases, problems = [], []
    for case in suite.cases:
        vars = {**case.vars, **{k: v for turn in case.turns for k, v in turn.items()}}
        asserts = []
        for n, a in enumerate(case.assert_, 1):
            try:
                asserts.append(a.model_copy(update={"value": nunjucks.render_value(a.value, vars)}))
            except ValueError as e:
                problems.append(f"suite {suite.suite!r}, case {case.id!r}, assertion {n} ({a.name or a.type}): {e}")
                asserts.append(a)
        cases.append(case.model_copy(update={"assert_": asserts}))
    return suite.model_copy(update={"cases": cases}), problems


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
