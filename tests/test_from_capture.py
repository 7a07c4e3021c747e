"""``battery from-capture``: real traffic (a real ``gatekeeper proxy`` in front of a real llama-server)
turned into candidate cases that ``evaluate`` accepts; a metadata-only capture, a garbage file and an
assertion gate without assertions are exit 2 with nothing written."""

from __future__ import annotations

import json

import pytest
import yaml
from served import evaluate, llama_server, served_ws
from test_proxy import call, lines, proxy

from gatekeeper.setup.models import find_gguf

pytestmark = pytest.mark.slow
SYSTEM = ("You are the support desk of a train company. Answer in one short sentence. Tickets can be changed "
          "up to one hour before departure; refunds take five working days; bikes travel free off-peak.")
QUESTIONS = ["Can I change my ticket?", "How long does a refund take?", "Can I bring my bike?",
             "Can I change my ticket?",  # a duplicate: dropped
             "Is there wifi on board?"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with llama_server(find_gguf(), "-fa", "off", log=tmp_path_factory.mktemp("logs") / "server.log") as url:
        yield url


def captured(server, path, *extra):
    with proxy(server, path, *extra) as (where, _):
        for n, q in enumerate(QUESTIONS):
            status, _ = call(where, "/v1/chat/completions",
                             {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
                              "max_tokens": 4, "temperature": 0},
                             {"X-Gatekeeper-Stage": "support", "X-Gatekeeper-Stream": f"s{n}"})
            assert status == 200
        assert len(lines(path, len(QUESTIONS))) == len(QUESTIONS)
    return path


def from_capture(run_cli, ws, capture, *extra):
    code, out, _ = run_cli("--workspace", ws, "battery", "from-capture", capture, *extra, "--json")
    return code, json.loads(out)


def test_captured_calls_become_cases_the_gate_accepts(server, workspace, run_cli, tmp_path):
    ws = served_ws(workspace, served=f"adapter: http\nurl: {server}\ncache_switch: cache_prompt\ntimeout: 600\n")
    cap = captured(server, tmp_path / "capture.jsonl")
    code, report = from_capture(run_cli, ws, cap, "--out", ws / "assertions", "--max-tokens", "8")
    assert code == 0, report
    assert report["stages"]["support"]["cases"] == len(QUESTIONS) - 1  # the repeated question is dropped
    doc = yaml.safe_load((ws / "assertions" / "captured-support.yaml").read_text())
    static, dynamic = doc["prompt"]
    assert static == {"role": "prompt", "static": True, "file": "captured-support.prefix.txt"}
    prefix = (ws / "assertions" / "captured-support.prefix.txt").read_text()
    assert SYSTEM in prefix and not any(q in prefix for q in QUESTIONS)  # the shared part is the static prefix
    unique = list(dict.fromkeys(QUESTIONS))
    assert dynamic["static"] is False and [c["vars"]["rest"][:len(q)] for c, q in zip(doc["cases"], unique)] == unique
    assert "assert" not in doc["cases"][0]  # a byte-equivalence gate compares the outputs themselves
    code, out = evaluate(run_cli, ws, "served", "--suite", "captured-support", "--limit", "2")
    assert code == 0 and out["verdict"] == "PASS", out
    assert out["tokens"]["cached_on"] > 0
    # The capture mined straight, on the served engine (its log-probabilities as top-2).
    code, out, _ = run_cli("--workspace", ws, "battery", "mine", "--capture", cap, "--engine", "served", "--cases", "2",
                           "--out", tmp_path / "mined", "--json")
    report = json.loads(out)
    assert code == 0 and report["candidates"] == len(QUESTIONS) - 1 and report["chosen"] == 2, report
    assert all(c["source"].startswith("capture.jsonl:") for c in report["suites"]["captured-support"]["cases"])


def test_a_capture_without_prompts_or_with_garbage_is_refused(server, workspace, run_cli, tmp_path):
    ws = served_ws(workspace)
    blind = captured(server, tmp_path / "blind.jsonl", "--no-text")
    code, out = from_capture(run_cli, ws, blind, "--out", tmp_path / "out")
    assert code == 2 and out["error"].startswith(f"{blind}:1: a metadata-only line") and "--no-text" in out["error"]
    garbage = tmp_path / "garbage.jsonl"
    garbage.write_text("this is not json\n")
    code, out = from_capture(run_cli, ws, garbage, "--out", tmp_path / "out")
    assert code == 2 and str(garbage) in out["error"]
    assert not (tmp_path / "out").exists()


def test_an_assertion_gate_needs_assertions_given(server, workspace, run_cli, tmp_path):
    ws = served_ws(workspace)
    (ws / "policies" / "static_first.yaml").write_text("flag: static_first\ngate: assertion_equivalence\n")
    cap = captured(server, tmp_path / "capture.jsonl")
    code, out = from_capture(run_cli, ws, cap, "--flag", "static_first", "--out", tmp_path / "out")
    assert code == 2 and "assertion_equivalence gate" in out["error"] and "--assertions FILE" in out["error"]
    assert not (tmp_path / "out").exists()
    given = tmp_path / "asserts.yaml"
    given.write_text("- {type: max-length, value: 2000}\n")
    code, report = from_capture(run_cli, ws, cap, "--flag", "static_first", "--assertions", given, "--out", tmp_path / "out")
    assert code == 0, report
    doc = yaml.safe_load((tmp_path / "out" / "captured-support.yaml").read_text())
    assert all(c["assert"] == [{"type": "max-length", "value": 2000}] for c in doc["cases"])
