"""The oracle: the real promptfoo 0.123.1 grades a table of edge cases, and gatekeeper must agree on every one.

Each test's ``providerOutput`` is the text promptfoo grades (its echo provider, returning the prompt
``{{output}}``, where that is empty). gatekeeper reads the same config with its promptfoo loader (js-yaml's scalars, templating,
comma lists) and checks the same text. Outcomes: pass, fail, or refused (gatekeeper, exit 2 at load) where
promptfoo errors. Two refusals are gatekeeper's by design and are counted apart: an invalid regex (promptfoo
fails the assertion with "Invalid regex pattern") and an ``equals`` with no value, null or a YAML date
(promptfoo compares with the text "undefined", JSON null, or a Date that nothing equals).
"""

from __future__ import annotations

from collections import Counter

import pytest
from promptfoo_table import ABSENT, ROWS, Raw, config, promptfoo_results

from gatekeeper.battery import checks, promptfoo
from gatekeeper.errors import GatekeeperError

CLASSES = {"numbers", "commas", "empty", "regex", "is-json", "contains-json", "json-schema", "templating", "yaml", "strings", "utf-16",
           "undefined"}


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """promptfoo's outcome for every row, from one ``promptfoo eval`` (installed by ``make promptfoo``)."""
    return promptfoo_results(tmp_path_factory.mktemp("oracle"), config(), len(ROWS))


def _promptfoo(result: dict) -> tuple[str, str]:
    if result.get("error") and not (result.get("gradingResult") or {}).get("componentResults"):
        return "error", result["error"].splitlines()[0]
    component = result["gradingResult"]["componentResults"][0]
    return ("pass" if component["pass"] else "fail"), component.get("reason", "")


def _gatekeeper(config: dict, path, i: int, output: str) -> tuple[str, str]:
    try:
        test = {k: v for k, v in config["tests"][i].items() if k != "providerOutput"}  # the output gatekeeper checks
        (case,), skipped = promptfoo._cases({**config, "tests": [test]}, path)
    except GatekeeperError as e:
        return "refused", str(e)
    assert not skipped and len(case.assert_) == 1
    return ("pass" if checks.check(case.assert_[0], output) else "fail"), ""


def _by_design(row: tuple, pf: tuple[str, str]) -> bool:
    """gatekeeper's own refusals of what promptfoo grades without a usable value."""
    _, kind, value, _, _ = row
    if kind.endswith("regex") and pf[0] == "fail" and pf[1].startswith("Invalid regex pattern"):
        return True
    if pf[0] == "error" and "schema with key or id" in pf[1]:  # promptfoo's one ajv compiles a schema per test and
        return True  # refuses its $id the second time; gatekeeper checks every test against the schema
    vacuous = value is ABSENT or value is None or (isinstance(value, Raw) and value in ("~", "NULL", "2025-05-03"))
    return kind in ("equals", "not-equals") and vacuous and pf[0] in ("pass", "fail")


@pytest.mark.slow
def test_gatekeeper_agrees_with_promptfoo_on_every_row(graded):
    path, results = graded
    config = promptfoo._read(path)
    agree, by_design, disagree = Counter(), Counter(), []
    for i, row in enumerate(ROWS):
        cls, kind, value, output, _ = row
        result = results[i]
        if result.get("response"):  # an error has none
            graded_text = result["response"]["output"]
            assert graded_text == output, f"row {i}: promptfoo graded {graded_text[:80]!r}, not {output[:80]!r}"
        pf, gk = _promptfoo(result), _gatekeeper(config, path, i, output)
        if gk[0] == pf[0] or (gk[0] == "refused" and pf[0] == "error"):
            agree[cls] += 1
        elif (gk[0] == "refused" or pf[0] == "error") and _by_design(row, pf):
            by_design[cls] += 1
        else:
            shown = value if value is not ABSENT else "(no value)"
            disagree.append(f"row {i} [{cls}] {kind} {shown!r} on {output[:60]!r}: promptfoo {pf}, gatekeeper {gk[0]} {gk[1][:160]}")
    print(f"\noracle: {sum(agree.values())} of {len(ROWS)} rows agree, {sum(by_design.values())} refused by design; "
          f"by class: {dict(agree)}")
    assert not disagree, f"{len(disagree)} of {len(ROWS)} rows disagree:\n" + "\n".join(disagree)
    assert set(agree) == CLASSES, f"classes without an agreeing row: {CLASSES - set(agree)}"
    assert len(ROWS) >= 300
