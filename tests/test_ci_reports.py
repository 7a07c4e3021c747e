"""Evidence where CI and reviewers look: ``evaluate --junit`` read back by a real JUnit parser, the CI
summary page, and ``ledger diff`` on real evaluations (a PASS, a FAIL from a planted fault, an
INCONCLUSIVE from a planted unstable baseline) of the tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import junitparser
import pytest
from conftest import SUITE, profile
from tiny_models import tiny_llama  # noqa: F401  (fixture)
from typer.testing import CliRunner

from gatekeeper.cli import app


def cli(ws: Path, *args, overrides=None):  # CliRunner sets these over this process's environment
    result = CliRunner().invoke(app, ["--workspace", str(ws), *map(str, args)], catch_exceptions=False, env=overrides)
    return result.exit_code, result.stdout, result.stderr


@pytest.fixture(scope="module")
def reports(tmp_path_factory, tiny_llama):
    """A workspace with three recorded evaluations, each with its JUnit file and CI summary."""
    from gatekeeper.setup.scaffold import init_workspace

    root = tmp_path_factory.mktemp("ci")
    ws = root / "ws"
    init_workspace(ws)
    policy = ws / "policies" / "prefix_cache.yaml"
    policy.write_text(policy.read_text() + "probes: off\n")  # these reports are about the battery's cases
    (ws / "assertions" / "assistant.yaml").unlink()
    (ws / "assertions" / "tiny.yaml").write_text(SUITE)
    for name, adapter in [("tiny", "torch"), ("short", "fault_engines:ShortRestore"), ("unstable", "fault_engines:Unstable")]:
        (ws / "engines" / f"{name}.yaml").write_text(profile(adapter, tiny_llama))
    summary = root / "summary.md"
    summary.write_text("earlier step\n")
    out = {"ws": ws, "summary": summary}
    for engine, verdict, code in [("tiny", "PASS", 0), ("short", "FAIL", 1), ("unstable", "INCONCLUSIVE", 1)]:
        junit = root / f"{engine}.xml"
        rc, stdout, _ = cli(ws, "evaluate", "--flag", "prefix_cache", "--engine", engine, "--junit", junit, "--json",
                            overrides={"GITHUB_STEP_SUMMARY": str(summary)})
        outcome = json.loads(stdout)
        assert (rc, outcome["verdict"]) == (code, verdict)
        out[verdict] = {"id": outcome["evaluation_id"], "outcome": outcome, "junit": junit}
    return out


def cases(path: Path) -> dict[str, list]:
    xml = junitparser.JUnitXml.fromfile(str(path))
    return {f"{case.classname.rsplit('.', 1)[1]}/{case.name}": case.result for suite in xml for case in suite}


def test_a_fail_is_one_failure_per_blamed_case_with_where_it_parted(reports):
    fail = reports["FAIL"]
    got = cases(fail["junit"])
    assert set(got) == {"tiny/a", "tiny/b", "tiny/c", "tiny/loop"}
    failed = {cid for cid, result in got.items() if result}
    assert failed == set(fail["outcome"]["differing_cases"]) and failed  # the planted shift was caught
    for cid in failed:
        (failure,) = got[cid]
        assert isinstance(failure, junitparser.Failure)
        assert failure.message.startswith(f"differs: {cid} turn ")
        assert "position" in failure.text and "margin" in failure.text and "flag on:" in failure.text
    xml = junitparser.JUnitXml.fromfile(str(fail["junit"]))
    suite = next(iter(xml))
    assert (suite.tests, suite.failures, suite.skipped, suite.errors) == (4, len(failed), 0, 0)


def test_inconclusive_skips_each_case_with_the_reason_that_names_it(reports):
    got = cases(reports["INCONCLUSIVE"]["junit"])
    assert got and all(len(r) == 1 and isinstance(r[0], junitparser.Skipped) for r in got.values())
    for cid, (skipped,) in got.items():
        assert skipped.message.startswith(f"baseline_unstable: {cid} ")


def test_a_pass_passes_every_case(reports):
    got = cases(reports["PASS"]["junit"])
    assert len(got) == 4 and not any(got.values())


def test_the_ci_summary_is_appended_per_evaluation(reports):
    text = reports["summary"].read_text()
    assert text.startswith("earlier step\n")
    for verdict in ("PASS", "FAIL", "INCONCLUSIVE"):
        assert f"evaluation {reports[verdict]['id']}: **{verdict}**" in text
    fail_part = text.split("**FAIL**")[1].split("### gatekeeper")[0]
    for cid in reports["FAIL"]["outcome"]["differing_cases"]:
        assert f"| `{cid}` | failure | differs: {cid} turn" in fail_part


def test_export_as_junit_is_the_file_evaluate_wrote(reports):
    fail = reports["FAIL"]
    rc, stdout, _ = cli(reports["ws"], "ledger", "export", fail["id"], "--format", "junit")
    assert rc == 0 and stdout == fail["junit"].read_text()


def test_a_junit_path_that_cannot_be_written_is_exit_2_before_anything_runs(reports, tmp_path):
    ws = reports["ws"]
    before = json.loads(cli(ws, "ledger", "list", "--json")[1])["evaluations"]
    rc, stdout, _ = cli(ws, "evaluate", "--flag", "prefix_cache", "--engine", "tiny",
                        "--junit", tmp_path / "missing" / "out.xml", "--json")
    assert rc == 2 and "--junit" in json.loads(stdout)["error"] and "existing folder" in json.loads(stdout)["error"]
    assert json.loads(cli(ws, "ledger", "list", "--json")[1])["evaluations"] == before


def test_diff_of_a_pass_and_a_planted_fail_names_the_changed_cases_and_identity(reports):
    ws, p, f = reports["ws"], reports["PASS"], reports["FAIL"]
    rc, stdout, _ = cli(ws, "ledger", "diff", p["id"], f["id"], "--json")
    d = json.loads(stdout)
    assert rc == 0 and (d["a"]["status"], d["b"]["status"]) == ("PASS", "FAIL") and d["verdict_changed"]
    assert set(d["changed_cases"]) == set(f["outcome"]["differing_cases"])
    for row in d["cases"]:
        assert row["a"]["status"] == "equal" and row["a"]["first_divergence"] is None
        if row["changed"]:
            where = row["b"]["first_divergence"]
            assert row["b"]["status"] == "differs" and where["position"] is not None and len(where["margins"]) == 2
        assert set(row["a"]["seconds"]) == {"off", "on"}
    parts = {r["part"]: (r["a"], r["b"]) for r in d["identity"]}
    assert parts["on.profile.adapter"] == ("torch", "fault_engines:ShortRestore")
    assert all(not k.endswith("model_digest") for k in parts)  # same weights on both
    assert {r["part"] for r in d["config"]} == {"engine"}
    rc, md, _ = cli(ws, "ledger", "diff", p["id"], f["id"], "--format", "md")
    assert rc == 0 and md.startswith(f"# gatekeeper: evaluation {p['id']} vs {f['id']}")
    assert f"{len(d['changed_cases'])} of 4 cases changed" in md and "`on.profile.adapter`" in md
    rc, table, _ = cli(ws, "ledger", "diff", p["id"], f["id"])
    assert rc == 0 and f"{len(d['changed_cases'])} of 4 cases changed" in table


def test_diff_of_an_evaluation_with_itself_changes_nothing(reports):
    i = reports["INCONCLUSIVE"]["id"]
    d = json.loads(cli(reports["ws"], "ledger", "diff", i, i, "--json")[1])
    assert d["changed_cases"] == [] and d["identity"] == [] and not d["verdict_changed"]
    assert all(r["a"] == r["b"] and r["a"]["status"] == "baseline_unstable" for r in d["cases"])


def test_diff_refuses_an_unknown_evaluation_and_format(reports):
    rc, stdout, _ = cli(reports["ws"], "ledger", "diff", reports["PASS"]["id"], 999, "--json")
    assert rc == 2 and "no evaluation 999" in json.loads(stdout)["error"]
    rc, stdout, _ = cli(reports["ws"], "ledger", "diff", 1, 2, "--format", "html", "--json")
    assert rc == 2 and "--format" in json.loads(stdout)["error"]


def test_an_aborted_evaluation_is_an_error_on_every_case_it_ran(reports, tmp_path):
    """An interrupted run has no verdict: its JUnit export must not read as passing."""
    from gatekeeper.ledger import open_ledger

    ws = reports["ws"]
    with open_ledger(f"sqlite:///{ws / 'ledger' / 'evidence.db'}", create=False) as ledger:
        done = ledger.evaluation(reports["PASS"]["id"])
        eid = ledger.start_evaluation("prefix_cache", "ci", done["gate"], done["identity"], done["config"])
        for r in done["case_results"][:2]:
            ledger.add_case_result(eid, r["case_id"], r["config"], r["repeat"], r["result"])
        ledger.abort_evaluation(eid, "interrupted")
    out = tmp_path / "aborted.xml"
    assert cli(ws, "ledger", "export", eid, "--format", "junit", "--output", out)[0] == 0
    got = cases(out)
    assert got and all(len(r) == 1 and isinstance(r[0], junitparser.Error) for r in got.values())
    assert all(r[0].message.startswith("aborted: the evaluation has no verdict (interrupted)") for r in got.values())
