"""``measure`` and ``calibrate`` take ``--skip-unsupported`` as ``evaluate`` does: a promptfoo suite holding an
assertion gatekeeper cannot evaluate is refused (exit 2, naming it, nothing written) unless it is given."""

from __future__ import annotations

import json

import pytest

CONFIG = """description: a promptfoo suite with one assertion gatekeeper cannot evaluate
providers: [echo]
prompts:
  - "You are a terse assistant for a travel desk. Answer in one line. Question: {{question}}"
tests:
  - description: arithmetic
    vars: {question: "What is 2+2?"}
    assert:
      - {type: contains-any, value: "4, four"}
      - {type: moderation}
  - description: colour
    vars: {question: "Name a colour"}
    assert:
      - {type: not-contains, value: zebra}
"""


@pytest.fixture
def pf_ws(tiny_ws):
    (tiny_ws / "assertions" / "faq.promptfoo.yaml").write_text(CONFIG)
    return tiny_ws


@pytest.mark.parametrize("command", [("measure", "--flag-state", "off"), ("calibrate", "--flag", "prefix_cache")])
def test_skip_unsupported(run_cli, pf_ws, command):
    args = ("--workspace", pf_ws, *command, "--engine", "tiny", "--suite", "faq", "--limit", "1", "--json")
    code, out, _ = run_cli(*args)
    assert code == 2 and "arithmetic: assertion 2 (moderation" in json.loads(out)["error"]
    assert "--skip-unsupported" in json.loads(out)["error"]
    assert not (pf_ws / "ledger" / "evidence.db").exists()  # nothing written
    code, out, err = run_cli(*args, "--skip-unsupported")
    assert code == 0, out + err
    result = json.loads(out)
    if command[0] == "measure":
        assert result["runs"][0]["stages"]["faq"]["calls"] == 1
    else:
        assert result["cases"] == 1 and result["faults"]
