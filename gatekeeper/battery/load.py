"""The assertion battery: selected suites and cases, validated before anything runs.

Assertion values are templated from the case's vars here (``{{ var }}``, as promptfoo does); promptfoo
suites arrive templated already, from their typed vars. A promptfoo assertion gatekeeper cannot
evaluate stops the load (exit 2) unless the workspace skips them (``evaluate --skip-unsupported``);
the skipped ones are then listed in the evaluation's reasons (``skipped:``).
"""

from __future__ import annotations

from dataclasses import dataclass
from weakref import WeakKeyDictionary

from ..js import nunjucks
from .checks import validate_suite
from ..errors import GatekeeperError
from ..identity import digest
from .partition import missing_vars
from ..workspace import ASSERTIONS, Case, Suite, Workspace, parse
from . import promptfoo


_SUITES: WeakKeyDictionary = WeakKeyDictionary()


def all_suites(ws: Workspace) -> dict[str, Suite]:
    """The workspace's suites by name, each read once: gatekeeper YAML suites and promptfoo configs alike."""
    if ws not in _SUITES:
        _SUITES[ws] = _read(ws)
    return _SUITES[ws]


def _read(ws: Workspace) -> dict[str, Suite]:
    out: dict[str, Suite] = {}
    for path in ws.files(ASSERTIONS):
        suite = promptfoo.load_suite(path, ws.root) if promptfoo.is_config(path) else parse(Suite, path, path=path)
        if suite.promptfoo is not None and not suite.cases:
            suite = promptfoo.with_cases(suite, ws.root)
        if suite.suite in out:
            raise GatekeeperError(f"{path}: field 'suite': {suite.suite!r} is already defined by {out[suite.suite].path}; rename one")
        for seg_no, seg in enumerate(suite.prompt):
            if seg.file and not (path.parent / seg.file).is_file() and not (ws.root / seg.file).is_file():
                raise GatekeeperError(f"{path}: field 'prompt.{seg_no}.file': {seg.file} not found (relative to the workspace or the suite's folder)")
        out[suite.suite] = suite
    if not out:
        raise GatekeeperError(f"{ws.root / ASSERTIONS}: no suites (*.yaml); add one or run 'gatekeeper init'")
    return out


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
    available = all_suites(ws)
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
