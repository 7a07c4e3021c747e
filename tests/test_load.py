"""Evidence under production conditions, against real llama-servers on loopback serving the default model:
an evaluation under load (background traffic kept in flight beside the battery, the battery also run
alone), a planted batch-variant engine that is INCONCLUSIVE (batch_variant:), never a FAIL, evidence
from one load refused for a flip under another, and replicas per side."""

from __future__ import annotations

import json
import re

import pytest
from conftest import ledger
from served import evaluate, llama_server, not_blamed_on_batching, served_ws
from tiny_models import tiny_llama  # noqa: F401  (fixture)

from gatekeeper.setup.models import find_gguf

pytestmark = pytest.mark.slow

EXACT = ("-fa", "off")  # as in test_engine_http: a cache hit is then exact on this battery


def profile(url, *extra: str) -> str:
    urls = json.dumps(url) if isinstance(url, list) else url
    return "\n".join(["adapter: http", f"url: {urls}", "cache_switch: cache_prompt", "timeout: 600", *extra]) + "\n"


@pytest.fixture(scope="module")
def slots(tmp_path_factory):
    """One server with four slots: requests in flight together are decoded in one batch."""
    log = tmp_path_factory.mktemp("logs") / "slots.log"
    with llama_server(find_gguf(), *EXACT, "-np", "4", "-c", "8192", log=log) as url:
        yield url, log


@pytest.fixture(scope="module")
def single(replicas):
    """A server with one slot: requests in flight together wait their turn, never share a batch."""
    return replicas[0]


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    """Two replicas of one deployment, and an odd one started with another setting (two slots)."""
    logs = tmp_path_factory.mktemp("replicas")
    with (llama_server(find_gguf(), *EXACT, log=logs / "a.log") as a, llama_server(find_gguf(), *EXACT, log=logs / "b.log") as b,
          llama_server(find_gguf(), *EXACT, "-np", "2", "-c", "8192", log=logs / "odd.log") as odd):
        yield a, b, odd


def slots_used(log, since: int) -> set[int]:
    """The slots llama-server launched tasks on after byte ``since`` of its log."""
    text = log.read_text(errors="replace")[since:]
    return {int(m) for m in re.findall(r"slot\s+launch_slot_: id\s+(\d+)", text)}


def test_an_evaluation_under_load_batches_the_battery_with_background_traffic(slots, workspace, run_cli):
    url, log = slots
    ws = served_ws(workspace, slots=profile(url))
    start = log.stat().st_size
    code, out = evaluate(run_cli, ws, "slots", "--limit", "2", "--load", "4")
    assert len(slots_used(log, start)) >= 3, "the load kept several slots busy at once"
    ev = ledger(ws).evaluation(out["evaluation_id"])
    assert ev["config"]["load"] == {"concurrency": 4, "background": "battery", "source_digest": ev["identity"]["off"]["battery_digest"]}
    assert ev["identity"]["off"]["load"] == ev["identity"]["on"]["load"] == ev["config"]["load"]
    # the battery ran alone first, one case at a time, and every alone~off#0 pair was compared
    assert {r["config"] for r in ev["case_results"]} == {"alone", "off", "on"}
    pairs = [c for c in ev["comparisons"] if c["detail"]["pair"] == "alone#0~off#0"]
    assert len(pairs) == 2
    # Measured here: the flag-off side under load equals itself and the run alone, while the flag-on side,
    # whose cache hits batch shorter prefills with the background's decodes, parts at near-ties: a FAIL that
    # needs both the cache and the batching (the same server PASSes with no load), as production would see it.
    not_blamed_on_batching(code, out, ev, "llama.cpp: run one slot (-np 1)")
    assert ledger(ws).verify().ok


def test_a_planted_batch_variant_engine_is_inconclusive_never_a_fail(single, workspace, run_cli):
    ws = served_ws(workspace, variant=profile(single).replace("adapter: http", "adapter: fault_engines:BatchVariant"))
    code, out = evaluate(run_cli, ws, "variant", "--limit", "2")
    assert code == 0 and out["verdict"] == "PASS", out  # alone, nothing is batched: the plant does nothing
    code, out = evaluate(run_cli, ws, "variant", "--limit", "2", "--load", "3")
    assert code == 1 and out["verdict"] == "INCONCLUSIVE", out
    variant = [r for r in out["reasons"] if r.startswith("batch_variant:")]
    assert len(variant) == 2 and out["differing_cases"] == []  # flag-on under load flips the same way,
    assert not any(r.startswith("differs:") for r in out["reasons"])  # and the verdict never blames the flag
    for r in variant:
        assert re.search(r"first divergent token at position \d+ \(\d+ vs \d+, margin ", r), r
        assert "llama.cpp: run one slot (-np 1)" in r


def test_evidence_under_one_load_is_stale_for_a_flip_under_another(single, workspace, run_cli):
    """One slot queues the load instead of batching it, so both evaluations PASS; only the load differs."""
    ws = served_ws(workspace, single=profile(single))
    policy = ws / "policies" / "prefix_cache.yaml"
    policy.write_text(policy.read_text() + "load: {concurrency: 2}\n")
    code, under_policy = evaluate(run_cli, ws, "single", "--limit", "1")
    assert code == 0 and under_policy["verdict"] == "PASS", under_policy
    code, other = evaluate(run_cli, ws, "single", "--limit", "1", "--load", "3")
    assert code == 0 and other["verdict"] == "PASS", other

    def flip(evaluation):
        code, out, _ = run_cli("--workspace", ws, "flip", "prefix_cache", "on", "--evaluation", evaluation["evaluation_id"],
                               "--operator", "ops", "--reason", "r", "--json")
        return code, json.loads(out)

    code, refused = flip(other)
    assert code == 1 and refused["action"] == "refused"
    assert any(r.startswith("stale:") and "load" in r for r in refused["reasons"]), refused
    code, flipped = flip(under_policy)
    assert code == 0 and flipped["state"] == "on", flipped


def test_a_load_on_an_in_process_engine_or_without_room_is_exit_2(slots, workspace, run_cli, tiny_llama):
    url, _ = slots
    ws = served_ws(workspace, slots=profile(url, "concurrency: 4"),
                   tiny=f"adapter: torch\nmodel: {tiny_llama}\ndtype: float32\ndevice: cpu\n")
    before = ledger(ws).evaluations() if (ws / "ledger" / "evidence.db").exists() else []
    for engine, args, words in [("tiny", ("--load", "4"), "needs a served engine"),
                                ("slots", ("--load", "4"), "leaves no room"),
                                ("slots", ("--load", "1"), "at least 2"),
                                ("slots", ("--load-from", "battery"), "give --load N"),
                                ("slots", ("--load", "6", "--load-from", "missing.jsonl"), "no such capture")]:
        code, out = evaluate(run_cli, ws, engine, *args)
        assert code == 2 and words in out["error"], (args, out)
    after = ledger(ws).evaluations() if (ws / "ledger" / "evidence.db").exists() else []
    assert after == before


def test_a_capture_replayed_as_background_traffic(slots, workspace, run_cli, tmp_path):
    url, log = slots
    ws = served_ws(workspace, slots=profile(url))
    capture = ws / "traffic.jsonl"
    capture.write_text("".join(json.dumps({"stage": "chat", "stream": f"s{i}", "t": i, "text": f"Question {i}: what is {i}+{i}?"}) + "\n"
                               for i in range(5)))
    start = log.stat().st_size
    code, out = evaluate(run_cli, ws, "slots", "--limit", "2", "--load", "3", "--load-from", "traffic.jsonl")
    ev = ledger(ws).evaluation(out["evaluation_id"])
    not_blamed_on_batching(code, out, ev, "llama.cpp: run one slot (-np 1)")
    load = ev["identity"]["on"]["load"]
    assert load["background"] == "capture" and load["concurrency"] == 3 and len(load["source_digest"]) == 64
    assert len(slots_used(log, start)) >= 2
    capture.write_text(json.dumps({"stage": "chat", "stream": "s", "t": 0, "bytes": 9, "digest": "x", "blocks": []}) + "\n")
    code, out = evaluate(run_cli, ws, "slots", "--load", "3", "--load-from", "traffic.jsonl")
    assert code == 2 and "metadata-only" in out["error"]


def test_replicas_share_the_cases_and_each_result_names_its_replica(replicas, workspace, run_cli):
    a, b, _ = replicas
    ws = served_ws(workspace, pair=profile([a, b]))
    code, out = evaluate(run_cli, ws, "pair")
    assert code == 0 and out["verdict"] == "PASS" and out["tokens"]["cached_on"] > 0, out
    ev = ledger(ws).evaluation(out["evaluation_id"])
    assert ev["identity"]["off"]["engine"]["replicas"] == {"off": [a, b], "on": [a, b]}
    answered = {t["replica"] for r in ev["case_results"] for t in r["result"]["turns"]}
    assert answered == {a, b}


def test_a_replica_that_serves_something_else_is_exit_2_naming_it(replicas, workspace, run_cli):
    a, b, odd = replicas
    ws = served_ws(workspace, mixed=profile([a, odd]))
    code, out = evaluate(run_cli, ws, "mixed")
    assert code == 2 and f"replica {odd}" in out["error"] and "field 'url'" in out["error"], out
    assert "total_slots" in out["error"] or "n_ctx" in out["error"]
    assert not (ws / "ledger" / "evidence.db").exists() or ledger(ws).evaluations() == []
