"""Paired verdicts on the default model (llama.cpp, in process): a change that changes nothing (an A/A
rung: the same engine profile under another name) PASSes with enough cases, is INCONCLUSIVE
(underpowered) with few, and never FAILs; a heavy degradation (a random tiny model as the change) FAILs."""

from __future__ import annotations

import json

import pytest
from conftest import profile

from gatekeeper.gate.stats import paired
from gatekeeper.ledger import Ledger

pytestmark = pytest.mark.slow

# with nothing flipping, ruling out a 0.13 loss at a first look's alpha 0.025 (gate/stats/looks.py) takes 26 cases; 8 support
# only 0.25 at 0.05
MARGIN = 0.13
CASES = 27


def facts(ws, n: int) -> None:
    """``assertions/facts.yaml``: n one-turn questions the default model answers right, one assertion each."""
    questions = [("What is the capital of France?", "Paris"), ("What is the opposite of hot?", "cold"),
                 ("What is the capital of Japan?", "Tokyo"), ("What is the capital of Germany?", "Berlin"),
                 ("What is the capital of Italy?", "Rome"), ("What is the largest planet in our solar system?", "Jupiter")]
    lines = ["suite: facts\nstage: facts\nprompt:\n  - {role: system, static: true, text: \"Answer in a few words.\"}\n"
             "  - {role: user, static: false, text: \"{{query}}\"}\ndecoding: {max_tokens: 9}\ncases:"]
    for i in range(n):
        q, a = questions[i % len(questions)]
        lines.append(f"  - id: f{i}\n    vars: {{query: \"Question {i + 1}. {q}\"}}\n"
                     f"    assert: {json.dumps([{'type': 'icontains', 'value': a}])}")
    (ws / "assertions" / "facts.yaml").write_text("\n".join(lines) + "\n")


@pytest.fixture
def default_ws(workspace, tiny_llama):
    (workspace / "assertions" / "assistant.yaml").unlink()
    facts(workspace, CASES)
    llamacpp = (workspace / "engines" / "llamacpp.yaml").read_text()
    (workspace / "engines" / "same.yaml").write_text(llamacpp)  # the A/A rung: nothing changes but the name
    (workspace / "engines" / "random.yaml").write_text(profile("torch", tiny_llama))  # random weights
    for flag, engine in [("aa", "same"), ("ruin", "random")]:
        (workspace / "policies" / f"{flag}.yaml").write_text(
            f"flag: {flag}\ngate: non_inferiority\nmargin: {MARGIN}\nprobes: off\nchange: {{engine: {engine}}}\n")
    return workspace


def evaluate(run_cli, ws, flag, *extra):
    code, out, _ = run_cli("--workspace", ws, "evaluate", "--flag", flag, "--engine", "llamacpp", "--operator", "ci",
                           *extra, "--json")
    return code, json.loads(out)


def test_an_aa_change_passes_with_enough_cases_and_is_underpowered_with_few(run_cli, default_ws):
    code, out = evaluate(run_cli, default_ws, "aa")
    stats = out["paired"]
    assert (code, out["verdict"]) == (0, "PASS"), out["reasons"]
    assert out["passes"]["off"] == CASES  # the battery is one the model answers: the verdict is about the change
    assert (stats["harmful"], stats["beneficial"], stats["n"]) == (0, 0, CASES) and stats["upper"] <= MARGIN
    moved = out["distance"]["distance"]  # read teacher-forced: the same engine does not move
    assert moved["kld"]["max"] == 0 and moved["same_top1"] == 1, moved

    # the same answers, the first 8 cases only (what --limit 8 runs: the CLI path is tested on tiny models, in
    # test_declared.py and test_enablements.py): too few to rule the margin out
    with Ledger(f"sqlite:///{default_ws / 'ledger' / 'evidence.db'}") as lg:
        rows = lg.evaluation(out["evaluation_id"])["case_results"]
    outcome = {(r["case_id"], r["config"]): r["result"]["outcomes"][0]["pass"] for r in rows if r["repeat"] == 0}
    few = paired.decide([(f"facts/f{i}", outcome[(f"facts/f{i}", "off")], outcome[(f"facts/f{i}", "on")])
                         for i in range(8)], MARGIN)
    assert few.verdict == "underpowered" and few.upper > MARGIN and 8 < few.needed <= CASES, few.reason()


def test_a_random_model_as_the_change_fails(run_cli, default_ws):
    code, out = evaluate(run_cli, default_ws, "ruin")
    stats = out["paired"]
    assert (code, out["verdict"]) == (1, "FAIL"), out["reasons"]
    assert stats["harmful"] >= CASES - 4 and stats["lower"] > MARGIN, stats
    assert any(r.startswith("inferior:") for r in out["reasons"]), out["reasons"]
    # another tokenizer: the flag-off answers' token ids mean other text to the change, so no distance is read
    assert "tokenize text differently" in out["distance"]["not_observable"], out["distance"]
