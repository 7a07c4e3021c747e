"""The oracle for model-graded assertions: gatekeeper's grader is sent the prompt the real promptfoo 0.123.1
sends, byte for byte, and the same reply gives the same pass or fail.

promptfoo grades through a recording provider (a ``file://`` JavaScript provider: it appends each prompt it
receives to a file and answers a fixed reply chosen by what the prompt holds); gatekeeper reads the same
config with its promptfoo loader and grades the same output with a planted grader answering the same replies.
"""

from __future__ import annotations

import json

import pytest

from gatekeeper.battery import checks, partition, promptfoo
from gatekeeper.gate.run.runs import promptfoo_prompt
from gatekeeper.setup import promptfoo as promptfoo_build
from gatekeeper.workspace import Workspace

RECORDER = """\
const fs = require('fs');
module.exports = class Recorder {
  constructor(options) { this.config = options.config; }
  id() { return 'recorder'; }
  async callApi(prompt) {
    fs.appendFileSync(this.config.record, JSON.stringify({tag: this.config.tag, prompt}) + '\\n');
    const hit = (this.config.replies || []).find(([needle]) => prompt.includes(needle));
    return {output: hit ? hit[1] : this.config.reply};
  }
};
"""

OUTPUT = "Paris is the capital of France."
JSON_OUTPUT = '{"city": "Paris", "population": 2.1e6, "ok": true}'
# (name, assertion, reply or [needle, reply] pairs, provider output, extra vars)
ROWS = [
    ("rubric default, pass", {"type": "llm-rubric", "value": "Names the capital of {{country}}"},
     'Looks right. {"reason": "names Paris", "pass": true, "score": 1.0}', OUTPUT, {}),
    ("rubric default, fail", {"type": "llm-rubric", "value": "Mentions Berlin"},
     '{"reason": "no Berlin", "pass": false, "score": 0}', OUTPUT, {}),
    ("rubric default, JSON output", {"type": "llm-rubric", "value": "Gives a population"},
     '{"pass": true, "score": 0.9}', JSON_OUTPUT, {"meta": {"source": "atlas", "year": 2024}}),
    ("rubric threshold", {"type": "llm-rubric", "value": "Is precise", "threshold": 0.8},
     '{"pass": true, "score": 0.5, "reason": "vague"}', OUTPUT, {}),
    ("not-rubric, unreadable reply", {"type": "not-llm-rubric", "value": "Is rude"}, "I would rather not say.", OUTPUT, {}),
    ("rubric custom text", {"type": "llm-rubric", "value": "Is about {{country}}",
                            "rubricPrompt": "Grade this: {{ output }}\nRule: {{ rubric }}\nCountry: {{country}}\nAnswer JSON."},
     '{"pass": false, "reason": "off topic"}', OUTPUT, {}),
    ("rubric custom chat", {"type": "llm-rubric", "value": "Is short",
                            "rubricPrompt": [{"role": "system", "content": "You grade. Reply {\"pass\": bool}."},
                                             {"role": "user", "content": "Output: {{output}}\nRubric: {{rubric}}\nMeta: {{meta}}"}]},
     '{"pass": true}', OUTPUT, {"meta": {"source": "atlas"}}),
    ("closedqa Y", {"type": "model-graded-closedqa", "value": "names a European capital"},
     "Paris is in Europe.\nY\nY", OUTPUT, {}),
    ("closedqa N", {"type": "model-graded-closedqa", "value": "names an Asian capital"}, "No.\nN\nN", OUTPUT, {}),
    ("factuality superset", {"type": "factuality", "value": "Paris"},
     '{"category": "B", "reason": "adds detail"}', OUTPUT, {}),
    ("factuality disagree", {"type": "factuality", "value": "Lyon is the capital of France."},
     '{"category": "D", "reason": "Lyon"}', OUTPUT, {}),
    ("model-graded-factuality legacy", {"type": "model-graded-factuality", "value": "Paris"}, "(C) The same facts.", OUTPUT, {}),
    ("g-eval", {"type": "g-eval", "value": "The answer is correct"},
     [["EVALUATION CRITERIA", '{"steps": ["Check the city", "Check the country"]}'],
      ["Evaluation Steps", '{"score": 8, "reason": "correct city"}']], OUTPUT, {}),
    ("context-recall", {"type": "context-recall", "value": "Paris is the capital of France."},
     "1. Paris is the capital of France. It is in the context. So [Attributed]", OUTPUT,
     {"context": "France's capital is Paris. It lies on the Seine."}),
]


def _config(record, outputs: bool = True) -> str:
    """The config promptfoo runs (each test's ``providerOutput`` the text graded) or, without the outputs, the one
    gatekeeper reads (it has no fixed outputs: the model answers)."""
    tests = []
    for i, (name, assertion, reply, output, extra) in enumerate(ROWS):
        provider = {"id": "file://recorder.cjs", "config": {"record": str(record), "tag": i,
                                                            **({"replies": reply} if isinstance(reply, list) else {"reply": reply})}}
        tests.append({"description": name, "vars": {"question": "What is the capital of France?", "country": "France", **extra},
                      **({"providerOutput": output} if outputs else {}), "assert": [{**assertion, "provider": provider}]})
    return json.dumps({"description": "graded oracle", "providers": ["echo"], "prompts": ["Q: {{question}}"], "tests": tests})


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    """promptfoo's grading prompts and outcomes for every row, from one ``promptfoo eval``."""
    assert promptfoo_build.installed(), "promptfoo is not installed: run 'make promptfoo' (python -m gatekeeper.setup.promptfoo)"
    folder = tmp_path_factory.mktemp("graded-oracle")
    (folder / "recorder.cjs").write_text(RECORDER)
    record = folder / "prompts.jsonl"
    path = folder / "graded.promptfoo.yaml"
    path.write_text(_config(record), encoding="utf-8")
    out = folder / "out.json"
    run = promptfoo_build.eval_config(path, out)
    assert out.is_file(), f"promptfoo eval wrote no results (exit {run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    results = {r["testIdx"]: r for r in json.loads(out.read_text(encoding="utf-8"))["results"]["results"]}
    prompts: dict[int, list[str]] = {}
    for line in record.read_text(encoding="utf-8").splitlines():
        entry = json.loads(line)
        prompts.setdefault(entry["tag"], []).append(entry["prompt"])
    mine = folder / "gatekeeper.promptfoo.yaml"
    mine.write_text(_config(record, outputs=False), encoding="utf-8")
    return mine, results, prompts


class Planted:
    """The same replies as the recorder's, chosen the same way; keeps the prompts it was sent."""

    engine, embedder = "planted", None

    def __init__(self, reply):
        self.reply, self.prompts = reply, []

    def complete(self, prompt: str) -> str:
        self.prompts.append(prompt)
        if isinstance(self.reply, list):
            return next(r for needle, r in self.reply if needle in prompt)
        return self.reply


@pytest.mark.slow
@pytest.mark.parametrize("i", range(len(ROWS)), ids=[r[0] for r in ROWS])
def test_gatekeeper_sends_promptfoos_grading_prompt_and_decides_alike(oracle, i):
    path, results, prompts = oracle
    _, _, reply, output, _ = ROWS[i]
    assert results[i]["response"]["output"] == output
    pf_pass = results[i]["gradingResult"]["componentResults"][0]["pass"]

    suite = promptfoo.load_suites(path, "graded")[0]
    case = suite.cases[i]
    (a,) = case.assert_
    messages = partition.messages(partition.order(partition.pieces(Workspace(path.parent.parent), suite, case.vars), "partitioned"))
    grader = Planted(reply)
    outcome = checks.evaluate(a, output, checks.Context(vars=case.vars, prompt=promptfoo_prompt(messages), graders=grader))
    assert grader.prompts == prompts[i]  # byte for byte, every call
    assert outcome["pass"] == pf_pass, (outcome, results[i]["gradingResult"]["componentResults"][0])


@pytest.mark.slow
def test_promptfoo_itself_passed_and_failed_rows(oracle):
    """The rows exercise both outcomes in promptfoo too (a recorder that broke every grade would fail them all)."""
    _, results, prompts = oracle
    outcomes = {ROWS[i][0]: results[i]["gradingResult"]["componentResults"][0]["pass"] for i in range(len(ROWS))}
    assert outcomes["rubric default, pass"] and outcomes["closedqa Y"] and outcomes["factuality superset"]
    assert not (outcomes["rubric default, fail"] or outcomes["closedqa N"] or outcomes["factuality disagree"]
                or outcomes["rubric threshold"] or outcomes["not-rubric, unreadable reply"])
    assert len(prompts[[r[0] for r in ROWS].index("g-eval")]) == 2  # steps, then the evaluation
