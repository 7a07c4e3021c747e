"""The oracle for config shapes: the real promptfoo 0.123.1 runs each config with its ``echo`` provider (the
output is the rendered prompt), and gatekeeper's reading of the same config must give the same set of
(prompt label, test, rendered prompt, assertion outcomes): several prompts, ``---`` files, bare paths, globs,
labels, chat files, a test's ``prompts`` filter, ``assertionTemplates`` and ``defaultTest`` merges.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gatekeeper.battery import checks, promptfoo
from gatekeeper.battery.partition import fill
from gatekeeper.battery.promptfoo.prompts import read_prompts
from gatekeeper.setup import promptfoo as promptfoo_build

CONFIGS = {
    "prompts": {
        "promptfooconfig.yaml": """providers: [echo]
prompts:
  - "Inline {{q}}"
  - prompts.txt
  - {id: file://long.txt, label: long}
  - file://chat.json
  - file://p/*.txt
  - "Rate {{q}} from * to *****"
tests:
  - description: first
    vars: {q: Paris}
    assert: [{type: contains, value: Inline}, {type: icontains, value: 'text TWO'}]
  - description: second
    vars: {q: Rome}
    prompts: [long, "Inline {{q}}"]
    assert: [{type: not-contains, value: Rome}]
  - description: third
    vars: {q: [Oslo, Bern]}
    assert: [{type: starts-with, value: Glob}]
""",
        "prompts.txt": "\n Text one {{q}} \n---\n\nText two {{q}}\r\n  ---  \n   \n---\nText three:\n\n{{q}}\n\n",
        "long.txt": "  Long {{q}}\n",
        "chat.json": '[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "{{q}}"}]',
        "p/a.txt": "Glob A {{q}}", "p/b.txt": "Glob B {{q}}\n---\nGlob C {{q}}",
    },
    "labels": {
        "promptfooconfig.yaml": """providers: [echo]
prompts:
  file://one.txt: concise
  file://chat.yaml: chat
defaultTest: file://default.yaml
tests: tests.csv
""",
        "one.txt": "Briefly: {{q}}\n---\nIn one word: {{q}} ({{tone}})",
        "chat.yaml": "- {role: system, content: 'Tone: {{tone}}'}\n- {role: user, content: '{{q}}'}\n",
        "default.yaml": "vars: {tone: dry}\nassert: [{type: icontains, value: '{{q}}'}]\nprompts: [concise]\n",
        "tests.csv": "q,__expected,__description\nParis,contains:word,capital\nOslo,not-contains:dry,north\n",
    },
    "templates": {
        "promptfooconfig.yaml": """providers: [echo]
assertionTemplates:
  mentions: {type: icontains, value: '{{q}}'}
  polite: {type: contains-any, value: 'please, thanks'}
prompts: prompt.txt
defaultTest:
  vars: {tone: dry}
  assert:
    - $ref: '#/assertionTemplates/mentions'
    - {type: not-contains, value: warm}
tests:
  - description: merged
    vars: {q: Paris, tone: warm}
    assert: [{$ref: '#/assertionTemplates/polite'}, {$ref: '#/assertionTemplates/mentions', metric: again}]
  - description: own only
    vars: {q: Rome}
    options: {disableDefaultAsserts: true}
    assert: [{type: contains, value: dry}]
""",
        "prompt.txt": "Say please to {{q}}, {{tone}}.\n",
    },
}


def _messages(raw: str) -> str:
    """A rendered prompt as messages (promptfoo sends a JSON list of {role, content} as a chat)."""
    try:
        parsed = json.loads(raw)
    except ValueError:
        parsed = None
    chat = isinstance(parsed, list) and all(isinstance(m, dict) and "role" in m for m in parsed)
    return json.dumps(parsed if chat else [{"role": "user", "content": raw}])


def _promptfoo(folder: Path) -> dict:
    """(prompt label, test description, rendered messages) -> (promptfoo's output, its assertion outcomes)."""
    out = folder / "out.json"
    run = promptfoo_build.eval_config(folder / "promptfooconfig.yaml", out)
    assert out.is_file(), f"promptfoo eval wrote no results (exit {run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    rows = {}
    for r in json.loads(out.read_text(encoding="utf-8"))["results"]["results"]:
        assert (r.get("gradingResult") or {}).get("componentResults"), r.get("error")  # graded, not an error
        key = (r["prompt"]["label"], r["testCase"].get("description"), _messages(r["prompt"]["raw"]))
        rows[key] = (r["response"]["output"], tuple(c["pass"] for c in r["gradingResult"]["componentResults"]))
    return rows


def _gatekeeper(folder: Path, graded: dict) -> dict:
    """The same keys from gatekeeper's suites, each case's assertions checked on promptfoo's output for it."""
    path = folder / "promptfooconfig.yaml"
    prompts = read_prompts(promptfoo._read(path), path)
    by_name = dict(zip(promptfoo._unique([f"oracle.{p.name}" for p in prompts]), prompts))
    rows = {}
    for suite in promptfoo.load_suites(path, "oracle"):
        prompt = by_name[suite.suite] if len(prompts) > 1 else prompts[0]
        for case in suite.cases:
            messages = json.dumps([{"role": s.role, "content": fill(s.text, case.vars)} for s in suite.prompt])
            key = (prompt.label, None if case.id.startswith("test ") else case.id.split(" [")[0], messages)
            output = graded[key][0] if key in graded else ""
            rows[key] = (output, tuple(o["pass"] for o in checks.outcomes(case.assert_, output)))
    return rows


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_gatekeeper_reads_each_shape_as_promptfoo_does(tmp_path, name):
    assert promptfoo_build.installed(), "promptfoo is not installed: run 'make promptfoo' (python -m gatekeeper.setup.promptfoo)"
    for file, text in CONFIGS[name].items():
        (tmp_path / file).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / file).write_text(text, encoding="utf-8", newline="")
    expected = _promptfoo(tmp_path)
    got = _gatekeeper(tmp_path, expected)
    assert len(expected) >= 2
    assert set(got) == set(expected), f"only promptfoo: {sorted(set(expected) - set(got))}\nonly gatekeeper: {sorted(set(got) - set(expected))}"
    assert got == expected, [(k, expected[k][1], got[k][1]) for k in expected if got[k] != expected[k]]
