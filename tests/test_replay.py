"""``gatekeeper replay``: the interleave scenario's expected counts on a tiny random hybrid model and
in the simulator, the two backends agreeing request by request, traces from captures, bad input."""

from __future__ import annotations

import json

import pytest
from tiny_models import tiny_hybrid  # noqa: F401  (fixture)

from gatekeeper.engines.sim import SimEngine
from gatekeeper.traffic.captures import replay
from gatekeeper.workspace import EngineProfile

# Scaled down tenfold for the real model: A 450 tokens, C sharing its first 252, B 10; chunk 32.
SCALE, CHUNK = 0.1, 32
POLICIES = ["tail+erase", "interval:64+erase", "boundaries+erase", "interval:64"]
# C's reused tokens per policy: tail has no snapshot below the divergence, interval's last one
# below it (192) is erased by B under the rule, the pinned stage boundary (252) survives it.
EXPECTED_C = {"tail+erase": (0, 0), "interval:64+erase": (192, 0), "boundaries+erase": (252, 252), "interval:64": (192, 192)}


def profile(model="default", **over) -> EngineProfile:
    fields = {"adapter": "torch", "model": str(model), "dtype": "float32", "device": "cpu", "prefill": "aligned", "chunk": CHUNK}
    return EngineProfile(**{**fields, **over})


def sim(base: EngineProfile):
    return lambda spec: SimEngine(base.model_copy(update={"snapshots": spec}))


def reused(report, policy, trace):
    row = next(p for p in report["policies"] if p["policy"] == policy)["traces"][trace]
    return [d["reused"] for d in row["detail"]]


@pytest.fixture(scope="module")
def real_interleave(tiny_hybrid):
    base = profile(tiny_hybrid)
    return replay.replay(replay.interleave(SCALE), POLICIES, replay.maker(base, None, simulate=False),
                         parity=True, max_tokens=4), base


@pytest.mark.slow
def test_interleave_on_a_real_hybrid_model(real_interleave):
    report, _ = real_interleave
    assert report["hybrid"] is True
    for policy, (a_c, a_b_c) in EXPECTED_C.items():
        assert reused(report, policy, "A->C") == [0, a_c], policy
        assert reused(report, policy, "A->B->C") == [0, 0, a_b_c], policy
        p = next(p for p in report["policies"] if p["policy"] == policy)
        assert p["total"]["identical"] is True, policy  # byte-identical to the cache-off run everywhere
        row = p["traces"]["A->B->C"]
        assert row["forced_full"] == (0 if a_b_c else 1) and row["bound"] == 252
        assert row["snapshot_bytes"] > 0 and row["snapshots"]["bytes_taken"] > 0
    boundaries = next(p for p in report["policies"] if p["policy"] == "boundaries+erase")["total"]
    assert boundaries["realized_share"] == 1.0 and boundaries["redone"] == 0


@pytest.mark.slow
def test_simulator_and_real_backend_agree_on_the_interleave_scenario(real_interleave):
    report, base = real_interleave
    simulated = replay.replay(replay.interleave(SCALE), POLICIES, sim(base), parity=False)
    for real, fake in zip(report["policies"], simulated["policies"]):
        for name in ("A->C", "A->B->C"):
            r, s = real["traces"][name], fake["traces"][name]
            for key in ("reused", "restores", "forced_full", "snapshots_held", "bound"):
                assert r[key] == s[key], (real["policy"], name, key)
            assert r["snapshots"]["taken"] == s["snapshots"]["taken"] and r["snapshots"]["erased"] == s["snapshots"]["erased"]


@pytest.mark.slow
def test_simulator_and_real_backend_agree_on_a_small_interleaved_trace_under_eviction(tiny_hybrid):
    trace = replay.synthetic(24, streams=3, stages=2, scale=0.06, seed=3)
    base = profile(tiny_hybrid, cache={"max_entries": 4, "max_bytes": 2**31})
    specs = ["tail+erase", "boundaries"]
    real = replay.replay(trace, specs, replay.maker(base, None, simulate=False), parity=False, max_tokens=2)
    fake = replay.replay(trace, specs, sim(base), parity=False)
    for r, s in zip(real["policies"], fake["policies"]):
        assert [d["reused"] for d in r["traces"]["synthetic"]["detail"]] == [d["reused"] for d in s["traces"]["synthetic"]["detail"]]
        assert r["traces"]["synthetic"]["snapshots_held"] == s["traces"]["synthetic"]["snapshots_held"]
    assert fake["policies"][1]["total"]["restores"] > fake["policies"][0]["total"]["restores"] > 0


def test_full_scale_interleave_in_the_simulator_through_the_cli(run_cli, workspace):
    code, out, _ = run_cli("--workspace", workspace, "replay", "--scenario", "interleave", "--simulate", "--json")
    assert code == 0
    report = json.loads(out)
    assert report["traces"]["A->C"]["bound"] == 2520  # 56% of A's 4,500 tokens
    got = {p["policy"]: (reused(report, p["policy"], "A->C")[1], reused(report, p["policy"], "A->B->C")[2])
           for p in report["policies"]}
    # the shipped profile: aligned plan, chunk 256; interval:1024 snapshots 1024 and 2048
    assert got == {"tail+erase": (0, 0), "interval:1024+erase": (2048, 0), "boundaries+erase": (2520, 2520),
                   "tail": (0, 0), "interval:1024": (2048, 2048), "boundaries": (2520, 2520)}


def test_a_capture_replays_with_its_static_prefix_as_the_stage_boundary(run_cli, workspace, tmp_path):
    static = list(range(100, 400))
    lines = [{"stage": "s", "stream": i, "t": i, "tokens": static + [i + 7] * 1100,
              "segments": [{"static": True, "start": 0, "end": 300}, {"static": False, "start": 300, "end": 1400}]}
             for i in range(3)]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    code, out, _ = run_cli("--workspace", workspace, "replay", path, "--simulate", "--policy", "boundaries",
                           "--policy", "tail+erase", "--json")
    assert code == 0
    report = json.loads(out)
    assert reused(report, "boundaries", "trace.jsonl") == [0, 300, 300]
    # tail's snapshots sit at the last three chunk steps (812, 1068, 1324), past the divergence
    assert reused(report, "tail+erase", "trace.jsonl") == [0, 0, 0]
    assert report["policies"][0]["traces"]["trace.jsonl"]["realized_share"] == 1.0


@pytest.mark.parametrize("args, message", [
    ([], "give a trace file or --scenario"),
    (["--scenario", "interleave", "--policy", "interval:0"], "--policy: 'interval:0' is not a placement policy"),
    (["--scenario", "rush-hour"], "unknown scenario 'rush-hour'"),
    (["--scenario", "interleave", "--max-tokens", "0"], "--max-tokens"),
])
def test_bad_input_exits_2_naming_the_fix(run_cli, workspace, args, message):
    code, out, _ = run_cli("--workspace", workspace, "replay", *args, "--simulate", "--json")
    assert code == 2 and message in json.loads(out)["error"]


def test_a_text_only_trace_needs_a_model_and_a_bad_line_is_named(run_cli, workspace, tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"stage": "s", "stream": "a", "t": 0, "text": "hello"}) + "\n")
    code, out, _ = run_cli("--workspace", workspace, "replay", path, "--simulate", "--json")
    assert code == 2 and "t.jsonl:1: field 'tokens' is missing" in json.loads(out)["error"]
    path.write_text("{\"stage\": \"s\", \"t\": 0, \"tokens\": [1, 2]}\n")
    code, out, _ = run_cli("--workspace", workspace, "replay", path, "--simulate", "--json")
    assert code == 2 and "t.jsonl:1: field 'stream'" in json.loads(out)["error"]


def test_a_profile_with_a_bad_snapshot_policy_is_refused(run_cli, workspace):
    (workspace / "engines" / "odd.yaml").write_text("adapter: torch\nsnapshots: interval:none\n")
    code, out, _ = run_cli("--workspace", workspace, "replay", "--scenario", "interleave", "--simulate",
                           "--engine", "odd", "--json")
    assert code == 2 and "snapshots" in json.loads(out)["error"]


@pytest.mark.slow
def test_a_text_trace_on_the_real_model_through_the_cli(run_cli, workspace, tiny_hybrid, tmp_path):
    (workspace / "engines" / "hy.yaml").write_text(
        f"adapter: torch\nmodel: {tiny_hybrid}\ndtype: float32\ndevice: cpu\nchunk: 16\nsnapshots: boundaries\n")
    system = "You are a careful assistant. The router reads the request, picks a tool, and passes the arguments on. " * 2
    lines = []
    for i, q in enumerate(["What is 2+2?", "Flights from Lisbon to Porto?", "Return JSON with the keys name."]):
        text = f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"
        cut = len(f"<|im_start|>system\n{system}".encode())
        lines.append({"stage": "router", "stream": i, "t": i, "text": text,
                      "segments": [{"static": True, "start": 0, "end": cut}, {"static": False, "start": cut, "end": len(text.encode())}]})
    path = tmp_path / "text.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    code, out, _ = run_cli("--workspace", workspace, "replay", path, "--engine", "hy", "--policy", "boundaries",
                           "--max-tokens", "4", "--json")
    assert code == 0, out
    row = json.loads(out)["policies"][0]["traces"]["text.jsonl"]
    assert row["identical"] is True and row["restores"] == 2
    first = row["detail"][1]["reused"]
    assert first > 20 and row["detail"][2]["reused"] == first  # the system prompt, restored each time
