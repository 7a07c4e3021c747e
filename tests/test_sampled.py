"""Sampled decoding (#47): a suite's declared decoding runs on both sides with draws keyed by (seed, case, sample,
turn), so the two sides pair; an exact change gives the flag-off tokens, and the record says what the coupled steps
certify (the per-token total-variation bound). Planted sampler faults are FAILed or named."""

from __future__ import annotations

import json
import math
from pathlib import Path

from conftest import SUITE, evaluate, ledger, profile
from review_ledger import get, review

SAMPLED = "decoding: {max_tokens: 12, temperature: 0.8, top_p: 0.95, repetition_penalty: 1.1, samples: 3}"


def sampled_ws(workspace: Path, tiny_llama: Path, decoding: str = SAMPLED) -> Path:
    (workspace / "assertions" / "assistant.yaml").unlink()
    (workspace / "assertions" / "tiny.yaml").write_text(SUITE.replace("decoding: {max_tokens: 12}", decoding))
    (workspace / "engines" / "tiny.yaml").write_text(profile("torch", tiny_llama))
    return workspace


def with_probes(ws: Path) -> Path:
    """The penalty probes on: the cache probes draw under the suite's decoding (repeat, continuation)."""
    policy = ws / "policies" / "prefix_cache.yaml"
    policy.write_text(policy.read_text().replace("probes: off\n", "") + "probes: {kinds: [repeat, continuation]}\n")
    return ws


def test_an_exact_change_under_sampling_passes_with_its_bound(run_cli, workspace, tiny_llama):
    ws = with_probes(sampled_ws(workspace, tiny_llama))
    code, out = evaluate(run_cli, ws, "tiny")
    assert out["verdict"] == "PASS", out["reasons"]
    # the penalty probes draw (one key per probe, both sides, both turns of a repeat) and pair
    assert out["probes"] == {"repeat": "equal", "continuation": "equal"}, out["probes"]
    with ledger(ws) as lg:
        probed = [r["result"] for r in lg.evaluation(out["evaluation_id"])["case_results"] if r["case_id"].startswith("probe:")]
    assert probed and all(t.get("draws") for r in probed for t in r["turns"])  # drawn, not greedy
    s = out["sampling"]
    assert s["answers"] == 12 and s["mismatches"] == 0 and s["steps"] > 12
    assert 0 < s["tv_bound"] < 0.1
    assert any(r.startswith("sampled: tiny: temperature 0.8") for r in out["reasons"])
    # the controls of every sampled evaluation: no shared seed parts, the temperature doubled is seen
    assert (s["controls"]["unpaired"], s["controls"]["planted"]) == ("seen", "seen"), s["controls"]
    assert any(r.startswith("controls: on tiny/") for r in out["reasons"])
    with ledger(ws) as lg:  # the samples of a case part from each other (the draws are keyed by sample)
        answers = {r["case_id"]: tuple(r["result"]["turns"][0]["tokens"]) for r in lg.evaluation(out["evaluation_id"])["case_results"]
                   if r["config"] == "off" and r["repeat"] == 0}
    assert len({answers[f"tiny/{c}~{k}"] for c in "abc" for k in (1, 2, 3)}) > 3
    # every report shows it: the markdown and HTML exports, and the review app's evaluation page
    for fmt, head in (("md", "## Sampled decoding"), ("html", "<h2>Sampled decoding")):
        code, shown, _ = run_cli("--workspace", ws, "ledger", "export", out["evaluation_id"], "--format", fmt)
        assert code == 0 and head in shown and f"{s['steps']} coupled steps" in shown and "flag-on" in shown, shown[-3000:]
    code, junit, _ = run_cli("--workspace", ws, "ledger", "export", out["evaluation_id"], "--format", "junit")
    assert code == 0 and f'name="coupled_steps" value="{s["steps"]}"' in junit and 'name="control_planted" value="seen"' in junit
    code, diffed, _ = run_cli("--workspace", ws, "ledger", "diff", out["evaluation_id"], out["evaluation_id"], "--format", "md")
    assert code == 0 and f"| sampling | 12 answers, {s['steps']} coupled steps, 0 mismatched" in diffed, diffed[:1500]
    with ledger(ws) as lg:  # the in-toto predicate carries the coupling too
        from gatekeeper.ledger import intoto

        assert intoto.predicate(lg, lg.evaluation(out["evaluation_id"]), {}, {})["sampling"]["steps"] == s["steps"]
    with review(ws) as url:
        status, _, body = get(f"{url}/evaluations/{out['evaluation_id']}")
        case_status, _, case_page = get(f"{url}/evaluations/{out['evaluation_id']}/cases/tiny%2Fa~2")
    assert status == 200 and "<h2>Sampled decoding</h2>" in body and "Kolmogorov-Smirnov D" in body
    # a case's samples side by side on its page, each with where its two sides part (here: nowhere)
    assert case_status == 200 and "The samples of this case" in case_page, case_page[-2000:]
    assert all(f"tiny/a~{k}</a>" in case_page for k in (1, 2, 3)) and case_page.count("pair token for token") == 3
    # evidence gathered under one decoding is stale for a pipeline that runs another
    suite = ws / "assertions" / "tiny.yaml"
    suite.write_text(suite.read_text().replace("temperature: 0.8", "temperature: 0.7"))
    code, cli_out, _ = run_cli("--workspace", ws, "flip", "prefix_cache", "on", "--operator", "ops", "--reason", "test",
                               "--evaluation", out["evaluation_id"], "--json")
    refused = json.loads(cli_out)
    assert code == 1 and refused["action"] == "refused"
    assert any(r.startswith("stale:") and "decoding" in r for r in refused["reasons"]), refused["reasons"]


def test_bad_decoding_is_exit_2_naming_the_file_and_field(run_cli, workspace, tiny_llama):
    ws = sampled_ws(workspace, tiny_llama)
    suite = ws / "assertions" / "tiny.yaml"
    for bad, field in [("{max_tokens: 12, temperature: -1}", "temperature"), ("{max_tokens: 12, top_p: 0.9}", "top_p"),
                       ("{max_tokens: 12, temperature: 0.5, samples: 0}", "samples")]:
        suite.write_text(SUITE.replace("decoding: {max_tokens: 12}", f"decoding: {bad}"))
        code, out, err = run_cli("--workspace", ws, "evaluate", "--flag", "prefix_cache", "--engine", "tiny", "--json")
        said = json.loads(out)["error"]
        assert code == 2 and "tiny.yaml" in said and f"decoding.{field}" in said, said
        assert not (ws / "ledger" / "evidence.db").exists()


def _planted(run_cli, workspace, tiny_llama, adapter):
    """Under the aligned plan both sides prefill in the same shapes, so their raw logits are bit-exact by construction
    on every CPU (under the monolithic plan a hit's shapes differ and the last bits with them, on some CPUs): a step
    where both draw one token and weigh it differently is then the planted sampler's, never rounding's."""
    ws = sampled_ws(workspace, tiny_llama)
    engine = profile(f"fault_engines:{adapter}", tiny_llama).replace("monolithic", "aligned")
    (ws / "engines" / "planted.yaml").write_text(engine)
    return evaluate(run_cli, ws, "planted")[1]


def test_temperature_applied_twice_on_the_flag_on_side_fails(run_cli, workspace, tiny_llama):
    out = _planted(run_cli, workspace, tiny_llama, "HotterOn")
    assert out["verdict"] == "FAIL", out["reasons"]
    assert out["sampling"]["sampler_state"] > 0 and any(r.startswith("sampler_state:") for r in out["reasons"])
    # and the flag-on side's draws alone, against the declared decoding, show it (the flag-off side's do not)
    assert out["reasons"][0].startswith("sampler_mismatch: the flag-on side's"), out["reasons"]
    assert out["sampling"]["declared"]["off"]["p"] > 0.025 > out["sampling"]["declared"]["on"]["p"]


def test_a_penalty_over_another_history_on_the_flag_on_side_fails(run_cli, workspace, tiny_llama):
    """And on its own at the continuation probe, whose cached prefix holds the previous answer's words."""
    with_probes(workspace)
    out = _planted(run_cli, workspace, tiny_llama, "ForgetfulOn")
    assert out["verdict"] == "FAIL", out["reasons"]
    assert out["sampling"]["sampler_state"] > 0
    assert out["probes"]["continuation"] == "differs", out["reasons"]
    assert any(r.startswith("differs: probe:continuation") for r in out["reasons"]), out["reasons"]


def test_a_frozen_generator_is_named_and_never_passes(run_cli, workspace, tiny_llama):
    out = _planted(run_cli, workspace, tiny_llama, "Frozen")
    assert out["verdict"] == "INCONCLUSIVE", out["reasons"]
    assert [r for r in out["reasons"] if r.startswith("seeds_ignored: on the flag-off side")]


UNPAIRED = "unpaired: the flag-off side's draws do not follow their keys"


def _unpaired(run_cli, workspace, tiny_llama, adapter, options=""):
    """An engine that drops its seeds, under the aligned plan (the sides' logits bit-exact unless planted otherwise) and
    with the teacher-forced distance on: once the draws cannot pair, the distributions compare the sides."""
    ws = sampled_ws(workspace, tiny_llama)
    policy = ws / "policies" / "prefix_cache.yaml"
    policy.write_text(policy.read_text().replace("distance: false\n", ""))
    engine = profile(f"fault_engines:{adapter}", tiny_llama).replace("monolithic", "aligned")
    (ws / "engines" / "planted.yaml").write_text(engine + options)
    out = evaluate(run_cli, ws, "planted")[1]
    assert [r for r in out["reasons"] if r.startswith(UNPAIRED)], out["reasons"]
    assert not [r for r in out["reasons"] if r.startswith("baseline_unstable:")], out["reasons"]
    assert out["sampling"]["unpaired"]["parted"] > 0 and out["sampling"]["controls"] is None, out["sampling"]
    return out


def test_a_dropped_seed_is_named_and_the_sides_compared_by_their_distributions(run_cli, workspace, tiny_llama):
    """No two draws pair, so the tokens show nothing: the same logits (distance 0) and each side's draws following the
    declared decoding say the sides sample one distribution. Each side's test may reject by chance at its alpha; the
    flag-off side's then voids the verdict (base_defect), never a FAIL."""
    out = _unpaired(run_cli, workspace, tiny_llama, "Unseeded")
    u = out["sampling"]["unpaired"]
    assert u["positions"] > 0 and u["kld_max"] < 1e-9, u
    # no answer was compared token by token, and the record says so rather than calling them identical
    assert out["strength"] is None and not [r for r in out["reasons"] if r.startswith("equal: all")], out["reasons"]
    assert out["verdict"] == "PASS" or out["reasons"][0].startswith("base_defect: the flag-off side's"), out["reasons"]


def test_a_dropped_seed_hides_no_sampler_fault_on_the_flag_on_side(run_cli, workspace, tiny_llama):
    """The temperature applied twice on the flag-on side: its own draws, against the declared decoding, show it."""
    out = _unpaired(run_cli, workspace, tiny_llama, "UnseededHotterOn")
    assert out["verdict"] == "FAIL", out["reasons"]
    assert out["reasons"][0].startswith("sampler_mismatch: the flag-on side's"), out["reasons"]
    assert out["sampling"]["declared"]["off"]["p"] > 0.025 > out["sampling"]["declared"]["on"]["p"]


def test_a_dropped_seed_hides_no_logits_a_cache_hit_moved(run_cli, workspace, tiny_llama):
    """Noise planted on every restored state: the flag-on side draws faithfully from logits that moved, which the
    teacher-forced distance shows (the reference read, which shows it too, off here)."""
    policy = workspace / "policies" / "prefix_cache.yaml"
    policy.write_text(policy.read_text() + "reference: false\n")
    out = _unpaired(run_cli, workspace, tiny_llama, "UnseededNoisyHit", "options: {noise: 0.1, seed: 0}\n")
    assert out["verdict"] == "FAIL", out["reasons"]
    assert out["reasons"][0].startswith("distance:"), out["reasons"]
    assert out["sampling"]["unpaired"]["kld_max"] > 1e-4, out["sampling"]["unpaired"]


def test_the_identity_names_the_sampler_chain(run_cli, workspace, tiny_llama):
    ws = sampled_ws(workspace, tiny_llama, SAMPLED.replace("samples: 3", "samples: 1"))
    code, out = evaluate(run_cli, ws, "tiny", "--limit", "1")
    with ledger(ws) as lg:
        sampler = lg.evaluation(out["evaluation_id"])["identity"]["on"]["sampler"]
    assert sampler["chain"] == ["penalties", "temperature", "top_k", "top_p", "min_p"]
    assert sampler["window"]["repetition_penalty"] == "prompt+answer" and sampler["suites"] == ["tiny"]


def test_a_pass_needs_the_bound_the_policy_asks_for(run_cli, workspace, tiny_llama):
    """An underpowered sampled verdict is never PASS: with max_tv below what the coupled steps can bound, the same
    evidence is INCONCLUSIVE, naming the steps and answers it needs; within it, PASS."""
    ws = sampled_ws(workspace, tiny_llama)
    policy = ws / "policies" / "prefix_cache.yaml"
    policy.write_text(policy.read_text() + "max_tv: 0.001\n")
    code, out = evaluate(run_cli, ws, "tiny")
    assert out["verdict"] == "INCONCLUSIVE" and out["sampling"]["mismatches"] == 0, out["reasons"]
    short = out["reasons"][0]
    # the class with the fewest clean steps binds: 0.001 at alpha 0.05 over 3 position classes needs 4093 in it
    assert short.startswith("tv_bound:") and "needs about 4093 coupled steps in position " in short, short
    policy.write_text(policy.read_text().replace("max_tv: 0.001", f"max_tv: {out['sampling']['tv_bound'] * 1.01:.4f}"))
    assert evaluate(run_cli, ws, "tiny")[1]["verdict"] == "PASS"


def test_a_filter_both_sides_ignore_is_a_base_defect(run_cli, workspace, tiny_llama):
    """A sampler both sides share that ignores top-k: the pair agrees token for token, and each draw of a token
    outside the top k is a defect on sight."""
    ws = sampled_ws(workspace, tiny_llama, SAMPLED.replace("top_p: 0.95", "top_k: 3"))
    (ws / "engines" / "planted.yaml").write_text(profile("fault_engines:Unfiltered", tiny_llama))
    out = evaluate(run_cli, ws, "planted")[1]
    assert out["verdict"] == "INCONCLUSIVE" and out["sampling"]["mismatches"] == 0, out["reasons"]
    assert out["reasons"][0].startswith("base_defect: the flag-off side drew") and "no chance" in out["reasons"][0]
    assert out["sampling"]["declared"]["off"]["impossible"] > 0


def test_a_temperature_both_sides_ignore_is_a_base_defect(run_cli, workspace, tiny_llama):
    ws = sampled_ws(workspace, tiny_llama, SAMPLED.replace("temperature: 0.8, top_p: 0.95", "temperature: 0.3"))
    (ws / "engines" / "planted.yaml").write_text(profile("fault_engines:Lukewarm", tiny_llama))
    out = evaluate(run_cli, ws, "planted")[1]
    assert out["verdict"] == "INCONCLUSIVE", out["reasons"]
    assert out["reasons"][0].startswith("base_defect: the flag-off side's") and "Kolmogorov-Smirnov" in out["reasons"][0]
    # the planted control (the temperature doubled under the shared seed) is missed: an engine that ignores the
    # temperature cannot show a change of it, whatever the pairing says
    assert out["sampling"]["controls"]["planted"] == "missed"
    assert any(r.startswith("control_missed: on tiny/") for r in out["reasons"]), out["reasons"]
    # the healthy sampler's transforms are uniform on the same model and decoding
    healthy = evaluate(run_cli, ws, "tiny")[1]
    assert healthy["verdict"] == "PASS" and healthy["sampling"]["declared"]["on"]["p"] > 0.025, healthy["sampling"]


def test_battery_size_gives_the_samples_a_tv_bound_needs(run_cli, workspace, tiny_llama):
    ws = sampled_ws(workspace, tiny_llama)

    def size(*extra):
        code, out, _ = run_cli("--workspace", ws, "battery", "size", "--flag", "prefix_cache", "--max-tv", "0.01",
                               *extra, "--json")
        return code, json.loads(out)

    code, before = size()  # no evaluation yet: 12 steps per answer (max_tokens), a third per position class, no mismatch
    assert code == 0 and before["evaluation_id"] is None and before["needed_steps"] == 408, before  # at alpha/3
    assert before["samples_per_case"] == math.ceil(408 / 4 / 4) and before["classes"] == 3
    out = evaluate(run_cli, ws, "tiny")[1]
    code, after = size()  # from the evaluation: its coupled steps per answer
    assert after["evaluation_id"] == out["evaluation_id"] and after["mismatch_rate"] == 0
    assert after["steps_per_answer"] == round(out["sampling"]["steps"] / out["sampling"]["answers"], 3)
    code, said, err = run_cli("--workspace", ws, "battery", "size", "--flag", "prefix_cache", "--max-tv", "0")
    assert code == 2 and "--max-tv" in said + err


def test_a_configuration_that_decodes_greedy_only_is_exit_2_before_anything_is_written(run_cli, workspace, tiny_llama):
    """Assisted decoding is greedy in this adapter: a sampled suite on it is refused naming the suite's decoding."""
    ws = sampled_ws(workspace, tiny_llama)
    (ws / "engines" / "drafted.yaml").write_text(profile("torch", tiny_llama) + f"options: {{draft_model: {tiny_llama}}}\n")
    code, out, _ = run_cli("--workspace", ws, "evaluate", "--flag", "prefix_cache", "--engine", "drafted", "--json")
    said = json.loads(out)["error"]
    assert code == 2 and "tiny.yaml: field 'decoding'" in said and "greedy only" in said, said
    assert not (ws / "ledger" / "evidence.db").exists() or ledger(ws).evaluations() == []


def test_a_sequential_sampled_evaluation_bounds_the_distance_by_a_confidence_sequence(run_cli, workspace, tiny_llama):
    """A sequential run stops when its data say: its TV bound must hold at every stop, so it is the confidence
    sequence (gate/stats/coupling.py ``upper_anytime``), wider than Clopper-Pearson's on the same steps."""
    from gatekeeper.gate.stats.coupling import upper

    ws = sampled_ws(workspace, tiny_llama)
    # an A/A change under a gate with a loss to bound, which a sequential run can stop on
    (ws / "policies" / "same.yaml").write_text("flag: same\ngate: non_inferiority\nmargin: 0.3\nprobes: off\n"
                                               "distance: false\nreference: false\nchange: {engine: tiny}\n")
    code, text, _ = run_cli("--workspace", ws, "evaluate", "--flag", "same", "--engine", "tiny", "--sequential", "--json")
    out = json.loads(text)
    assert "sampling" in out, out
    s = out["sampling"]
    assert s["bound"] == "confidence sequence" and s["mismatches"] == 0, out["reasons"]
    assert s["tv_bound"] > upper(0, s["steps"], s["alpha"])
    assert any("confidence sequence)" in r for r in out["reasons"] if r.startswith("sampled:"))
