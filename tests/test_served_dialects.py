"""The http adapter against the servers people run, each in its own dialect, through the real CLI:
vLLM for CPUs (set up once by gatekeeper.setup.vllm), mlx_lm.server on a tiny model, and
llama-cpp-python's own server. For vLLM and mlx: PASS on a healthy pair of deployments (cache off,
cache on), FAIL against a deployment that really computes differently, a flag-off deployment that
serves from its cache is no baseline, and bad answers abort the evaluation with the ledger intact.
llama-cpp-python's server reports no cached tokens: never a PASS on a "0" it did not measure.
(llama.cpp's llama-server has its own module, test_engine_http.py.)"""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import pytest
from conftest import ledger
from served import (
    BAD_ANSWERS,
    TEXTS,
    assert_aborted,
    evaluate,
    faulty_front,
    forced_agreement,
    llama_cpp_python_server,
    mlx_server,
    not_blamed_on_batching,
    read_distance,
    read_reference,
    served_ws,
    vllm_server,
)

from gatekeeper.engines.http import HTTPEngine
from gatekeeper.engines.torch import TorchEngine
from gatekeeper.gate.arms.reference import GAP
from gatekeeper.setup.models import default_model_dir, find_gguf
from gatekeeper.workspace import EngineProfile

pytestmark = pytest.mark.slow


def profile(off: str, on: str, *extra: str) -> str:
    extra = extra if any(e.startswith("timeout:") for e in extra) else (*extra, "timeout: 600")
    return "\n".join(["adapter: http", f"url: {off}", f"url_on: {on}", *extra]) + "\n"


def started(*servers):
    """Start servers side by side (vLLM takes minutes to come up); yields their URLs, stops them all."""
    stack = ExitStack()
    with ThreadPoolExecutor(len(servers)) as pool:
        futures = [pool.submit(lambda cm: (cm, cm.__enter__()), cm) for cm in servers]
    try:
        urls = []
        for f in futures:
            cm, url = f.result()  # a server that did not start fails the fixture, naming its log
            stack.push(cm.__exit__)
            urls.append(url)
    except BaseException:
        for f in futures:
            if f.exception() is None:
                f.result()[0].__exit__(None, None, None)
        raise
    return stack, urls


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


# --- mlx_lm.server ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mlx(tmp_path_factory, tiny_llama):
    """The tiny model served with its prompt cache off and on, and a copy with another RoPE base."""
    logs = tmp_path_factory.mktemp("mlx")
    other = logs / "other-rope"
    shutil.copytree(tiny_llama, other)
    config = json.loads((other / "config.json").read_text())
    config["rope_theta"] = config.get("rope_theta", 10000.0) * 8
    (other / "config.json").write_text(json.dumps(config))
    stack, (off, on, rope) = started(
        mlx_server(tiny_llama, "--prompt-cache-size", "0", log=logs / "off.log"),
        mlx_server(tiny_llama, log=logs / "on.log"),
        mlx_server(other, log=logs / "rope.log"),
    )
    with stack:
        yield {"off": off, "on": on, "rope": rope, "model": tiny_llama}


def test_mlx_pass_on_a_healthy_pair_with_a_local_tokenizer(mlx, workspace, run_cli):
    ws = served_ws(workspace, mlx=profile(mlx["off"], mlx["on"], f"tokenizer: {mlx['model']}"))
    read_reference(ws)
    read_distance(ws)
    code, out = evaluate(run_cli, ws, "mlx")
    assert code == 0, out
    assert out["verdict"] == "PASS" and out["exercised_share"] >= 0.95, out
    # the distance, by forced requests where an answer's tokens come back from their text (every turn's first position:
    # the prompt as rendered does); two cold reads of the same text agree exactly (the A/A floor)
    moved, floor = out["distance"]["distance"], out["distance"]["floor"]
    assert "mlx_lm.server gives no prompt log-probabilities" in out["distance"]["caveat"]
    assert moved["positions"] == floor["positions"] >= 6 and floor["kld"]["max"] == 0, (moved, floor)
    assert moved["approximation"].startswith("top10"), moved
    r = out["reference"]  # the flag-off deployment (prompt cache size 0) read at each answer's first token
    assert r["dtype"].startswith("mlx_lm.server") and not any(r["departs"].values()), r
    assert r["arms"]["off"]["positions"] >= 4
    ev = ledger(ws).evaluation(out["evaluation_id"])
    assert ev["identity"]["on"]["engine"]["dialect"]["name"] == "mlx"
    turns = {cfg: [t for r in ev["case_results"] if r["config"] == cfg for t in r["result"]["turns"]] for cfg in ("off", "on")}
    assert all(t["cached_tokens"] == 0 for t in turns["off"])  # --prompt-cache-size 0 really reuses nothing
    assert all(t["top2"] and t["top2"][0][0][0] == t["tokens"][0] for t in turns["on"])


def test_mlx_cold_reads_agree_with_the_in_process_reference(mlx):
    """mlx_lm.server's forced reads (its flag-off deployment, text prompts round-tripped) against gatekeeper's
    in-process reference (float64) on the same weights; where a random model's answer does not come back from its
    text, the read is refused (counted out), never made on other tokens."""
    local = TorchEngine(EngineProfile(name="t", adapter="torch", model=str(mlx["model"]), dtype="float32"))
    served = HTTPEngine(EngineProfile(name="s", adapter="http", url=mlx["off"], tokenizer=str(mlx["model"])))
    try:
        worst, floor, compared = forced_agreement(local, served, TEXTS)
    finally:
        served.close()
    assert compared >= 10 and worst <= GAP * floor, (worst, floor, compared)


def test_mlx_fail_against_another_rope_base(mlx, workspace, run_cli):
    ws = served_ws(workspace, planted=profile(mlx["off"], mlx["rope"], f"tokenizer: {mlx['model']}"))
    read_distance(ws)
    code, out = evaluate(run_cli, ws, "planted")
    assert code == 1, out
    assert out["verdict"] == "FAIL" and out["differing_cases"]
    moved, floor = out["distance"]["distance"], out["distance"]["floor"]  # another RoPE base moves the distributions
    assert moved["kld"]["mean"] > max(1e-4, 10 * floor["kld"]["mean"]), (moved["kld"], floor["kld"])


def test_mlx_samples_by_its_seed_and_refuses_penalties_it_counts_otherwise(mlx, workspace, run_cli):
    """mlx_lm.server runs the suite's decoding with the draw's key as its seed: the same seeds give the same answers
    again, the samples of a case draw apart, and its prompt cache pairs token for token. Presence and frequency
    penalties, which it counts over the prompt too, are exit 2 before anything runs."""
    from conftest import SHORT, suite

    ws = served_ws(workspace, mlx=profile(mlx["off"], mlx["on"], f"tokenizer: {mlx['model']}"))
    read_reference(ws)
    decoding = "decoding: {max_tokens: 12, temperature: 0.9, top_p: 0.95, top_k: 40, samples: 2}"
    (ws / "assertions" / "tiny.yaml").write_text(suite(SHORT).replace("decoding: {max_tokens: 12}", decoding))
    code, out = evaluate(run_cli, ws, "mlx")
    assert out["verdict"] == "PASS", out["reasons"]
    s = out["sampling"]
    assert s["chain"]["sampler"] == "mlx_lm.server" and s["mismatches"] == 0 and out["equal"]["baseline"] == 8, s
    assert s["controls"]["unpaired"] == "seen", s["controls"]
    ev = ledger(ws).evaluation(out["evaluation_id"])
    answers = {r["case_id"]: tuple(r["result"]["turns"][0]["tokens"]) for r in ev["case_results"] if r["config"] == "on"}
    assert any(answers[f"tiny/{c}~1"] != answers[f"tiny/{c}~2"] for c in "abc")  # the samples draw apart
    # a sampled answer gives no likeliest tokens here: the reference arm reads none of them, never a draw as a flip
    assert not any(out["reference"]["departs"].values()), out["reference"]
    (ws / "assertions" / "tiny.yaml").write_text(suite(SHORT).replace(
        "decoding: {max_tokens: 12}", "decoding: {max_tokens: 12, temperature: 0.9, presence_penalty: 0.5}"))
    code, refused = evaluate(run_cli, ws, "mlx")
    assert code == 2 and "field 'decoding'" in refused["error"] and "presence" in refused["error"], refused


def test_mlx_without_a_tokenizer_is_exit_2_naming_the_field(mlx, workspace, run_cli):
    ws = served_ws(workspace, bare=profile(mlx["off"], mlx["on"]))
    code, out = evaluate(run_cli, ws, "bare")
    assert code == 2
    assert "engines/bare.yaml: field 'tokenizer' is required for dialect mlx" in out["error"]
    assert not (ws / "ledger" / "evidence.db").exists() or ledger(ws).evaluations() == []


@pytest.mark.parametrize("mode, timeout, message", BAD_ANSWERS)
def test_mlx_bad_answers_abort_the_evaluation_and_keep_the_ledger(mlx, workspace, run_cli, mode, timeout, message):
    with faulty_front(mlx["off"], mode, delay=3) as front:
        ws = served_ws(workspace, bad=profile(front, mlx["on"], f"tokenizer: {mlx['model']}", f"timeout: {timeout}"))
        code, out = evaluate(run_cli, ws, "bad")
    assert_aborted(code, out, front, message, ws)


# --- llama-cpp-python's server ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_cpp_python(tmp_path_factory):
    """Its "off" deployment (no prompt cache) and "on" (its RAM prompt cache): neither reports cached tokens."""
    logs = tmp_path_factory.mktemp("llama-cpp-python")
    stack, (off, on) = started(llama_cpp_python_server(find_gguf(), log=logs / "off.log"),
                               llama_cpp_python_server(find_gguf(), "--cache", "true", log=logs / "on.log"))
    with stack:
        yield {"off": off, "on": on}


def test_llama_cpp_python_is_not_observable_never_a_pass_on_zero(llama_cpp_python, workspace, run_cli):
    ws = served_ws(workspace, lcp=profile(llama_cpp_python["off"], llama_cpp_python["on"], "tokenizer: default"))
    code, out = evaluate(run_cli, ws, "lcp")
    assert code == 1, out
    assert out["verdict"] == "INCONCLUSIVE" and out["reasons"][0].startswith("not_observable:"), out["reasons"]
    assert out["tokens"]["cached_on"] is None and out["tokens"]["computed_on"] is None
    ev = ledger(ws).evaluation(out["evaluation_id"])
    assert ev["identity"]["on"]["engine"]["dialect"]["name"] == "openai"
    assert all(t["cached_tokens"] is None for r in ev["case_results"] for t in r["result"]["turns"])
    # a policy that explicitly accepts an unobservable cache may pass on outputs alone, and says so
    policy = ws / "policies" / "prefix_cache.yaml"
    policy.write_text(policy.read_text().replace("exercise_floor: {min_cached_share: 0.5}",
                                                 "exercise_floor: {min_cached_share: 0.5, accept_unobservable: true}"))
    code, out = evaluate(run_cli, ws, "lcp")
    assert code == 0 and out["verdict"] == "PASS", out["reasons"]
    assert any(r.startswith("not_observable:") and "(accepted" in r for r in out["reasons"])
    # its reuse is not exact: the top-2 logprobs moved, which the strength of the PASS shows
    assert out["strength"]["grade"] == "equal_outputs" and out["strength"]["max_drift"] > 0


def test_measure_prints_n_a_for_a_figure_the_server_does_not_report(llama_cpp_python, workspace, run_cli):
    ws = served_ws(workspace, lcp=profile(llama_cpp_python["off"], llama_cpp_python["on"], "tokenizer: default"))
    code, out, err = run_cli("--workspace", ws, "measure", "--engine", "lcp", "--limit", "1")
    assert code == 0, err
    row = next(line for line in out.splitlines() if line.strip().startswith("│ tiny") or " tiny " in line)
    assert "n/a" in row and " 0 " not in row.split("│")[4]


def test_evaluate_prints_its_table_when_the_server_reports_no_cached_tokens(llama_cpp_python, workspace, run_cli):
    """The table, not only --json: a figure the server does not report prints as n/a (it once crashed there, exit 3,
    with the verdict already in the ledger)."""
    ws = served_ws(workspace, lcp=profile(llama_cpp_python["off"], llama_cpp_python["on"], "tokenizer: default"))
    code, out, err = run_cli("--workspace", ws, "evaluate", "--flag", "prefix_cache", "--engine", "lcp",
                             "--operator", "ci", "--limit", "1")
    assert code == 1, err  # INCONCLUSIVE: not observable
    assert "verdict: INCONCLUSIVE" in out and "prefill saved with the flag on: n/a tokens" in out
    assert "not_observable:" in out and "internal error" not in out + err


def test_llama_cpp_python_samples_by_its_seed_and_refuses_penalties(llama_cpp_python, workspace, run_cli):
    """llama-cpp-python's server runs the suite's decoding with the draw's key as its seed, measured: the flag-off
    side's repeats under the same keys give the same answers, the samples of a case draw apart, and the sides pair.
    A penalty, which it counts over a window of its own setting, is exit 2 before anything runs."""
    from conftest import SHORT, suite

    ws = served_ws(workspace, lcp=profile(llama_cpp_python["off"], llama_cpp_python["on"], "tokenizer: default"))
    policy = ws / "policies" / "prefix_cache.yaml"
    policy.write_text(policy.read_text().replace("exercise_floor: {min_cached_share: 0.5}",
                                                 "exercise_floor: {min_cached_share: 0.5, accept_unobservable: true}"))
    decoding = "decoding: {max_tokens: 12, temperature: 0.9, top_p: 0.95, top_k: 40, samples: 2}"
    (ws / "assertions" / "tiny.yaml").write_text(suite(SHORT).replace("decoding: {max_tokens: 12}", decoding))
    code, out = evaluate(run_cli, ws, "lcp", "--limit", "2")
    s = out["sampling"]
    assert s["chain"]["sampler"] == "llama-cpp-python" and s["unpaired"] is None, s
    assert out["verdict"] == "PASS" and out["equal"]["baseline"] == 4, out["reasons"]  # seeds honoured on repeat
    assert s["answers"] == 4 and s["mismatches"] == 0 and s["steps"] > 4 and s["controls"]["unpaired"] == "seen", s
    ev = ledger(ws).evaluation(out["evaluation_id"])
    answers = {r["case_id"]: tuple(r["result"]["turns"][0]["tokens"]) for r in ev["case_results"] if r["config"] == "off"}
    assert any(answers[f"tiny/{c}~1"] != answers[f"tiny/{c}~2"] for c in "ab")  # the samples draw apart
    (ws / "assertions" / "tiny.yaml").write_text(suite(SHORT).replace(
        "decoding: {max_tokens: 12}", "decoding: {max_tokens: 12, temperature: 0.9, repetition_penalty: 1.1}"))
    code, refused = evaluate(run_cli, ws, "lcp")
    assert code == 2 and "field 'decoding'" in refused["error"] and "last_n_tokens_size" in refused["error"], refused
