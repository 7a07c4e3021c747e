"""The http adapter against mlx_lm.server on a tiny model, through the real CLI: PASS on a healthy pair (prompt cache
off, on) with a local tokenizer, FAIL against another RoPE base, samples by its seed, and bad answers abort the
evaluation with the ledger intact."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import ledger, read_reference
from served import (
    BAD_ANSWERS,
    TEXTS,
    assert_aborted,
    evaluate,
    faulty_front,
    forced_agreement,
    mlx_server,
    profile,
    read_distance,
    served_ws,
    started,
)

from gatekeeper.engines.served.http import HTTPEngine
from gatekeeper.engines.torch import TorchEngine
from gatekeeper.gate.arms.reference import GAP
from gatekeeper.workspace import EngineProfile

pytestmark = pytest.mark.slow


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
