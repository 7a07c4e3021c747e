"""The cache probes every evaluation adds (gate/arms/probes.py): they run on both sides in one order, pass on a
correct cache, and each catches a planted fault of its kind that the battery alone never meets (a real
llama-server behind a front that plants it on the flag-on side)."""

from __future__ import annotations

import json

import pytest
from cache_fronts import cache_front
from conftest import evaluate, ledger, read_reference
from served import llama_server, served_ws

from gatekeeper.setup.models import find_gguf


def probes(ws, text: str | None) -> None:
    """The prefix_cache policy with ``probes: text`` instead of the fixture's ``probes: off`` (None: the default)."""
    policy = ws / "policies" / "prefix_cache.yaml"
    body = "".join(line for line in policy.read_text().splitlines(keepends=True) if not line.startswith("probes:"))
    policy.write_text(body + (f"probes: {text}\n" if text else ""))


def test_probes_run_on_both_sides_and_pass_on_a_correct_cache(run_cli, tiny_ws):
    probes(tiny_ws, "{window: 64}")  # the tiny model has no sliding window: cross a 64-token one
    code, out = evaluate(run_cli, tiny_ws, "tiny")
    assert (code, out["verdict"]) == (0, "PASS"), out["reasons"]
    assert out["probes"] == dict.fromkeys(("repeat", "continuation", "inside", "block", "window", "split"), "equal")
    line = next(r for r in out["reasons"] if r.startswith("probes:"))
    assert "repeat equal" in line and "window equal" in line
    assert out["probe_seconds"] > 0
    with ledger(tiny_ws) as lg:
        ev = lg.evaluation(out["evaluation_id"])
    runs = {}
    for r in ev["case_results"]:
        if r["case_id"].startswith("probe:"):
            runs.setdefault((r["config"], r["repeat"]), []).append(r["case_id"])
    order = ["probe:repeat", "probe:continuation", "probe:inside", "probe:block", "probe:window", "probe:split"]
    assert runs == {("off", 0): order, ("off", 1): order, ("on", 0): order}  # every run, one order
    by_id = {(r["case_id"], r["config"]): r["result"] for r in ev["case_results"] if r["repeat"] == 0}
    repeat, window = by_id[("probe:repeat", "on")], by_id[("probe:window", "on")]
    assert repeat["turns"][0]["tokens"] == repeat["turns"][1]["tokens"]
    assert repeat["turns"][1]["cached_tokens"] > 0  # the repeat was served from the cache with the flag on
    assert window["turns"][0]["prompt_tokens"] > 64 and window["turns"][1]["cached_tokens"] > 64
    pairs = {(c["case_id"], c["detail"]["pair"]) for c in ev["comparisons"] if c["case_id"].startswith("probe:")}
    assert ("probe:inside", "off#0~on#0") in pairs and ("probe:inside", "off#0~off#1") in pairs


def test_a_model_without_a_window_skips_that_probe_and_says_why(run_cli, tiny_ws):
    probes(tiny_ws, None)
    code, out = evaluate(run_cli, tiny_ws, "tiny")
    assert code == 0, out["reasons"]
    assert out["probes"]["window"].startswith("skipped: no sliding window in the model's config")
    assert out["probes"]["repeat"] == "equal"


def test_a_cut_that_restarts_positions_is_a_base_defect_the_cases_alone_cannot_see(run_cli, tiny_ws, tiny_llama):
    """mlx-lm's GPT-2 bug planted in the torch adapter: every pass restarts its positions at 0. The aligned plan cuts
    both sides at the stage prefix, so the cases agree (PASS with the probes and the reference arm off); the split
    probe sees the cut on both sides, and so does the reference arm: the base is broken, never a PASS."""
    (tiny_ws / "engines" / "restart.yaml").write_text(
        f"adapter: fault_engines:PositionsRestart\nmodel: {tiny_llama}\ndtype: float32\ndevice: cpu\n")
    policy = tiny_ws / "policies" / "prefix_cache.yaml"
    probes(tiny_ws, "off")
    policy.write_text(policy.read_text() + "reference: false\n")
    code, out = evaluate(run_cli, tiny_ws, "restart")
    assert (code, out["verdict"]) == (0, "PASS"), out["reasons"]
    probes(tiny_ws, "{kinds: [split]}")
    code, out = evaluate(run_cli, tiny_ws, "restart")
    assert (code, out["verdict"]) == (1, "INCONCLUSIVE"), out["reasons"]
    assert out["probes"] == {"split": "base_defect"}
    assert out["reasons"][0].startswith("base_defect: probe:split both sides chose otherwise"), out["reasons"]
    probes(tiny_ws, "off")
    policy.write_text(policy.read_text().replace("reference: false\n", ""))
    code, out = evaluate(run_cli, tiny_ws, "restart")
    assert (code, out["verdict"]) == (1, "INCONCLUSIVE"), out["reasons"]
    assert out["reasons"][0].startswith("base_defect: both arms depart from a cache-free read"), out["reasons"]
    probes(tiny_ws, "{kinds: [split]}")
    code, out = evaluate(run_cli, tiny_ws, "tiny")  # the adapter as it is: the cut changes nothing
    assert (code, out["verdict"], out["probes"]) == (0, "PASS", {"split": "equal"}), out["reasons"]


def test_a_flag_off_side_that_answers_its_repeat_differently_is_named_stale_state(run_cli, tiny_ws, tiny_llama):
    (tiny_ws / "engines" / "stale.yaml").write_text(
        f"adapter: fault_engines:StaleRepeat\nmodel: {tiny_llama}\ndtype: float32\ndevice: cpu\n")
    probes(tiny_ws, "{kinds: [repeat]}")
    read_reference(tiny_ws)
    code, out = evaluate(run_cli, tiny_ws, "stale")
    assert out["verdict"] == "INCONCLUSIVE", out["reasons"]
    assert any(x.startswith("stale_state: probe:repeat the flag-off") for x in out["reasons"]), out["reasons"]
    # the reference arm reads the probe's answers too: both arms' repeat departs from a cache-free read of its prompt
    assert out["reasons"][0].startswith("base_defect: both arms depart"), out["reasons"]
    assert {d["case"] for d in out["reference"]["arms"]["off"]["departures"]} == {"probe:repeat"}


def test_probes_off_run_none(run_cli, tiny_ws):
    probes(tiny_ws, "off")
    code, out = evaluate(run_cli, tiny_ws, "tiny")
    assert code == 0 and out["probes"] == {}
    assert not any(r.startswith("probes:") for r in out["reasons"])


# --- planted faults on a real server ------------------------------------------------------------

EXACT = ("-fa", "off")  # with flash attention off, llama.cpp's cache hit is exact on this model
WINDOW = 512  # longer than any of the tiny battery's prompts: only the window probe crosses it


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with llama_server(find_gguf(), *EXACT, log=tmp_path_factory.mktemp("logs") / "server.log") as url:
        yield url


def fronted(workspace, server, front, policy_probes):
    ws = served_ws(workspace, served=f"adapter: http\nurl: {server}\nurl_on: {front}\ncache_switch: cache_prompt\ntimeout: 600\n")
    probes(ws, policy_probes)
    return ws


def served_evaluate(run_cli, ws):
    code, out, _ = run_cli("--workspace", ws, "evaluate", "--flag", "prefix_cache", "--engine", "served",
                           "--operator", "ci", "--limit", "2", "--json")  # two cases: the probes are the subject
    return code, json.loads(out)


@pytest.mark.slow
def test_probes_pass_a_correct_server_behind_a_faithful_front(server, workspace, run_cli):
    with cache_front(server, "none") as (front, history):
        ws = fronted(workspace, server, front, f"{{window: {WINDOW}}}")
        code, out = served_evaluate(run_cli, ws)
    assert (code, out["verdict"]) == (0, "PASS"), out["reasons"]
    split = out["probes"].pop("split")  # a server chooses its own prefill passes
    assert set(out["probes"].values()) == {"equal"} and split.startswith("skipped: a server chooses its own prefill")
    assert out["reached"] == {"off": [server], "on": [front]}
    assert history.planted == 0


@pytest.mark.slow
@pytest.mark.parametrize("mode, probe", [("stale_repeat", "repeat"), ("inside_empty", "inside"),
                                         ("continuation_skip", "continuation"), ("lost_window", "window")])
def test_each_probe_catches_its_planted_fault(server, workspace, run_cli, mode, probe):
    with cache_front(server, mode, WINDOW) as (front, history):  # only the probe under test runs: each stands alone
        ws = fronted(workspace, server, front, f"{{kinds: [{probe}], window: {WINDOW}}}")
        code, out = served_evaluate(run_cli, ws)
    assert history.planted > 0
    assert (code, out["verdict"]) == (1, "FAIL"), out["reasons"]
    assert out["probes"][probe] == "differs", out["probes"]
    assert any(r.startswith(f"differs: probe:{probe} ") for r in out["reasons"]), out["reasons"]
    with ledger(ws) as lg:
        assert lg.verify().ok


@pytest.mark.slow
def test_the_battery_alone_misses_a_stale_repeat(server, workspace, run_cli):
    """The same fault with the probes off: nothing in the battery repeats a prompt, so it PASSes."""
    with cache_front(server, "stale_repeat") as (front, history):
        ws = fronted(workspace, server, front, "off")
        code, out = served_evaluate(run_cli, ws)
    assert history.planted == 0 and (code, out["verdict"]) == (0, "PASS"), out["reasons"]
