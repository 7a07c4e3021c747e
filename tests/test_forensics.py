"""``forensics`` on the logs of a real llama-server (built by gatekeeper.setup.llama_build) running the
interleave scenario on a tiny hybrid model at its most verbose, behind a real ``gatekeeper proxy``
capturing the prompts, checked request by request against the server's own ``timings``; reuse
across requests and the advice, checked against real runs; damaged logs; ik_llama.cpp's line
formats; the CLI's errors."""

from __future__ import annotations

import importlib.util
import json
import random
import urllib.request
from pathlib import Path

import pytest
from served import llama_server
from tiny_models import tiny_hybrid  # noqa: F401  (fixture)

from gatekeeper.cache.trie import common_prefix as lcp
from gatekeeper.errors import GatekeeperError
from gatekeeper.traffic.live import proxy
from gatekeeper.traffic.logs import forensics

BENCH = Path(__file__).resolve().parent.parent / "bench"


def _bench(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def scenario(tiny_hybrid, tmp_path_factory):  # noqa: F811
    """The interleave scenario's chats (A and C share a long system message, B is unrelated) and
    the tiny hybrid model as GGUF, converted by llama.cpp's own converter."""
    from transformers import AutoTokenizer

    peers = _bench("hybrid_peers")
    gguf = peers.to_gguf(tiny_hybrid, tmp_path_factory.mktemp("gguf") / "tiny-hybrid.gguf")
    messages, _ = peers.chats(AutoTokenizer.from_pretrained(str(tiny_hybrid)), 1.0)
    a, b, c = messages["A->B->C"]
    return gguf, {"A": a, "B": b, "C": c}


def run(gguf: Path, chats: dict, plan: list[tuple[str, bool]], log: Path, *extra: str) -> list[dict]:
    """One fresh one-slot server, most verbose (-v), the plan's chats in order through a capturing
    proxy (its capture beside the log, ``.jsonl``); per request the prompt's token ids (the
    server's own rendering), whether cache_prompt was on, and its timings."""
    rows = []
    with llama_server(gguf, "-v", "-c", "16384", *extra, log=log) as url, \
            proxy.running(url, log.with_suffix(".jsonl")) as relay:
        for name, cache_prompt in plan:
            text = post(url + "/apply-template", {"messages": chats[name]})["prompt"]
            ids = post(url + "/tokenize", {"content": text, "add_special": True, "parse_special": True})["tokens"]
            answer = post(relay + "/v1/chat/completions", {"messages": chats[name], "max_tokens": 4, "temperature": 0,
                                                            "cache_prompt": cache_prompt})
            rows.append({"name": name, "ids": ids, "cache_prompt": cache_prompt, "timings": answer["timings"]})
    return rows


RAM_MIB = 64


@pytest.fixture(scope="module")
def runs(scenario, tmp_path_factory):
    """A->C and A->B->C on the slot alone (--cache-ram 0), the second ending with C again with
    cache_prompt off (a silent full re-processing); A->B->C alone on the slot and with a host
    prompt cache of RAM_MIB."""
    gguf, chats = scenario
    logs = tmp_path_factory.mktemp("logs")
    out = {}
    for name, plan, extra in [
        ("A->C", [("A", True), ("C", True)], ("--cache-ram", "0")),
        ("A->B->C", [("A", True), ("B", True), ("C", True), ("C", False)], ("--cache-ram", "0")),
        ("A->B->C ram", [("A", True), ("B", True), ("C", True)], ("--cache-ram", str(RAM_MIB))),
        ("A->B->C slot", [("A", True), ("B", True), ("C", True)], ("--cache-ram", "0")),
    ]:
        log = logs / f"{name.replace('>', '').replace(' ', '_')}.log"
        out[name] = (log, run(gguf, chats, plan, log, *extra))
    return out


def check_against_timings(report: dict, rows: list[dict]) -> None:
    detail = report["requests_detail"]
    assert len(detail) == report["requests"] == len(rows)
    for d, row in zip(detail, rows):
        t = row["timings"]
        assert (d["reused"], d["processed"]) == (t["cache_n"], t["prompt_n"]), (d, t)
        assert d["prompt_tokens"] == len(row["ids"]) == t["cache_n"] + t["prompt_n"]
        assert abs(d["prefill_s"] - t["prompt_ms"] / 1000) < 1e-5 and abs(d["decode_s"] - t["predicted_ms"] / 1000) < 1e-5
        if d["restored"] is not None:  # a restore sets the re-used count to the checkpoint's
            assert d["restored"]["n_past"] == t["cache_n"] > 0
    assert report["prompt_tokens"] == sum(len(r["ids"]) for r in rows)
    assert report["reused"] == sum(r["timings"]["cache_n"] for r in rows)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["A->C", "A->B->C"])
def test_counts_match_what_the_slot_did(runs, name):
    log, rows = runs[name]
    report = forensics.read([log])
    assert report["complete"] and report["problems"] == [], report["problems"]
    assert report["unparsed"]["count"] == 0, report["unparsed"]  # every relevant line of the most verbose log is understood
    check_against_timings(report, rows)
    # the common prefix with the slot's cached prompt: the previous prompt (an empty slot first)
    expected_lcp = [lcp(prev["ids"], row["ids"]) for prev, row in zip([{"ids": []}] + rows, rows)]
    assert [d["common_prefix"] for d in report["requests_detail"]] == expected_lcp
    # what the run did, from the server's figures: a hybrid model re-uses part of a shared prefix only
    # through a checkpoint; a full re-processing with cache_prompt on is forced, with it off silent
    shared = [(r, n) for r, n in zip(rows, expected_lcp) if n > 0]
    fr = report["full_reprocessing"]
    assert report["checkpoints"]["restored"] == sum(0 < r["timings"]["cache_n"] < n for r, n in shared)
    assert fr["forced"] == sum(r["cache_prompt"] and r["timings"]["cache_n"] == 0 for r, n in shared)
    assert fr["silent"] == sum(not r["cache_prompt"] for r, n in shared)
    assert fr["total"] == sum(r["timings"]["cache_n"] == 0 for r in rows)
    text = log.read_text(errors="replace")
    cp = report["checkpoints"]
    assert cp["created"] == text.count("created context checkpoint") > 0
    assert cp["erased"] == text.count("erased invalidated context checkpoint") + text.count("superseding context checkpoint")
    if name == "A->C":  # C re-uses A's system message through a restored checkpoint
        assert (cp["restored"], fr["forced"], fr["silent"]) == (1, 0, 0)
        assert 0 < report["requests_detail"][1]["lost"] < 64  # the restore rounds down a little
    else:  # B erases every checkpoint of A, so C cannot re-use the shared prefix; C again with cache_prompt off
        assert (cp["restored"], fr["forced"], fr["silent"]) == (0, 2, 1)
        assert report["requests_detail"][1]["wiped"] and cp["wipes"] >= 2
        silent = report["requests_detail"][3]
        assert silent["silent"] and silent["lost"] == len(rows[3]["ids"]) - 1  # all of C was in the slot
    assert report["slots"]["0"]["requests"] == len(rows)


@pytest.mark.slow
def test_the_host_prompt_cache_brings_back_a_prompt_an_interloper_displaced(runs):
    log, rows = runs["A->B->C ram"]
    report = forensics.read([log])
    assert report["complete"] and report["unparsed"]["count"] == 0, report
    check_against_timings(report, rows)
    c = report["requests_detail"][2]
    # C's best match is A, saved to host memory when B took the slot: the slot loads it back
    assert c["prompt_cache_load"] and c["common_prefix"] == lcp(rows[0]["ids"], rows[2]["ids"]) > 1000
    assert c["restored"] is not None and report["prompt_cache"]["loaded"] == 1 and report["prompt_cache"]["saved"] >= 1


def across(name: str, runs, **kw) -> tuple[dict, list[dict]]:
    log, rows = runs[name]
    report = forensics.read([log], log.with_suffix(".jsonl"), **kw)
    assert report["reuse"]["unmatched"] == 0 and report["cannot_report"] == []
    return report, rows


@pytest.mark.slow
def test_an_interloper_that_evicts_the_shared_prefix_is_counted_as_eviction(runs):
    report, rows = across("A->B->C slot", runs)
    a, b, c = (r["ids"] for r in rows)
    shared = lcp(a, c)
    assert shared >= forensics.reuse.UNIT > lcp(b, c)  # the scenario: C shares a long prefix with A, not with B
    detail = report["requests_detail"][2]
    # the slot-only view sees B's prompt before C, sharing a token or so; across requests, A's prefix
    assert detail["common_prefix"] == detail["lost"] == lcp(b, c)
    assert (detail["shared"], detail["possible"], detail["reused"]) == (shared, min(shared, len(c) - 1), 0)
    assert detail["lost_to"] == {"evicted": min(shared, len(c) - 1)}
    u = report["reuse"]
    assert (u["possible"], u["obtained"], u["lost"]) == (detail["possible"], 0, detail["possible"])
    assert u["lost_by_cause"]["evicted"] == detail["possible"] and sum(u["lost_by_cause"].values()) == u["lost"]
    assert detail["forced"] and "forcing full prompt re-processing" in detail["forced_reason"]  # quoted, not the cause


@pytest.mark.slow
def test_with_the_host_cache_the_shared_prefix_is_obtained(runs):
    report, rows = across("A->B->C ram", runs)
    c = report["requests_detail"][2]
    assert c["prompt_cache_load"] and c["reused"] == rows[2]["timings"]["cache_n"] > 0
    assert c["shared"] == lcp(rows[0]["ids"], rows[2]["ids"]) and "evicted" not in (c["lost_to"] or {})
    # what little is lost lies between the restored checkpoint and the end of the shared prefix
    assert c["possible"] - c["reused"] == (c["lost_to"] or {}).get("checkpoint_spacing", 0) < forensics.reuse.UNIT
    u = report["reuse"]
    assert u["obtained"] == sum(r["timings"]["cache_n"] for r in rows) and u["lost_by_cause"]["evicted"] == 0


@pytest.mark.slow
def test_a_full_reprocessing_of_a_prompt_seen_before_is_silent_across_requests(runs):
    report, rows = across("A->B->C", runs)
    again = report["requests_detail"][3]  # C again with cache_prompt off: all of it was in the slot
    assert again["silent"] and not again["forced"] and again["lost_to"] == {"unexplained": len(rows[3]["ids"]) - 1}
    assert report["reuse"]["silent"] == report["full_reprocessing"]["silent"] == 1


@pytest.mark.slow
def test_the_advice_for_a_host_cache_matches_a_real_server_with_it(runs):
    """The advice, from the run without a host cache, against the same traffic on a server with
    --cache-ram RAM_MIB: within one unit, because the simulator restores its last snapshot below
    the shared prefix (every unit) and the server its checkpoint at C's user message, which lies
    between that snapshot and the end of the shared prefix."""
    report, rows = across("A->B->C slot", runs, cache_ram=(RAM_MIB,))
    lines = {line["setting"]: line for line in report["advice"]["lines"]}
    served, host = lines["as served: -np 1 --cache-ram 0 --ctx-checkpoints 32"], lines[f"--cache-ram {RAM_MIB}"]
    assert served["as_served"] and served["reused"] == report["reuse"]["obtained"] == 0  # the baseline agrees with the log
    _, real = runs["A->B->C ram"]
    obtained = sum(r["timings"]["cache_n"] for r in real)
    unit = report["advice"]["unit"]
    assert obtained > 0 and 0 <= obtained - host["reused"] < unit, (obtained, host)
    assert host["share"] == round(host["reused"] / report["reuse"]["possible"], 4) and host["memory_mib"] > 0
    assert lines["gatekeeper boundaries (pinned stage prefixes)"]["reused"] == report["reuse"]["possible"]


@pytest.mark.slow
def test_forensics_cli_reports_reuse_and_advice(runs, run_cli):
    log, _ = runs["A->B->C slot"]
    code, out, _ = run_cli("forensics", log, "--capture", log.with_suffix(".jsonl"), "--cache-ram", "64", "--json")
    assert code == 0, out
    report = json.loads(out)
    assert report["reuse"]["lost_by_cause"]["evicted"] > 0 and any(l["setting"] == "--cache-ram 64" for l in report["advice"]["lines"])
    code, out, _ = run_cli("forensics", log, "--capture", log.with_suffix(".jsonl"))
    assert code == 0 and "lost: evicted" in out and "--cache-ram 8192" in out and "not reported:" not in out
    code, out, _ = run_cli("forensics", log)  # without the prompts: the log's own figures, and what is missing
    assert code == 0 and "not reported: reuse across requests" in out and "lost: evicted" not in out


@pytest.mark.slow
def test_a_truncated_log_gives_a_partial_report(runs, tmp_path):
    log, rows = runs["A->B->C"]
    full = forensics.read([log])
    data = log.read_bytes()
    cut = data.index(b"prompt eval time", data.index(b"task.n_tokens = ", data.index(b"stop processing") + 1))
    short = tmp_path / "short.log"
    short.write_bytes(data[:cut + 5])  # mid-line, inside the second request's timings
    report = forensics.read([short])
    assert not report["complete"]
    assert any(p.startswith("truncated:") for p in report["problems"]) and any(p.startswith("incomplete:") for p in report["problems"])
    first, expected = report["requests_detail"][0], full["requests_detail"][0]
    assert {**first, "file": None} == {**expected, "file": None}  # what came before the cut is intact
    assert report["requests_detail"][1]["complete"] is False and report["requests"] == 2


@pytest.mark.slow
def test_a_garbled_log_gives_a_partial_report_not_a_traceback(runs, tmp_path, run_cli):
    log, rows = runs["A->B->C"]
    lines = log.read_bytes().split(b"\n")
    rng = random.Random(7)
    at = next(i for i, line in enumerate(lines) if b"restored" in line or b"forcing full" in line)
    lines[at] = lines[at][: len(lines[at]) // 2]  # a relevant line cut short
    lines.insert(at + 1, b"slot   operator(): id  0 | task 9 | checkpoint \x00\xff\xfe" + bytes(rng.randrange(256) for _ in range(300)))
    timing = next(i for i, line in enumerate(lines) if b"prompt eval time" in line and i > at + 2)
    lines[timing] = bytes(rng.randrange(256) for _ in range(len(lines[timing])))  # a request's timings destroyed
    bad = tmp_path / "garbled.log"
    bad.write_bytes(b"\n".join(lines))
    code, out, _ = run_cli("forensics", bad, "--json")
    assert code == 0, out
    report = json.loads(out)
    assert not report["complete"] and report["unparsed"]["count"] >= 1
    assert any(p.startswith("incomplete:") for p in report["problems"]) and any(p.startswith("garbled:") for p in report["problems"])
    assert report["requests"] == len(rows)  # every request is still found


# --- formats without a server ---------------------------------------------------------------------

IK_LOG = """\
INFO [                    main] build info | tid="1" timestamp=1 build=3899 commit="3d4977cb"
INFO [                    init] initializing slots | tid="1" timestamp=1 n_slots=1
INFO [   launch_slot_with_task] slot is processing task | tid="1" timestamp=2 id_slot=0 id_task=0
======== Cache: cache_size = 0, n_past0 =  0, n_past1 =  0, n_past_prompt1 = 0,  n_past2 =  0, n_past_prompt2 =  0
INFO [            update_slots] kv cache rm [p0, end) | tid="1" timestamp=2 id_slot=0 id_task=0 p0=0
slot create_check: id  0 | task 0 | created context checkpoint 1 of 8 (pos_min = 1023, pos_max = 1023, size = 62.813 MiB, took 12.50 ms)
INFO [           print_timings] prompt eval time     =   25767.00 ms /  2190 tokens (   11.77 ms per token,    84.99 tokens per second) | tid="1" timestamp=3 id_slot=0 id_task=0 t_prompt_processing=25767.002 n_prompt_tokens_processed=2190
INFO [           print_timings] generation eval time =   15701.68 ms /   222 runs   (   70.73 ms per token,    14.14 tokens per second) | tid="1" timestamp=3 id_slot=0 id_task=0
INFO [            update_slots] slot released | tid="1" timestamp=3 id_slot=0 id_task=0 n_ctx=8192 n_past=2411 truncated=false
INFO [   launch_slot_with_task] slot is processing task | tid="1" timestamp=4 id_slot=0 id_task=224
======== Cache: cache_size = 2411, n_past0 =  1100, n_past1 =  1100, n_past_prompt1 = 1100,  n_past2 =  1100, n_past_prompt2 =  1100
slot apply_checkp: id  0 | task 224 | restored context checkpoint took  11.87 ms (pos_min = 1023, pos_max = 1023, size = 62.813 MiB)
INFO [            update_slots] kv cache rm [p0, end) | tid="1" timestamp=4 id_slot=0 id_task=224 p0=1024
INFO [           print_timings] prompt eval time     =     590.55 ms /   141 tokens (   14.40 ms per token,    69.43 tokens per second) | tid="1" timestamp=5 id_slot=0 id_task=224
INFO [   launch_slot_with_task] slot is processing task | tid="1" timestamp=6 id_slot=0 id_task=300
======== Cache: cache_size = 1300, n_past =  3, n_past_prompt = 3
slot apply_checkp: id  0 | task 300 | forcing full prompt re-processing due to lack of cache data (likely due to SWA, see x)
slot apply_checkp: id  0 | task 300 | erased invalidated context checkpoint (pos_min = 1023, pos_max = 1023, size = 62.813 MiB)
INFO [            update_slots] kv cache rm [p0, end) | tid="1" timestamp=6 id_slot=0 id_task=300 p0=0
INFO [           print_timings] prompt eval time     =     100.00 ms /   900 tokens (    0.11 ms per token,  9000.00 tokens per second) | tid="1" timestamp=7 id_slot=0 id_task=300
"""


def test_ik_llama_lines(tmp_path):
    log = tmp_path / "ik.log"
    log.write_text(IK_LOG)
    r = forensics.read([log])
    assert r["complete"], r["problems"]
    d = r["requests_detail"]
    assert [(c["task"], c["common_prefix"], c["reused"], c["processed"], c["prompt_tokens"]) for c in d] == [
        (0, 0, 0, 2190, 2190), (224, 1100, 1024, 141, 1165), (300, 3, 0, 900, 900)]
    assert d[0]["decode_s"] == pytest.approx(15.70168) and d[0]["generated"] == 222
    assert d[1]["restored"]["ms"] == 11.87 and d[1]["lost"] == 1100 - 1024
    assert r["full_reprocessing"] == {"forced": 1, "silent": 0, "total": 2}
    cp = r["checkpoints"]
    assert (cp["created"], cp["restored"], cp["erased_by_reason"]) == (1, 1, {"invalidated": 1})
    assert cp["create_ms"]["max"] == 12.5 and cp["size_mib"]["min"] == 62.813 and cp["restore_ms"]["median"] == 11.87


def test_prefixed_coloured_and_json_lines(tmp_path):
    log = tmp_path / "mixed.log"
    log.write_text(
        "0.01.002.003 I \x1b[32mslot launch_slot_: id  1 | task 5 | processing task, is_child = 0\x1b[0m\n"
        "0.01.002.004 I slot   operator(): id  1 | task 5 | new prompt, n_ctx_slot = 4096, n_keep = 0, task.n_tokens = 300\n"
        '{"tid":"1","timestamp":1,"level":"INFO","function":"update_slots","msg":"kv cache rm [p0, end)","id_slot":1,"id_task":5,"p0":200}\n'
        "0.01.002.009 I slot print_timing: id  1 | task 5 | prompt eval time =      10.00 ms /   100 tokens (0.1 ms per token)\n"
        "0.01.002.010 W slot print_timing: id  1 | task 5 | restored context checkpoint with a layout from a future build\n")
    r = forensics.read([log])
    assert r["slots"].keys() == {"1"}
    assert [(c["reused"], c["processed"], c["prompt_tokens"]) for c in r["requests_detail"]] == [(200, 100, 300)]
    assert r["unparsed"]["count"] == 0 and r["checkpoints"]["restored"] == 1  # the key phrase counts; the fields are absent


def test_lines_that_look_relevant_but_match_nothing_are_reported(tmp_path):
    log = tmp_path / "odd.log"
    log.write_text("slot launch_slot_: id  0 | task 1 | processing task\n"
                   "slot update_slots: id  0 | task 1 | checkpoint bookkeeping changed its wording again\n"
                   "slot print_timing: id  0 | task 1 | prompt eval time =  1.00 ms /  3 tokens\n")
    r = forensics.read([log])
    assert r["unparsed"]["count"] == 1 and r["unparsed"]["examples"][0]["line"] == 2 and not r["complete"]


def test_bad_input_is_exit_2_naming_the_file(tmp_path, run_cli):
    not_log = tmp_path / "notes.txt"
    not_log.write_text("hello\nworld\n")
    for path, words in [(tmp_path / "missing.log", "does not exist"), (tmp_path, "is a folder"),
                        (not_log, "not a llama.cpp-family server log")]:
        code, out, _ = run_cli("forensics", path, "--json")
        assert code == 2 and words in json.loads(out)["error"] and str(path) in json.loads(out)["error"]
    with pytest.raises(GatekeeperError):
        forensics.read([])


def _slot_log(path: Path, requests: list[tuple[int, int, int, int]]) -> Path:
    """A hand-written upstream log: (slot, task, prompt tokens, re-used) per request; a request's
    timings come after the next one has started when that runs on another slot (out of order, as
    with several slots busy)."""
    lines, late = [], None
    for slot, task, n, reused in requests:
        if late and late[0] == slot:
            lines.append(late[1])
            late = None
        lines += [f"slot launch_slot_: id  {slot} | task {task} | processing task",
                  f"slot   operator(): id  {slot} | task {task} | new prompt, n_ctx_slot = 4096, n_keep = 0, task.n_tokens = {n}",
                  f"slot   operator(): id  {slot} | task {task} | cached n_tokens = {reused}, memory_seq_rm [{reused}, end)"]
        if late:
            lines.append(late[1])
        late = (slot, f"slot print_timing: id  {slot} | task {task} | prompt eval time =  1.00 ms /  {n - reused} tokens")
    lines.append(late[1])
    path.write_text("\n".join(lines) + "\n")
    return path


def _capture(path: Path, prompts: list[list[int]]) -> Path:
    path.write_text("".join(json.dumps({"stage": "s", "stream": str(i), "t": i, "tokens": p}) + "\n"
                            for i, p in enumerate(prompts)))
    return path


def test_a_prefix_another_slot_held_is_lost_to_that_slot_and_an_overwritten_one_to_eviction(tmp_path):
    rng = random.Random(1)
    a = [rng.randrange(2, 500) for _ in range(900)]
    b = [1] + [rng.randrange(2, 500) for _ in range(299)]
    c = a[:600] + [1] * 100
    d = b[:280] + a[:10]
    # A on slot 0; B, then C (sharing 600 with A, which slot 0 still holds) on slot 1; then A's
    # neighbour D on slot 0 overwrites A, and E (A again) on slot 1 finds only C's 600 tokens of it there
    log = _slot_log(tmp_path / "two.log", [(0, 1, 900, 0), (1, 2, 300, 0), (1, 3, 700, 0), (0, 4, 290, 280),
                                           (1, 5, 900, 0)])
    report = forensics.read([log], _capture(tmp_path / "cap.jsonl", [a, b, c, d, a]), unit=64)
    assert report["complete"], report["problems"]
    assert [r["line"] for r in report["requests_detail"]] == [1, 4, 9, 12, 16]  # timings of another slot in between
    got = [(r["slot"], r["task"], r["shared"], r["lost_to"]) for r in report["requests_detail"]]
    assert got == [(0, 1, 0, {}), (1, 2, 0, {}), (1, 3, 600, {"other_slot": 600}), (0, 4, 280, {}),
                   (1, 5, 900, {"unexplained": 600, "evicted": 299})]  # its own slot held 600 of the 899 and said nothing
    u = report["reuse"]
    assert (u["lost_by_cause"]["other_slot"], u["lost_by_cause"]["evicted"], u["obtained"]) == (600, 299, 280)


def test_the_capture_must_hold_the_prompts_of_this_log(tmp_path, run_cli):
    log = _slot_log(tmp_path / "one.log", [(0, 1, 300, 0), (0, 2, 300, 200)])
    meta = tmp_path / "meta.jsonl"
    meta.write_text(json.dumps({"stage": "s", "stream": "x", "t": 0, "bytes": 900, "digest": "ab", "blocks": []}) + "\n")
    other = _capture(tmp_path / "other.jsonl", [[5] * 10, [6] * 20])
    for capture, words in [(meta, "no line has 'tokens'"), (other, "none of its 2 prompts matches"),
                           (tmp_path / "none.jsonl", "none.jsonl")]:
        code, out, _ = run_cli("forensics", log, "--capture", capture, "--json")
        assert code == 2 and words in json.loads(out)["error"], out
