"""The http adapter against vLLM for CPUs (set up once by gatekeeper.setup.vllm), through the real CLI: PASS on a
healthy pair of deployments (prefix caching off, on), FAIL against one that really computes differently (bfloat16),
a flag-off deployment that serves from its cache is no baseline, and bad answers abort the evaluation with the ledger
intact. (One module per server, so the suite's workers share them out; llama-server: test_engine_http.py.)"""

from __future__ import annotations

import pytest
from conftest import ledger, read_reference
from served import (
    BAD_ANSWERS,
    assert_aborted,
    evaluate,
    faulty_front,
    forced_agreement,
    not_blamed_on_batching,
    profile,
    read_distance,
    served_ws,
    started,
    vllm_server,
)
from test_guard import _no_proxy_outlives_its_test, guarded_ws, metrics, start, stop, wait  # noqa: F401
from trust import keys  # noqa: F401

from gatekeeper.engines.served.http import HTTPEngine
from gatekeeper.engines.torch import TorchEngine
from gatekeeper.gate.arms.reference import GAP
from gatekeeper.setup.models import default_model_dir
from gatekeeper.workspace import EngineProfile

pytestmark = pytest.mark.slow


# --- vLLM ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm(tmp_path_factory):
    """Three deployments of the default model: prefix caching off, on, and on in bfloat16 (another dtype)."""
    logs = tmp_path_factory.mktemp("vllm")
    model = default_model_dir()
    stack, (off, on, bf16) = started(
        vllm_server(model, "--dtype", "float32", "--no-enable-prefix-caching", log=logs / "off.log"),
        vllm_server(model, "--dtype", "float32", "--enable-prefix-caching", log=logs / "on.log"),
        vllm_server(model, "--dtype", "bfloat16", "--enable-prefix-caching", log=logs / "bf16.log"),
    )
    with stack:
        yield {"off": off, "on": on, "bf16": bf16}


def test_vllm_pass_on_a_healthy_pair_with_the_cache_in_whole_blocks(vllm, workspace, run_cli):
    ws = served_ws(workspace, vllm=profile(vllm["off"], vllm["on"]))
    read_distance(ws)
    read_reference(ws)
    code, out = evaluate(run_cli, ws, "vllm")
    assert code == 0, out
    assert out["verdict"] == "PASS" and out["equal"] == {"baseline": 4, "off_on": 4}
    # the reference arm: the flag-off deployment's prompt log-probabilities at each answer's first token
    r = out["reference"]
    assert r["dtype"].startswith("vLLM (prompt log-probabilities") and not r["departs"]["off"], r
    assert r["arms"]["off"]["positions"] >= 4 and r["arms"]["on"]["flipped"] == 0
    # read teacher-forced from vLLM's prompt log-probabilities (top 20, the rest lumped): the same weights and
    # dtype move nothing, and the record says the flag-on server reads no cached prefix for such a request
    moved, floor = out["distance"]["distance"], out["distance"]["floor"]
    assert moved["positions"] > 0 and moved["approximation"].startswith("top20") and floor["kld"]["max"] < 1e-4, moved
    assert moved["kld"]["mean"] < 1e-3 and moved["same_top1"] == 1 and "no cached prefix" in out["distance"]["caveat"]
    bound = out["tokens"]["stable_prefix_bound"]
    assert bound > 0 and bound % 32 == 0  # whole 32-token blocks: what vLLM can serve
    assert out["exercised_share"] >= 0.95, out["tokens"]
    ev = ledger(ws).evaluation(out["evaluation_id"])
    engine = ev["identity"]["on"]["engine"]
    assert engine["dialect"]["name"] == "vllm" and "owned_by vllm" in engine["dialect"]["detected"]
    assert engine["cache_granularity"] == 32
    turns = {cfg: [t for r in ev["case_results"] if r["config"] == cfg for t in r["result"]["turns"]] for cfg in ("off", "on")}
    assert all(t["cached_tokens"] == 0 for t in turns["off"])
    assert all(t["cached_tokens"] % 32 == 0 for t in turns["on"]) and any(t["cached_tokens"] for t in turns["on"])
    # vLLM's own per-request figures, and top-2 logprobs keyed by token id
    assert all(t["prefill_s"] > 0 and t["decode_s"] > 0 for t in turns["on"])
    assert all(t["top2"] and t["top2"][0][0][0] == t["tokens"][0] for t in turns["on"])
    assert ledger(ws).verify().ok


def test_vllm_samples_by_the_draws_seed_and_pairs_an_exact_cache(vllm, workspace, run_cli):
    """A sampled suite (#47): the decoding goes with each request and the draw's key as vLLM's per-request seed; the
    same seeds give the same answers again, and the cache pairs token for token."""
    ws = served_ws(workspace, vllm=profile(vllm["off"], vllm["on"]))
    suite = ws / "assertions" / "tiny.yaml"
    suite.write_text(suite.read_text().replace("decoding: {max_tokens: 12}", "decoding: {max_tokens: 12, temperature: "
                                               "0.9, top_k: 20, top_p: 0.95, samples: 3}"))
    code, out = evaluate(run_cli, ws, "vllm", "--limit", "2")
    assert out["verdict"] == "PASS" and out["equal"] == {"baseline": 6, "off_on": 6}, out["reasons"]
    s = out["sampling"]
    assert s["answers"] == 6 and s["mismatches"] == 0 and s["chain"]["sampler"] == "vllm"
    # each side's draws, read from vLLM's top 20 raw log-probabilities through its documented chain, follow the
    # declared decoding
    assert min(s["declared"]["off"]["p"], s["declared"]["on"]["p"]) > 0.025 and s["declared"]["off"]["steps"] >= 40, s
    ev = ledger(ws).evaluation(out["evaluation_id"])
    first = {r["case_id"]: r["result"]["turns"][0]["tokens"] for r in ev["case_results"] if r["config"] == "off"}
    assert any(first[f"tiny/{c}~1"] != first[f"tiny/{c}~2"] for c in "ab")  # the samples draw apart


def test_vllm_cold_reads_agree_with_the_in_process_reference(vllm):
    """vLLM's prompt log-probabilities (float32, the flag-off deployment) against gatekeeper's in-process reference
    on the same weights, at every position of the model's own answers."""
    local = TorchEngine(EngineProfile(name="t", adapter="torch", model=str(default_model_dir()), dtype="float32"))
    served = HTTPEngine(EngineProfile(name="s", adapter="http", url=vllm["off"]))
    try:
        worst, floor, compared = forced_agreement(local, served)
    finally:
        served.close()
    assert compared >= 20 and worst <= GAP * floor, (worst, floor, compared)


def test_vllm_under_load_batches_the_battery_and_never_blames_batching_on_the_flag(vllm, workspace, run_cli):
    """Four requests kept in flight on each deployment, the battery's among them (vLLM batches them; on one core a
    step costs about what its batch holds, so four rather than eight); the battery also runs alone. What vLLM for CPUs
    does under that load is recorded in the comparisons, whatever it is."""
    ws = served_ws(workspace, vllm=profile(vllm["off"], vllm["on"]))
    code, out = evaluate(run_cli, ws, "vllm", "--load", "4")
    ev = ledger(ws).evaluation(out["evaluation_id"])
    assert ev["identity"]["on"]["load"]["concurrency"] == 4
    assert len([c for c in ev["comparisons"] if c["detail"]["pair"] == "alone#0~off#0"]) == 4
    not_blamed_on_batching(code, out, ev, "vLLM: set VLLM_BATCH_INVARIANT=1")
    assert ledger(ws).verify().ok


def test_vllm_fail_against_another_dtype(vllm, workspace, run_cli):
    """bfloat16 weights move every distribution on every CPU; whether they also move a token depends on the CPU's
    rounding at the battery's near-ties (one Xeon kept float32's tokens behind twelve rules). So the policy bounds
    the distance (``max_kld``), and the change is refused by what it changes by construction: the logits."""
    ws = served_ws(workspace, planted=profile(vllm["off"], vllm["bf16"]))
    read_distance(ws)
    policy = ws / "policies" / "prefix_cache.yaml"
    policy.write_text(policy.read_text() + "max_kld: 1.0e-6\n")
    code, out = evaluate(run_cli, ws, "planted")
    assert code == 1, out
    assert out["verdict"] == "FAIL", out["reasons"]
    refused = [r for r in out["reasons"] if r.startswith(("differs:", "distance:"))]
    assert refused, out["reasons"]
    # bfloat16 moves every distribution, far above the A/A floor of the float32 server against itself
    moved, floor = out["distance"]["distance"], out["distance"]["floor"]
    assert moved["kld"]["mean"] > max(1e-5, 10 * floor["kld"]["mean"]), (moved["kld"], floor["kld"])


def test_vllm_a_cached_baseline_is_no_baseline(vllm, workspace, run_cli):
    ws = served_ws(workspace, swapped=profile(vllm["on"], vllm["off"]))
    code, out = evaluate(run_cli, ws, "swapped")
    assert code == 1, out
    assert out["verdict"] == "INCONCLUSIVE" and out["reasons"][0].startswith("baseline_cached:")
    assert "--no-enable-prefix-caching" in out["reasons"][0]


@pytest.mark.parametrize("mode, timeout, message", BAD_ANSWERS)
def test_vllm_bad_answers_abort_the_evaluation_and_keep_the_ledger(vllm, workspace, run_cli, mode, timeout, message):
    # in front of the flag-off deployment, whose requests come first (a 1 s timeout also bounds the real server)
    with faulty_front(vllm["off"], mode, delay=3) as front:
        ws = served_ws(workspace, bad=profile(front, vllm["on"], f"timeout: {timeout}"))
        code, out = evaluate(run_cli, ws, "bad")
    assert_aborted(code, out, front, message, ws)


def test_vllm_the_guard_reads_both_sides_prompt_log_probabilities(vllm, workspace, keys, tmp_path, run_cli):  # noqa: F811
    """The guard's teacher-forced distance on vLLM (issue #61 item 2): each compared request's flag-off answer read by
    both deployments in one prompt-log-probabilities request each; bfloat16 weights on the flag-on side move every
    distribution (by construction), so the reads depart though the mismatch rule (limit 0.9) tolerates the texts."""
    from test_guard_compared import chat, live

    ws = guarded_ws(workspace, keys, {"rate": 1, "limit": 0.9, "assertions": False, "distance": True, "max_kld": 1e-6,
                                      "alpha": 0.05, "min_comparisons": 3, "batch": 1, "flush_s": 0.5, "timeout_s": 120,
                                      "aa_rate": 0})
    (ws / "engines" / "off.yaml").write_text(profile(vllm["off"], vllm["off"]))
    where, proc = start(ws, keys, vllm["bf16"], None, "--shadow-engine", "off", log=tmp_path / "proxy.log")
    sent = 0
    while sent < 8 and metrics(where)['gatekeeper_guard_flag_on{flag="prefix_cache"}'] == 1:
        chat(where, sent)
        sent += 1
        wait(lambda: metrics(where)['gatekeeper_guard_in_flight{flag="prefix_cache"}'] == 0, what="the shadow")
    assert stop(proc) == 1, (tmp_path / "proxy.log").read_text()
    got = live(run_cli, ws)
    assert got["rolled_back"] and "the distance: " in got["ended_by"]["reason"], got["ended_by"]
    assert got["judged"]["read"] == got["compared"] >= 3 and got["judged"]["departed"] >= 1
    kept = [i for i in got["mismatched"] if "kld" in i]
    assert kept and all(i["kld"] > 1e-6 and i["compared_by"][-1] == "distance" for i in kept)
