"""``measure`` and prompt capture on the tiny model: the runtime's own figures, off vs on."""

import json

import pytest
from conftest import RULES, ledger

from gatekeeper.cache.trie import common_prefix
from gatekeeper.errors import GatekeeperError
from gatekeeper.runtime import Runtime

# One static system segment, then a query whose first letter differs per case: every prompt shares
# exactly the static prefix with every other, so the cache can serve that and nothing more.
FLAT = f"""suite: flat
stage: flat
prompt:
  - {{role: system, static: true, text: "{RULES}"}}
  - {{role: user, static: false, text: "{{query}}"}}
decoding: {{max_tokens: 3}}
cases:
  - {{id: a, vars: {{query: "Alpha: what is 2+2?"}}, assert: [{{type: min-length, value: 0}}]}}
  - {{id: b, vars: {{query: "Book the cheapest flight."}}, assert: [{{type: min-length, value: 0}}]}}
  - {{id: c, vars: {{query: "Summarise the notes."}}, assert: [{{type: min-length, value: 0}}]}}
"""


@pytest.fixture
def flat_ws(tiny_ws):
    (tiny_ws / "assertions" / "flat.yaml").write_text(FLAT)
    return tiny_ws


def measure(run_cli, ws, *args):
    code, out, _ = run_cli("--workspace", ws, "measure", "--engine", "tiny", "--operator", "ci", *args, "--json")
    assert code == 0, out
    return json.loads(out)


def read_capture(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_cache_on_computes_the_shared_prefix_once_less_per_call(run_cli, flat_ws, tmp_path):
    cap = tmp_path / "flat.jsonl"
    m = measure(run_cli, flat_ws, "--suite", "flat", "--compare", "--capture", cap)
    off, on = m["runs"]
    assert (off["flag_state"], on["flag_state"]) == ("off", "on")
    assert off["flags"] == {"prefix_cache": "off"} and on["flags"] == {"prefix_cache": "on"}
    assert off["pipeline_hash"] != on["pipeline_hash"]

    lines = read_capture(cap)  # the flag-off pass only: its prompts are the prompts of both
    assert [line["stream"] for line in lines] == ["flat/a", "flat/b", "flat/c"]
    statics = [line["segments"][0]["end"] for line in lines]
    for line, static in zip(lines, statics):
        assert line["segments"] == [{"static": True, "start": 0, "end": static},
                                    {"static": False, "start": static, "end": len(line["tokens"])}]
    # the premise, checked on the captured ids: any two prompts share exactly the static prefix
    assert len(set(statics)) == 1 and statics[0] > 20
    for i, a in enumerate(lines):
        for b in lines[i + 1:]:
            assert common_prefix(a["tokens"], b["tokens"]) == statics[0]

    prompt = sum(len(line["tokens"]) for line in lines)
    f_off, f_on = off["stages"]["flat"], on["stages"]["flat"]
    assert (f_off["calls"], f_off["prompt_tokens"], f_off["cached_tokens"], f_off["computed_tokens"]) == (3, prompt, 0, prompt)
    assert (f_on["calls"], f_on["prompt_tokens"], f_on["cached_tokens"]) == (3, prompt, sum(statics))
    assert f_on["computed_tokens"] == prompt - sum(statics)
    cut = m["reduction"]["flat"]
    assert (cut["computed_tokens_off"], cut["computed_tokens_on"], cut["computed_tokens_saved"]) == (
        prompt, prompt - sum(statics), sum(statics))
    assert cut["computed_tokens_reduction"] == round(sum(statics) / prompt, 4)
    assert m["reduction"]["total"]["computed_tokens_saved"] == sum(statics)
    for run in (off, on):
        t = run["total"]
        assert t["model_s"] == pytest.approx(t["prefill_s"] + t["decode_s"], abs=1e-5)
        assert 0 < t["prefill_share"] < 1 and run["wall_s"] >= t["model_s"]
        assert run["overhead_s"] == pytest.approx(run["wall_s"] - t["model_s"], abs=1e-5)

    with ledger(flat_ws) as lg:
        (record,) = lg.measurements()
        assert record["id"] == m["measurement_id"] and record["operator"] == "ci"
        assert record["config"]["compare"] is True and record["config"]["suites"] == ["flat"]
        assert record["result"]["reduction"]["flat"]["computed_tokens_saved"] == sum(statics)
        assert lg.flips() == []  # forcing a state for a measurement is not a flip
        assert lg.verify().ok


def test_turns_share_a_stream_and_the_capture_feeds_analyze(run_cli, tiny_ws, tmp_path):
    cap = tmp_path / "tiny.jsonl"
    m = measure(run_cli, tiny_ws, "--flag-state", "on", "--capture", cap)
    (run,) = m["runs"]
    assert run["flags"] == {"prefix_cache": "on"} and m["reduction"] is None
    assert run["stages"]["tiny"]["calls"] == 6  # three one-turn cases and a three-turn case
    lines = read_capture(cap)
    loop = [line for line in lines if line["stream"] == "tiny/loop"]
    assert len(lines) == 6 and len(loop) == 3
    assert [line["t"] for line in lines] == sorted(line["t"] for line in lines)
    # each call's wall time: one call at a time, so each ends before the next starts
    assert all(a["t"] + a["duration_s"] <= b["t"] for a, b in zip(lines, lines[1:])) and lines[0]["duration_s"] > 0
    assert all(line["text"] and line["segments"][-1]["end"] == len(line["tokens"]) for line in lines)

    code, out, _ = run_cli("analyze", cap, "--json")
    report = json.loads(out)
    assert code == 0 and report["requests"] == 6 and report["streams"] == 4
    per_stream = report["consecutive"]["per_stream"]
    assert per_stream["pairs"] == 2  # the loop's turns 1->2 and 2->3
    assert per_stream["common_prefix"]["min"] >= len(loop[0]["tokens"]) - 2  # a turn extends the transcript
    stage = report["stages"]["tiny"]
    assert stage["byte_stable_share"] > 0.5 and stage["cacheable_share"]["partitioned"] > 0.5
    assert stage["load"]["concurrency"]["max"] == 1 and stage["load"]["durations"]["wall"] == 6


def test_bad_input_exits_2_and_writes_nothing(run_cli, tiny_ws, tmp_path):
    evidence = tiny_ws / "ledger" / "evidence.db"
    for args, expected in [
        (["--flag-state", "maybe"], "--flag-state must be one of"),
        (["--compare", "--flag-state", "on"], "drop --flag-state"),
        (["--flag", "nope"], "nope"),
        (["--suite", "nope"], "unknown suite 'nope'"),
        (["--capture", tmp_path / "missing" / "cap.jsonl"], "does not exist"),
        (["--capture", tmp_path], "is a folder"),
    ]:
        code, out, _ = run_cli("--workspace", tiny_ws, "measure", "--engine", "tiny", *args, "--json")
        assert code == 2 and expected in json.loads(out)["error"], (args, out)
    assert not evidence.exists() and not (tmp_path / "missing").exists()


def test_runtime_capture_joins_streams_by_transcript(tiny_ws, tmp_path, monkeypatch):
    monkeypatch.setenv("GATEKEEPER_HOME", str(tmp_path / "home"))
    cap = tmp_path / "rt.jsonl"
    with Runtime(tiny_ws, engine="tiny", response_cache=False, capture=cap) as rt:
        first = rt.complete("tiny", {"session": "user=ana", "query": "Find flights"})
        second = rt.complete("tiny", {"session": "user=ana", "query": "Now book"}, first.messages)
        other = rt.complete("tiny", {"session": "user=ana", "query": "Find flights"})
        named = rt.complete("tiny", {"session": "user=ben", "query": "Hi"}, stream="mine")
    assert not any(c.from_response_cache for c in (first, second, other, named))  # the same prompt twice, both computed
    assert [line["stream"] for line in read_capture(cap)] == ["s1", "s1", "s2", "mine"]
    assert not (tmp_path / "home" / "responses.db").exists()


def test_runtime_without_capture_writes_no_file(tiny_ws, tmp_path):
    with Runtime(tiny_ws, engine="tiny", response_cache=tmp_path / "r.db") as rt:
        assert rt.capture is None
        rt.complete("tiny", {"session": "user=ana", "query": "Hi"})
    assert list(tmp_path.rglob("*.jsonl")) == []


def test_runtime_rejects_unknown_forced_flags(tiny_ws, tmp_path):
    with pytest.raises(GatekeeperError, match="unknown flag 'nope'"):
        Runtime(tiny_ws, engine="tiny", response_cache=False, flags={"nope": "on"})
    with pytest.raises(GatekeeperError, match="must be 'on' or 'off'"):
        Runtime(tiny_ws, engine="tiny", response_cache=False, flags={"prefix_cache": "yes"})


class ChatML:
    """ChatML rendering, one token per character, so token offsets are character offsets."""

    def render(self, msgs):
        return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in msgs) + "<|im_start|>assistant\n"

    def tokenize(self, text):
        return [ord(c) for c in text]


def test_segments_follow_the_prompt_pieces():
    from gatekeeper.battery.partition import Piece, order, render
    from gatekeeper.traffic.captures.capture import Segment, segments

    pieces = [Piece("system", False, "Session: 7"), Piece("system", True, "RULES"), Piece("system", True, "TOOLS"),
              Piece("user", False, "question")]
    engine = ChatML()
    # as written: "<|im_start|>system\n" (19) | "Session: 7\n\n" (to 31) | "RULES\n\nTOOLS<|im_end|>\n<|im_start|>user\n"
    # (to 71) | "question<|im_end|>\n<|im_start|>assistant\n" (to 112)
    r = render(engine, pieces, "as_written")
    assert segments(engine, r, order(pieces, "as_written"), first_turn=True) == [
        Segment(True, 0, 19), Segment(False, 19, 31), Segment(True, 31, 71), Segment(False, 71, 112)]
    assert r.static_tokens == 19
    # partitioned: the static run ends where render's static prefix does
    r = render(engine, pieces, "partitioned")
    segs = segments(engine, r, order(pieces, "partitioned"), first_turn=True)
    assert [(s.static, s.start) for s in segs] == [(True, 0), (False, r.static_tokens)] and segs[-1].end == len(r.tokens)
    # a later turn: only the static prefix is known
    assert segments(engine, r, order(pieces, "partitioned"), first_turn=False) == [
        Segment(True, 0, r.static_tokens), Segment(False, r.static_tokens, len(r.tokens))]
