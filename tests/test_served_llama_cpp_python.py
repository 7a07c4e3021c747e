"""The http adapter against llama-cpp-python's own server, through the real CLI: it reports no cached tokens, so it
is never a PASS on a "0" it did not measure, and it samples by its seed."""

from __future__ import annotations

import pytest
from conftest import ledger
from served import (
    evaluate,
    llama_cpp_python_server,
    profile,
    served_ws,
    started,
)

from gatekeeper.setup.models import find_gguf

pytestmark = pytest.mark.slow


# --- llama-cpp-python's server ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_cpp_python(tmp_path_factory):
    """Its "off" deployment (no prompt cache) and "on" (its RAM prompt cache): neither reports cached tokens."""
    logs = tmp_path_factory.mktemp("llama-cpp-python")
    stack, (off, on) = started(llama_cpp_python_server(find_gguf(), log=logs / "off.log"),
                               llama_cpp_python_server(find_gguf(), "--cache", "true", log=logs / "on.log"))
    with stack:
        yield {"off": off, "on": on}


def test_llama_cpp_python_is_not_observable_never_a_pass_on_zero(llama_cpp_python, workspace, run_cli):
    ws = served_ws(workspace, lcp=profile(llama_cpp_python["off"], llama_cpp_python["on"], "tokenizer: default"))
    code, out = evaluate(run_cli, ws, "lcp")
    assert code == 1, out
    assert out["verdict"] == "INCONCLUSIVE" and out["reasons"][0].startswith("not_observable:"), out["reasons"]
    assert out["tokens"]["cached_on"] is None and out["tokens"]["computed_on"] is None
    ev = ledger(ws).evaluation(out["evaluation_id"])
    assert ev["identity"]["on"]["engine"]["dialect"]["name"] == "openai"
    assert all(t["cached_tokens"] is None for r in ev["case_results"] for t in r["result"]["turns"])
    # a policy that explicitly accepts an unobservable cache may pass on outputs alone, and says so
    policy = ws / "policies" / "prefix_cache.yaml"
    policy.write_text(policy.read_text().replace("exercise_floor: {min_cached_share: 0.5}",
                                                 "exercise_floor: {min_cached_share: 0.5, accept_unobservable: true}"))
    code, out = evaluate(run_cli, ws, "lcp")
    assert code == 0 and out["verdict"] == "PASS", out["reasons"]
    assert any(r.startswith("not_observable:") and "(accepted" in r for r in out["reasons"])
    # its reuse is not exact: the top-2 logprobs moved, which the strength of the PASS shows
    assert out["strength"]["grade"] == "equal_outputs" and out["strength"]["max_drift"] > 0


def test_measure_prints_n_a_for_a_figure_the_server_does_not_report(llama_cpp_python, workspace, run_cli):
    ws = served_ws(workspace, lcp=profile(llama_cpp_python["off"], llama_cpp_python["on"], "tokenizer: default"))
    code, out, err = run_cli("--workspace", ws, "measure", "--engine", "lcp", "--limit", "1")
    assert code == 0, err
    row = next(line for line in out.splitlines() if line.strip().startswith("│ tiny") or " tiny " in line)
    assert "n/a" in row and " 0 " not in row.split("│")[4]


def test_evaluate_prints_its_table_when_the_server_reports_no_cached_tokens(llama_cpp_python, workspace, run_cli):
    """The table, not only --json: a figure the server does not report prints as n/a (it once crashed there, exit 3,
    with the verdict already in the ledger)."""
    ws = served_ws(workspace, lcp=profile(llama_cpp_python["off"], llama_cpp_python["on"], "tokenizer: default"))
    code, out, err = run_cli("--workspace", ws, "evaluate", "--flag", "prefix_cache", "--engine", "lcp",
                             "--operator", "ci", "--limit", "1")
    assert code == 1, err  # INCONCLUSIVE: not observable
    assert "verdict: INCONCLUSIVE" in out and "prefill saved with the flag on: n/a tokens" in out
    assert "not_observable:" in out and "internal error" not in out + err


def test_llama_cpp_python_samples_by_its_seed_and_refuses_penalties(llama_cpp_python, workspace, run_cli):
    """llama-cpp-python's server runs the suite's decoding with the draw's key as its seed, measured: the flag-off
    side's repeats under the same keys give the same answers, the samples of a case draw apart, and the sides pair.
    A penalty, which it counts over a window of its own setting, is exit 2 before anything runs."""
    from conftest import SHORT, suite

    ws = served_ws(workspace, lcp=profile(llama_cpp_python["off"], llama_cpp_python["on"], "tokenizer: default"))
    policy = ws / "policies" / "prefix_cache.yaml"
    policy.write_text(policy.read_text().replace("exercise_floor: {min_cached_share: 0.5}",
                                                 "exercise_floor: {min_cached_share: 0.5, accept_unobservable: true}"))
    decoding = "decoding: {max_tokens: 12, temperature: 0.9, top_p: 0.95, top_k: 40, samples: 2}"
    (ws / "assertions" / "tiny.yaml").write_text(suite(SHORT).replace("decoding: {max_tokens: 12}", decoding))
    code, out = evaluate(run_cli, ws, "lcp", "--limit", "2")
    s = out["sampling"]
    assert s["chain"]["sampler"] == "llama-cpp-python" and s["unpaired"] is None, s
    assert out["verdict"] == "PASS" and out["equal"]["baseline"] == 4, out["reasons"]  # seeds honoured on repeat
    assert s["answers"] == 4 and s["mismatches"] == 0 and s["steps"] > 4 and s["controls"]["unpaired"] == "seen", s
    ev = ledger(ws).evaluation(out["evaluation_id"])
    answers = {r["case_id"]: tuple(r["result"]["turns"][0]["tokens"]) for r in ev["case_results"] if r["config"] == "off"}
    assert any(answers[f"tiny/{c}~1"] != answers[f"tiny/{c}~2"] for c in "ab")  # the samples draw apart
    (ws / "assertions" / "tiny.yaml").write_text(suite(SHORT).replace(
        "decoding: {max_tokens: 12}", "decoding: {max_tokens: 12, temperature: 0.9, repetition_penalty: 1.1}"))
    code, refused = evaluate(run_cli, ws, "lcp")
    assert code == 2 and "field 'decoding'" in refused["error"] and "last_n_tokens_size" in refused["error"], refused
