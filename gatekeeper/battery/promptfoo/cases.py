"""A promptfoo config's tests as gatekeeper cases, each test merged with ``defaultTest`` as promptfoo merges it.

A test's options and vars go over defaultTest's (an option that changes what is graded is refused, naming
where it was set), its vars expand into one case each and are templated into its assertions (defaultTest's
first), and ``cost``/``latency`` assertions (about the call, not the output) are noted in
``Suite.call_metrics``. Each test keeps the prompts its ``prompts:`` selects.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ...errors import GatekeeperError
from ...js import nunjucks
from ...workspace import Case
from .. import checks
from .assertions import _assertion
from .config import (
    CHANGES_OUTPUT,
    GRADING_OPTIONS,
    OUTPUT_TRANSFORMS,
    RUN_OPTIONS,
    TEST_KEYS,
    _default_test,
    _mapping,
    _test_keys,
)
from .files import warn
from .tests import _Test, _tests
from .variables import _combinations, _prompt_var, _var_value

CALL_METRICS = {"cost": "what the call cost", "latency": "how long the call took"}  # not properties of the output


@dataclass(frozen=True)
class _Cases:
    """A test's cases and what was left out of them, with the prompts it runs on (None: all)."""

    cases: list[Case]
    skipped: list[str]
    call_metrics: list[str]
    prompts: list[str] | None


def _options(default: dict, raw: dict, path: Path, test: _Test) -> dict:
    """The test's options over defaultTest's; one that changes what is graded is refused, naming where it was set."""
    own = _mapping(raw.get("options"), test.where, "options")
    merged = {**_mapping(default.get("options"), str(path), "defaultTest.options"), **own}
    for key in merged:
        where = test.where if key in own else f"{path}: defaultTest (applies to every test)"
        if key in CHANGES_OUTPUT and merged[key] is not None:
            raise GatekeeperError(f"{where}: field 'options.{key}': not supported by gatekeeper (it changes what is "
                                  "rendered or graded); remove it")
        if key not in CHANGES_OUTPUT + GRADING_OPTIONS + OUTPUT_TRANSFORMS and key not in RUN_OPTIONS:
            warn(where, f"field 'options.{key}' is ignored: not a promptfoo test "
                        "option (promptfoo ignores it too); check its spelling")
    return merged


def _cases(config: dict, path: Path) -> tuple[list[Case], tuple[str, ...]]:
    """The config's cases in test order and the assertions left out of them."""
    per_test = _test_cases(config, path)
    return [c for t in per_test for c in t.cases], tuple(s for t in per_test for s in t.skipped)


def _test_cases(config: dict, path: Path) -> list[_Cases]:
    default = _default_test(config, path)
    out, seen = [], set()
    for n, test in enumerate(_tests(config, path), 1):
        raw = test.raw
        _test_keys(raw, test.where, TEST_KEYS)
        options = _options(default, raw, path, test)
        vars = {**_mapping(default.get("vars"), str(path), "defaultTest.vars"), **_mapping(raw.get("vars"), test.where, "vars")}
        expand = not options.get("disableVarExpansion")
        vars = {k: _var_value(v, test.base or path.parent, test.where, expand) for k, v in vars.items()}
        own = raw.get("assert") or []
        defaults = [] if options.get("disableDefaultAsserts") is True else default.get("assert") or []
        prompts = raw.get("prompts", default.get("prompts"))
        if prompts is not None and not (isinstance(prompts, list) and all(isinstance(p, str) for p in prompts)):
            raise GatekeeperError(f"{test.where}: field 'prompts' must be a list of prompt labels; fix it")
        combos = _combinations(vars, expand)
        cases, skipped, call_metrics = [], [], []
        for k, combo in enumerate(combos, 1):
            combo = nunjucks.prompt_vars(combo)  # promptfoo's renderPrompt prepares the vars its assertions see too
            base_id = str(raw.get("description") or f"test {n}") + (f" [{k}]" if len(combos) > 1 else "")
            case_id = base_id if base_id not in seen else f"{base_id} (test {n})"
            seen.add(case_id)
            kept = []
            for m, a in enumerate([*defaults, *own], 1):
                if m <= len(defaults):
                    where = f"{path}: defaultTest, assertion {m} (in {test.where.removeprefix(str(path) + ', ')})"
                else:
                    label = f" ({raw['description']})" if raw.get("description") and not test.csv_line else ""
                    where = f"{test.where}{label}, assertion {m - len(defaults)}"
                kind = a.get("type") if isinstance(a, dict) else None
                if isinstance(kind, str) and checks.base_type(kind) in CALL_METRICS:
                    call_metrics.append(f"{case_id}: assertion {m} ({kind}: {CALL_METRICS[checks.base_type(kind)]}, "
                                        "not a property of the output, which is what gatekeeper compares)")
                    continue
                result = _assertion(a, combo, path, where, options)
                if isinstance(result, str):
                    skipped.append(f"{case_id}: assertion {m} ({result})")
                else:
                    kept.append(result)
            cases.append(Case(id=case_id, vars={k2: _prompt_var(v) for k2, v in combo.items()}, assert_=kept))
        out.append(_Cases(cases, skipped, call_metrics, prompts))
    return out
