"""promptfoo's ``transform`` in gatekeeper: read from a config (a test's options, defaultTest's, an assertion's
own), run in the script worker before the assertions grade, recorded in the outcomes, and part of the battery
digest. promptfoo's own verdict on each shape is in tests/test_promptfoo_oracle_transform.py.
"""

from __future__ import annotations

import pytest
from conftest import evaluate, ledger

from gatekeeper.battery import checks
from gatekeeper.battery import suites as battery
from gatekeeper.battery.suites import all_suites
from gatekeeper.errors import GatekeeperError
from gatekeeper.workspace import Workspace

CONFIG = """prompts: ["Say hello to {{name}}"]
defaultTest:
  options: {transform: file://shape.js}
tests:
  - description: shaped
    vars: {name: Porto}
    assert:
      - {type: javascript, value: "output.name === 'Porto' && output.length > 0"}
      - {type: equals, transform: "output.name", value: Porto}
      - {type: contains, value: '"name":"Porto"'}
  - description: own
    vars: {name: Lisbon}
    options: {transform: "output.length"}
    assert:
      - {type: python, value: "isinstance(output, int)"}
"""
SHAPE = "module.exports = (output, context) => ({name: context.vars.name, length: output.length});\n"


@pytest.fixture
def config_ws(tiny_ws):
    (tiny_ws / "assertions" / "tiny.yaml").unlink()
    (tiny_ws / "assertions" / "hello.promptfoo.yaml").write_text(CONFIG)
    (tiny_ws / "assertions" / "shape.js").write_text(SHAPE)
    return tiny_ws


def test_transforms_are_read_onto_each_assertion(config_ws):
    shaped, own = all_suites(Workspace(config_ws))["hello"].cases
    shape = f"file://{config_ws / 'assertions' / 'shape.js'}"
    assert [a.options for a in shaped.assert_] == [
        {"output_transform": shape}, {"output_transform": shape, "transform": "output.name"}, {"output_transform": shape}]
    assert own.assert_[0].options == {"output_transform": "output.length"}  # the test's own wins over defaultTest's
    context = checks.Context(vars=shaped.vars, prompt="Say hello to Porto")
    assert [o["pass"] for o in checks.outcomes(shaped.assert_, "hi", context)] == [True, True, True]
    assert [o["pass"] for o in checks.outcomes(own.assert_, "hi", checks.Context(vars=own.vars))] == [True]


def test_a_transform_that_fails_fails_every_assertion_it_feeds_not_or_not(config_ws):
    (config_ws / "assertions" / "shape.js").write_text("module.exports = () => { throw new Error('bad shape'); };\n")
    shaped, _ = all_suites(Workspace(config_ws))["hello"].cases
    outcomes = checks.outcomes(shaped.assert_, "hi", checks.Context(vars=shaped.vars))
    assert [o["pass"] for o in outcomes] == [False, False, False]
    assert outcomes[0]["reason"] == "Transform failed ([file transform]): bad shape"
    from gatekeeper.workspace import Assertion

    nothing = Assertion(type="not-contains", value="x", options={"transform": "undefined"})
    got = checks.evaluate(nothing, "abc")
    assert got["pass"] is False and got["reason"].startswith("Transform function did not return a value")


def test_the_battery_digest_follows_a_transform_file(config_ws, tmp_path):
    import shutil

    def battery_digest(root):
        ws = Workspace(root)
        return battery.battery_digest(ws, battery.read(ws, ["hello"]))

    before = battery_digest(config_ws)
    assert battery_digest(shutil.copytree(config_ws, tmp_path / "moved")) == before
    (config_ws / "assertions" / "shape.js").write_text(SHAPE + "// edited\n")
    assert battery_digest(config_ws) != before


@pytest.mark.parametrize("options, message", [
    ("{transform: file://none.js}", r"hello.promptfoo.yaml.*file://none.js not found"),
    ("{transform: file://shape.rb}", r"transform file://.*shape.rb: promptfoo runs transforms from JavaScript, TypeScript or Python"),
    ("{transform: 3}", r"field 'transform': JavaScript code or file://PATH\[:function\]"),
    ("{prefix: 'x'}", r"field 'options.prefix': not supported by gatekeeper"),
])
def test_bad_transforms_are_refused_naming_the_file(config_ws, options, message):
    (config_ws / "assertions" / "shape.rb").write_text("")
    (config_ws / "assertions" / "hello.promptfoo.yaml").write_text(CONFIG.replace("{transform: file://shape.js}", options))
    with pytest.raises(GatekeeperError, match=message):
        all_suites(Workspace(config_ws))


@pytest.mark.slow
def test_evaluate_records_outcomes_on_the_transformed_output(run_cli, config_ws):
    code, out = evaluate(run_cli, config_ws, "tiny")
    assert code in (0, 1) and out["verdict"] in ("PASS", "FAIL", "INCONCLUSIVE"), out
    (ev,) = ledger(config_ws).evaluations()
    results = ledger(config_ws).evaluation(ev["id"])["case_results"]
    by_case = {}
    for r in results:
        by_case.setdefault(r["case_id"], []).append([o["pass"] for o in r["result"]["outcomes"]])
    assert all(runs == [[True, True, True]] * len(runs) for runs in by_case.values() if len(runs[0]) == 3), by_case
    assert any(runs[0] == [True] for runs in by_case.values()), by_case
