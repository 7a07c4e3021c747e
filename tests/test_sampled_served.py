"""Sampled decoding on real servers (#47): the suite's decoding goes with each request and the draw's key as the
server's own per-request seed, on llama-server (its cache switched per request) and vLLM's CPU build. Both sides send
the same seeds, so an exact cache pairs token for token; a seed the server honours gives the same answer again."""

from __future__ import annotations

import pytest
from conftest import SHORT, suite
from served import F32, evaluate, faulty_front, llama_server, served_ws

from gatekeeper.ledger import Ledger

pytestmark = pytest.mark.slow


@pytest.fixture
def tiny(tiny_gguf):
    return tiny_gguf


SAMPLED = "decoding: {max_tokens: 12, temperature: 0.9, top_k: 50, top_p: 0.95, repetition_penalty: 1.2, samples: 2}"


def engines(ws, extra: str = "", **urls: str) -> None:
    """One llama-server profile per name (its cache switched per request)."""
    for name, url in urls.items():
        (ws / "engines" / f"{name}.yaml").write_text(
            f"adapter: http\nurl: {url}\ncache_switch: cache_prompt\ntimeout: 600\n{extra}")


def sampled(ws):
    (ws / "assertions" / "tiny.yaml").write_text(suite(SHORT).replace("decoding: {max_tokens: 12}", SAMPLED))
    return ws


def test_llama_server_pairs_by_its_seed_and_passes_an_exact_cache(tiny, workspace, run_cli, tmp_path):
    with llama_server(tiny / "model.gguf", *F32, log=tmp_path / "server.log") as url:
        ws = sampled(served_ws(workspace, served=f"adapter: http\nurl: {url}\ncache_switch: cache_prompt\ntimeout: 600\n"))
        code, out = evaluate(run_cli, ws, "served")
    assert out.get("verdict") == "PASS", out
    s = out["sampling"]
    assert s["answers"] == 8 and s["mismatches"] == 0 and s["steps"] >= 8 and s["chain"]["sampler"] == "llama-server"
    assert out["equal"]["baseline"] == 8  # the same seeds gave the same answers again
    with Ledger(f"sqlite:///{ws / 'ledger' / 'evidence.db'}") as lg:
        rows = [r for r in lg.evaluation(out["evaluation_id"])["case_results"] if r["config"] == "on"]
    answers = {r["case_id"]: tuple(r["result"]["turns"][0]["tokens"]) for r in rows}
    assert any(answers[f"tiny/{c}~1"] != answers[f"tiny/{c}~2"] for c in "abc")  # the samples draw apart
    assert sum(t["cached_tokens"] for r in rows for t in r["result"]["turns"]) > 0  # the cache was used


# no penalty, and a top-k within the 20 log-probabilities llama-server lists: each draw can be read exactly against
# the declared decoding through llama-server's own chain
READABLE = "decoding: {max_tokens: 12, temperature: 0.9, top_k: 20, top_p: 0.95, samples: 2}"


def test_llama_servers_draws_follow_its_documented_chain_and_a_hotter_one_is_a_base_defect(tiny, workspace, run_cli,
                                                                                            tmp_path):
    """Each side's draws against the declared decoding, read from the top log-probabilities llama-server returns
    through its documented chain (top-k, top-p, min-p, then temperature): uniform transforms on the real server; with
    every request forwarded at twice its temperature (both sides: no on/off comparison sees it), a base defect."""
    served_ws(workspace)
    (workspace / "assertions" / "tiny.yaml").write_text(suite(SHORT).replace("decoding: {max_tokens: 12}", READABLE))
    with llama_server(tiny / "model.gguf", *F32, log=tmp_path / "server.log") as url, faulty_front(url, "hotter") as hot:
        engines(workspace, served=url, hot=hot)
        healthy = evaluate(run_cli, workspace, "served")[1]
        hotter = evaluate(run_cli, workspace, "hot")[1]
    declared = healthy["sampling"]["declared"]
    assert healthy["verdict"] == "PASS" and min(declared["off"]["p"], declared["on"]["p"]) > 0.025, healthy["sampling"]
    assert declared["off"]["steps"] >= 40 and declared["off"]["impossible"] == 0
    assert hotter["verdict"] == "INCONCLUSIVE" and hotter["sampling"]["mismatches"] == 0, hotter["reasons"]
    assert hotter["reasons"][0].startswith("base_defect: the flag-off side's"), hotter["reasons"]


def test_seeded_and_unseeded_requests_in_flight_together_and_a_seed_dropped_under_load(tiny, workspace, run_cli,
                                                                                          tmp_path):
    """Under a load, a sampled suite's background requests draw with no seed beside the battery's seeded ones (four
    slots: one batch). The healthy server keeps each seeded answer; a front that drops a request's seed whenever
    another is in flight (a server that loses seeds when it batches) is never a PASS."""
    from served import not_blamed_on_batching

    sampled(served_ws(workspace))
    seen: list[dict] = []
    with llama_server(tiny / "model.gguf", *F32, "-np", "4", "-c", "8192", log=tmp_path / "server.log") as url, \
            faulty_front(url, "slow", seen=seen) as healthy_front, faulty_front(url, "unseeded_under_load") as dropping:
        engines(workspace, served=healthy_front, dropping=dropping)
        code, healthy = evaluate(run_cli, workspace, "served", "--limit", "2", "--load", "3")
        dropped = evaluate(run_cli, workspace, "dropping", "--limit", "2", "--load", "3")[1]
    drawn = [b for b in seen if b.get("temperature")]
    assert any("seed" in b for b in drawn) and any("seed" not in b for b in drawn), len(drawn)  # both kinds went
    with Ledger(f"sqlite:///{workspace / 'ledger' / 'evidence.db'}") as lg:
        ev = lg.evaluation(healthy["evaluation_id"])
    not_blamed_on_batching(code, healthy, ev, "")
    assert healthy["verdict"] == "PASS", healthy["reasons"]  # measured: seeds hold in a shared batch on this server
    assert dropped["verdict"] == "INCONCLUSIVE", dropped["reasons"]
    # where the two runs read the same top-2 logits at the parting step it is named seed_batched: (the draw changed);
    # this server's top lists at a sampled step need not be equal, so any of the load's reasons may come first
    assert dropped["reasons"][0].startswith(("seed_batched:", "batch_variant:", "baseline_unstable:")), dropped["reasons"]


def test_a_server_that_ignores_its_seeds_is_named_from_the_weights_it_gives(tiny, workspace, run_cli, tmp_path):
    """At temperature 1 with no filter the server's own log-probability of each token drawn is the declared one, so
    samples drawn under different keys and identical have a chance the gate can compute: a front that gives every
    request one seed (a frozen generator, as mlx 0.32.0 under mlx_lm.server) is ``seeds_ignored:``, never a PASS."""
    served_ws(workspace)
    plain = "decoding: {max_tokens: 12, temperature: 1.0, samples: 2}"
    (workspace / "assertions" / "tiny.yaml").write_text(suite(SHORT).replace("decoding: {max_tokens: 12}", plain))
    with llama_server(tiny / "model.gguf", *F32, log=tmp_path / "server.log") as url, faulty_front(url, "frozen") as front:
        engines(workspace, served=url, frozen=front)
        healthy = evaluate(run_cli, workspace, "served")[1]
        out = evaluate(run_cli, workspace, "frozen")[1]
    assert healthy["verdict"] == "PASS" and healthy["sampling"]["controls"]["unpaired"] == "seen", healthy["reasons"]
    assert out["verdict"] == "INCONCLUSIVE", out["reasons"]
    assert out["reasons"][0].startswith("seeds_ignored: on the flag-off side"), out["reasons"]
    assert out["sampling"]["controls"]["unpaired"] == "missed", out["sampling"]["controls"]


def test_draws_the_server_lists_too_little_of_are_read_through_a_second_reference(tiny, workspace, run_cli, tmp_path):
    """A repetition penalty (and no top-k) puts llama-server's draws beyond what its top 20 can tell. With the
    profile's ``reference_model``, transformers reads each sampled answer's full rows from the same GGUF, and each draw
    is transformed under the declared decoding through llama-server's chain: uniform on the real server, and a front
    that forwards every request at twice its temperature (both sides: the pair agrees) is a base defect."""
    from conftest import read_reference

    served_ws(workspace)
    read_reference(workspace)
    penalised = "decoding: {max_tokens: 12, temperature: 0.9, top_p: 0.95, repetition_penalty: 1.2, samples: 2}"
    (workspace / "assertions" / "tiny.yaml").write_text(suite(SHORT).replace("decoding: {max_tokens: 12}", penalised))
    gguf = tiny / "model.gguf"
    with llama_server(gguf, *F32, log=tmp_path / "server.log") as url, faulty_front(url, "hotter") as hot:
        engines(workspace, f"reference_model: {gguf}\n", served=url, hot=hot)
        healthy = evaluate(run_cli, workspace, "served")[1]
        hotter = evaluate(run_cli, workspace, "hot")[1]
    declared = healthy["sampling"]["declared"]
    assert healthy["verdict"] == "PASS", healthy["reasons"]
    assert declared["off"]["reread"] >= 40 and declared["off"]["impossible"] == 0, declared
    assert min(declared["off"]["p"], declared["on"]["p"]) > 0.025, declared
    assert hotter["verdict"] == "INCONCLUSIVE" and hotter["sampling"]["mismatches"] == 0, hotter["reasons"]
    assert hotter["reasons"][0].startswith("base_defect: the flag-off side's"), hotter["reasons"]
