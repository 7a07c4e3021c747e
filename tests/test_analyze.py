"""``analyze`` on synthetic captures whose every figure is worked out by hand below."""

import json

import pytest

from gatekeeper.traffic.captures.analyze import percentile

P = list(range(5000))  # a shared run of token ids; X(i, n) are n ids no other request has


def X(i, n):
    return [100_000 * i + k for k in range(n)]


# In time order (the file is shuffled to show that ``t`` orders it):
#   r1 s1  P[:5000]+X1(1000)  len 6000
#   r2 s2  P[:5000]+X2(500)   len 5500   common with r1: 5000
#   r3 s1  P[:300] +X3(200)   len  500   common with r2:  300
#   r4 s2  P[:4096]+X4(4)     len 4100   common with r3:  300
#   r5 s1  P[:4096]+X5(100)   len 4196   common with r4: 4096
#   r6 s2  X6(10)             len   10   common with r5:    0
TRACE = [
    {"stage": "router", "stream": "s1", "t": 0.0, "tokens": P[:5000] + X(1, 1000)},
    {"stage": "router", "stream": "s2", "t": 1.0, "tokens": P[:5000] + X(2, 500)},
    {"stage": "planner", "stream": "s1", "t": 2.0, "tokens": P[:300] + X(3, 200)},
    {"stage": "planner", "stream": "s2", "t": 3.0, "tokens": P[:4096] + X(4, 4)},
    {"stage": "router", "stream": "s1", "t": 4.0, "tokens": P[:4096] + X(5, 100)},
    {"stage": "router", "stream": "s2", "t": 5.0, "tokens": X(6, 10)},
]
TOTAL = 6000 + 5500 + 500 + 4100 + 4196 + 10  # 20306 prompt tokens


def write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def analyze(run_cli, path):
    code, out, _ = run_cli("analyze", path, "--json")
    assert code == 0, out
    return json.loads(out)


def test_nearest_rank_percentiles():
    values = [15, 20, 35, 40, 50]
    assert [percentile(values, p) for p in (5, 30, 40, 50, 100)] == [15, 20, 20, 35, 50]
    assert percentile([7], 10) == 7


def test_consecutive_common_prefix_globally_and_per_stream(run_cli, tmp_path):
    shuffled = [TRACE[i] for i in (3, 0, 5, 1, 4, 2)]
    r = analyze(run_cli, write(tmp_path / "trace.jsonl", shuffled))
    assert (r["requests"], r["streams"], r["unit"]) == (6, 2, "tokens")

    # global pairs: 5000, 300, 300, 4096, 0 -> sorted 0, 300, 300, 4096, 5000 (n = 5)
    # ranks ceil(p/100*5): p10 -> 1, p25 -> 2, p50 -> 3, p75 -> 4, p90 -> 5
    g = r["consecutive"]["global"]
    assert g["pairs"] == 5
    assert g["common_prefix"] == {"min": 0, "p10": 0, "p25": 300, "median": 300, "p75": 4096, "p90": 5000, "max": 5000}
    assert g["share_under_512"] == 0.6  # 0, 300, 300
    assert g["share_at_least_4096"] == 0.4  # 4096 (the boundary counts) and 5000
    assert (g["reusable"], g["prompt_total"]) == (9696, TOTAL)
    assert g["reusable_share"] == round(9696 / 20306, 4) == 0.4775

    # per stream: s1 r1->r3 300, r3->r5 300; s2 r2->r4 4096, r4->r6 0 -> sorted 0, 300, 300, 4096 (n = 4)
    # ranks ceil(p/100*4): p10 -> 1, p25 -> 1, p50 -> 2, p75 -> 3, p90 -> 4
    s = r["consecutive"]["per_stream"]
    assert s["pairs"] == 4
    assert s["common_prefix"] == {"min": 0, "p10": 0, "p25": 0, "median": 300, "p75": 300, "p90": 4096, "max": 4096}
    assert (s["share_under_512"], s["share_at_least_4096"]) == (0.75, 0.25)
    assert s["reusable"] == 4696 and s["reusable_share"] == 0.2313

    # stages: router holds r1, r2, r5, r6 (no common prefix: r6 shares nothing); planner r3, r4 share 300
    assert r["stages"]["router"]["calls"] == 4 and r["stages"]["router"]["stable_prefix_tokens"] == 0
    assert r["stages"]["planner"]["stable_prefix_tokens"] == 300
    assert r["stages"]["planner"]["mean_prompt_tokens"] == 2300.0
    assert r["stages"]["router"]["byte_stable_share"] is None  # token-only lines have no bytes
    assert r["stages"]["router"]["cacheable_share"] is None  # and no segments


def seg(static, start, end):
    return {"static": static, "start": start, "end": end}


def test_byte_stable_prefix_and_cacheable_share_by_segments(run_cli, tmp_path):
    # "STATIC-PART:" is 12 bytes, "é" 2, ":" 1: the three texts share 15 bytes; they are 20, 20 and 17 bytes long
    records = [
        {"stage": "router", "stream": "a", "t": 0, "text": "STATIC-PART:é:alpha", "tokens": list(range(10)),
         "segments": [seg(False, 0, 2), seg(True, 2, 6), seg(False, 6, 10)]},  # as written 0, partitioned 4
        {"stage": "router", "stream": "b", "t": 1, "text": "STATIC-PART:é:beta!", "tokens": list(range(10)),
         "segments": [seg(True, 0, 3), seg(False, 3, 5), seg(True, 5, 8), seg(False, 8, 10)]},  # 3, 6
        {"stage": "router", "stream": "c", "t": 2, "text": "STATIC-PART:é:al", "tokens": list(range(10)),
         "segments": [seg(True, 0, 4), seg(True, 4, 7), seg(False, 7, 10)]},  # 7, 7
    ]
    r = analyze(run_cli, write(tmp_path / "cap.jsonl", records))
    s = r["stages"]["router"]
    assert (s["stable_prefix_bytes"], s["mean_prompt_bytes"]) == (15, 19.0)
    assert s["byte_stable_share"] == round(15 / 19, 4) == 0.7895
    # as written: leading static runs 0 + 3 + 7 of 30 tokens; partitioned: all static 4 + 6 + 7 of 30
    assert s["cacheable_share"] == {"as_written": round(10 / 30, 4), "partitioned": round(17 / 30, 4)}


def test_text_only_capture_counts_bytes(run_cli, tmp_path):
    records = [{"stage": "s", "stream": "x", "t": i, "text": text} for i, text in enumerate(["abcdef", "abcxyz", "abcxyq"])]
    r = analyze(run_cli, write(tmp_path / "cap.jsonl", records))
    assert r["unit"] == "bytes"
    g = r["consecutive"]["global"]
    assert g["common_prefix"]["min"] == 3 and g["common_prefix"]["max"] == 5  # abc, then abcxy
    assert g["reusable"] == 8 and g["prompt_total"] == 18


@pytest.mark.parametrize("line, expected", [
    ("this is not json", "not JSON"),
    ('{"stream": "a", "t": 0, "tokens": [1]}', "field 'stage'"),
    ('{"stage": "r", "t": 0, "tokens": [1]}', "field 'stream'"),
    ('{"stage": "r", "stream": "a", "tokens": [1]}', "field 't'"),
    ('{"stage": "r", "stream": "a", "t": 0}', "field 'tokens'"),
    ('{"stage": "r", "stream": "a", "t": 0, "tokens": [1, "x"]}', "field 'tokens'"),
    ('{"stage": "r", "stream": "a", "t": 0, "tokens": [1, -2]}', "field 'tokens'"),
    ('{"stage": "r", "stream": "a", "t": 0, "tokens": [1, 99999999999999999999]}', "field 'tokens'"),  # ids are packed
    ('{"stage": "r", "stream": "a", "t": 0, "tokens": [1, 2], "segments": [{"static": true, "start": 0}]}',
     "field 'segments[0].end'"),
    ('{"stage": "r", "stream": "a", "t": 0, "tokens": [1, 2], "segments": [{"static": true, "start": 0, "end": 3}]}',
     "field 'segments[0]'"),
])
def test_bad_line_names_file_line_and_field(run_cli, tmp_path, line, expected):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(TRACE[0]) + "\n" + line + "\n")
    before = sorted(tmp_path.iterdir())
    code, out, _ = run_cli("analyze", path, "--json")
    error = json.loads(out)["error"]
    assert code == 2 and f"{path}:2" in error and expected in error, error
    code, _, err = run_cli("analyze", path)
    assert code == 2 and f"{path}:2" in err
    assert sorted(tmp_path.iterdir()) == before


def test_missing_or_empty_capture(run_cli, tmp_path):
    code, out, _ = run_cli("analyze", tmp_path / "nope.jsonl", "--json")
    assert code == 2 and "does not exist" in json.loads(out)["error"]
    (tmp_path / "empty.jsonl").write_text("\n")
    code, out, _ = run_cli("analyze", tmp_path / "empty.jsonl", "--json")
    assert code == 2 and "no requests" in json.loads(out)["error"]


def test_human_output_prints_the_tables(run_cli, tmp_path):
    code, out, _ = run_cli("analyze", write(tmp_path / "trace.jsonl", TRACE))
    assert code == 0 and "median" in out and "router" in out and "per stream" in out


# The load, worked out by hand: calls in flight over [0,4], [1,2], [3,6] (wall times) and [10,11] (the
# server's prefill + decode, no wall time). In flight: 1 call for 5 s, 2 calls for 2 s (of 7 busy seconds).
LOADED = [
    {"stage": "router", "stream": "s1", "t": 0.0, "duration_s": 4.0, "tokens": X(1, 100)},
    {"stage": "router", "stream": "s2", "t": 1.0, "duration_s": 1.0, "tokens": X(2, 300)},
    {"stage": "planner", "stream": "s1", "t": 3.0, "duration_s": 3.0, "tokens": X(3, 50)},
    {"stage": "router", "stream": "s3", "t": 10.0, "prefill_s": 0.25, "decode_s": 0.75, "tokens": X(4, 200)},
]


def test_load_rate_concurrency_and_prompt_lengths(run_cli, tmp_path):
    r = analyze(run_cli, write(tmp_path / "load.jsonl", LOADED))
    load = r["load"]
    assert load["requests_per_s"] == pytest.approx(4 / 11, abs=1e-4) and load["span_s"] == 11.0
    assert load["concurrency"] == {"p50": 1, "p95": 2, "max": 2, "mean": pytest.approx(9 / 7, abs=1e-3), "busy_s": 7.0}
    assert load["durations"] == {"calls_timed": 4, "wall": 3, "server": 1} and load["cannot_report"] == []
    router = r["stages"]["router"]
    # the router alone: [0,4], [1,2], [10,11] -> 1 call for 4 s, 2 for 1 s
    assert router["load"]["concurrency"] == {"p50": 1, "p95": 2, "max": 2, "mean": 1.2, "busy_s": 5.0}
    assert router["prompt_length"] == {"unit": "tokens", "min": 100, "p10": 100, "p25": 100, "median": 200,
                                       "p75": 300, "p90": 300, "p95": 300, "max": 300}
    assert r["stages"]["planner"]["load"]["requests_per_s"] == pytest.approx(1 / 3, abs=1e-4)


def test_a_capture_without_timings_says_what_it_cannot_report(run_cli, tmp_path):
    r = analyze(run_cli, write(tmp_path / "untimed.jsonl", TRACE))
    assert r["load"]["concurrency"] is None and r["load"]["requests_per_s"] == pytest.approx(6 / 5, abs=1e-4)
    assert any(x.startswith("concurrency: no line has a duration_s") for x in r["load"]["cannot_report"])
    one = analyze(run_cli, write(tmp_path / "one.jsonl", TRACE[:1]))["load"]
    assert one["requests_per_s"] is None and any(x.startswith("rate:") for x in one["cannot_report"])
    code, out, _ = run_cli("analyze", write(tmp_path / "bad.jsonl", [{**LOADED[0], "duration_s": -1}]), "--json")
    assert code == 2 and "bad.jsonl:1" in json.loads(out)["error"] and "duration_s" in json.loads(out)["error"]
