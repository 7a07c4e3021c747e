"""The other enablements: `static_first` (assertion equivalence) and `adapter` (non-inferiority)."""

import json

import pytest
from conftest import ledger, profile, wide_suite
from test_runtime import make_lora

from gatekeeper.errors import GatekeeperError
from gatekeeper.identity import directory_digest
from gatekeeper.runtime import Runtime

STATIC_FIRST = "flag: static_first\ngate: assertion_equivalence\n"
# the probes, the teacher-forced distance and the reference arm are read where they are the subject (the distance:
# below, with DISTANCE; the others in test_probes.py and test_reference.py): each reads every answer again
ADAPTER = "flag: adapter\ngate: non_inferiority\nprobes: off\ndistance: false\nreference: false\n"
DISTANCE = ADAPTER.replace("distance: false\n", "")


def gate(run_cli, ws, flag, *extra, engine="tiny", operator="ci"):
    code, out, _ = run_cli("--workspace", ws, "evaluate", "--flag", flag, "--engine", engine,
                           "--operator", operator, *extra, "--json")
    return code, json.loads(out)


def flip_on(run_cli, ws, flag, evaluation_id, operator="ops"):
    code, out, _ = run_cli("--workspace", ws, "flip", flag, "on", "--evaluation", evaluation_id,
                           "--operator", operator, "--reason", "evidence passed", "--json")
    return code, json.loads(out)


def texts(ws, engine="tiny", **flags):
    """Each case's first-turn answer as the runtime gives it under these flag states."""
    with Runtime(ws, engine=engine, flags=flags or None, response_cache=False) as rt:
        return {c: rt.complete("tiny", v).text for c, v in (("a", {"session": "user=ana", "query": "What is 2+2?"}),
                                                             ("b", {"session": "user=ben", "query": "Book the cheapest flight to Porto."}))}


def add_assertion(ws, case, assertion):
    """Append an assertion to one case of the tiny suite."""
    path = ws / "assertions" / "tiny.yaml"
    text = path.read_text()
    marker = f"  - id: {case}\n"
    head, tail = text.split(marker)
    vars_line, assert_line, rest = tail.split("\n", 2)
    assert_line = assert_line.replace("assert: [", f"assert: [{json.dumps(assertion)}, ")
    path.write_text(head + marker + "\n".join([vars_line, assert_line, rest]))


# --- static_first -------------------------------------------------------------------------------


@pytest.fixture
def sf_ws(tiny_ws):
    (tiny_ws / "policies" / "static_first.yaml").write_text(STATIC_FIRST)
    return tiny_ws


def test_a_harmless_partition_passes_and_reports_the_cacheable_share(sf_ws, run_cli):
    code, out = gate(run_cli, sf_ws, "static_first")
    assert code == 0 and out["verdict"] == "PASS", out["reasons"]
    assert out["differing_cases"] == [] and out["passes"]["off"] == out["passes"]["on"] == 4
    share = out["cacheable_share"]
    assert share["as_written"] < share["partitioned"]
    assert out["tokens"]["cached_on"] == 0  # the cache is off on both sides: only the order differs


def test_a_partition_that_changes_an_answer_fails_naming_case_and_assertion(sf_ws, run_cli):
    written, partitioned = texts(sf_ws), texts(sf_ws, static_first="on")
    assert written["a"] != partitioned["a"], "precondition: the order changes this tiny model's answer"
    add_assertion(sf_ws, "a", {"type": "equals", "value": written["a"], "name": "same-answer"})
    code, out = gate(run_cli, sf_ws, "static_first")
    assert code == 1 and out["verdict"] == "FAIL" and out["differing_cases"] == ["tiny/a"]
    assert any("tiny/a" in r and "'same-answer' passed as written, fails partitioned" in r for r in out["reasons"])
    with ledger(sf_ws) as lg:
        ev = lg.evaluation(out["evaluation_id"])
        (cmp,) = [c for c in ev["comparisons"] if c["case_id"] == "tiny/a" and c["detail"]["pair"] == "off#0~on#0"]
        assert cmp["detail"]["text_a"] == written["a"] and cmp["detail"]["text_b"] == partitioned["a"]
        assert cmp["detail"]["changed"] == [{"assertion": "same-answer", "off": True, "on": False}]


def test_static_first_decides_how_the_runtime_renders_and_keys(sf_ws, run_cli):
    with Runtime(sf_ws, engine="tiny", response_cache=False) as rt:
        assert rt.render == "as_written"
        written_prefix, off_hash = len(rt.prefixes["tiny"]), rt.pipeline_hash
    code, out = gate(run_cli, sf_ws, "prefix_cache")  # evidence for the cache, made as written
    assert out["verdict"] == "PASS" and out["tokens"]["stable_prefix_bound"] < 100
    cache_evidence = out["evaluation_id"]

    code, out = gate(run_cli, sf_ws, "static_first")
    assert flip_on(run_cli, sf_ws, "static_first", out["evaluation_id"])[1]["state"] == "on"
    with Runtime(sf_ws, engine="tiny", response_cache=False) as rt:
        assert rt.render == "partitioned" and rt.pipeline_hash != off_hash
        assert len(rt.prefixes["tiny"]) > written_prefix + 100  # the rules now lead the prompt
    # The cache's evidence was made on prompts as written: it no longer describes the pipeline.
    code, result = flip_on(run_cli, sf_ws, "prefix_cache", cache_evidence)
    assert code == 1 and result["action"] == "refused" and "render" in result["reasons"][0]


def test_a_workspace_without_the_policy_renders_partitioned(tiny_ws):
    with Runtime(tiny_ws, engine="tiny", response_cache=False) as rt:
        assert rt.render == "partitioned" and "static_first" not in rt.flags


def test_a_policy_with_the_wrong_gate_kind_is_an_input_error(sf_ws, run_cli):
    (sf_ws / "policies" / "static_first.yaml").write_text("flag: static_first\ngate: byte_equivalence\n")
    code, out, _ = run_cli("--workspace", sf_ws, "status", "--json")
    assert code == 2 and "static_first.yaml" in json.loads(out)["error"] and "assertion_equivalence" in json.loads(out)["error"]


# --- adapter ------------------------------------------------------------------------------------


@pytest.fixture
def lora_ws(tiny_ws):
    (tiny_ws / "policies" / "adapter.yaml").write_text(ADAPTER)
    return tiny_ws


def candidate_texts(ws, tiny_llama, path):
    (ws / "engines" / "cand.yaml").write_text(profile("torch", tiny_llama) + f"adapter_path: {path}\n")
    try:
        return texts(ws, engine="cand")
    finally:
        (ws / "engines" / "cand.yaml").unlink()


def base_answers(run_cli, ws, cand, cases):
    """The flag-off answers of ``cases`` (an evaluation's off#0 run), to pin assertions on."""
    code, out = gate(run_cli, ws, "adapter", "--candidate", cand, "--suite", "wide")
    with ledger(ws) as lg:
        rows = lg.evaluation(out["evaluation_id"])["case_results"]
    return {r["case_id"]: r["result"]["text"] for r in rows if r["config"] == "off" and r["repeat"] == 0 and r["case_id"] in cases}


def test_an_adapter_that_breaks_passing_assertions_fails(lora_ws, tiny_llama, tmp_path, run_cli):
    cand = make_lora(tiny_llama, tmp_path / "lora", seed=1)
    cases = wide_suite(lora_ws, 30)
    base = base_answers(run_cli, lora_ws, cand, cases)
    wide_suite(lora_ws, 30, lambda i: [{"type": "equals", "value": base[f"wide/w{i}"], "name": "known-answer"}])
    code, out = gate(run_cli, lora_ws, "adapter", "--candidate", cand, "--suite", "wide")
    assert code == 1 and out["verdict"] == "FAIL", out["reasons"]
    lost = out["paired"]["harmful"]
    assert out["passes"] == {"off": 30, "on": 30 - lost} and lost >= 10 and out["paired"]["lower"] > 0
    assert any(r.startswith("regressed: wide/w") and "'known-answer'" in r for r in out["reasons"])
    assert any(r.startswith("inferior:") for r in out["reasons"])


def test_an_adapter_on_too_few_cases_is_never_a_pass(lora_ws, tiny_llama, tmp_path, run_cli):
    """The tiny suite alone: nothing regresses, but four assertions rule out no margin: INCONCLUSIVE."""
    cand = make_lora(tiny_llama, tmp_path / "lora", seed=1)
    (lora_ws / "policies" / "adapter.yaml").write_text(ADAPTER + "margin: 0.15\n")
    code, out = gate(run_cli, lora_ws, "adapter", "--candidate", cand)
    assert code == 1 and out["verdict"] == "INCONCLUSIVE", out["reasons"]
    assert any(r.startswith("underpowered:") and "with 4 assertion pairs" in r for r in out["reasons"])


def test_an_adapter_that_only_improves_passes_and_flips_by_digest(lora_ws, tiny_llama, tmp_path, run_cli):
    cand = make_lora(tiny_llama, tmp_path / "lora", seed=1)
    new = candidate_texts(lora_ws, tiny_llama, cand)
    add_assertion(lora_ws, "a", {"type": "equals", "value": new["a"], "name": "better-answer"})
    wide_suite(lora_ws, 30)
    (lora_ws / "policies" / "adapter.yaml").write_text(ADAPTER + "margin: 0.15\n")
    code, out = gate(run_cli, lora_ws, "adapter", "--candidate", cand)
    assert code == 0 and out["verdict"] == "PASS" and out["passes"] == {"off": 34, "on": 35}, out["reasons"]
    assert (out["paired"]["harmful"], out["paired"]["beneficial"]) == (0, 1)
    assert any(r.startswith("improved: tiny/a assertion 'better-answer'") for r in out["reasons"])
    with ledger(lora_ws) as lg:
        assert lg.evaluation(out["evaluation_id"])["config"]["candidate"]["digest"] == directory_digest(cand)

    code, result = flip_on(run_cli, lora_ws, "adapter", out["evaluation_id"])
    assert code == 0 and result["state"] == "on"
    with Runtime(lora_ws, engine="tiny", response_cache=False) as rt:  # the approved adapter is installed
        assert rt.adapter_digest == directory_digest(cand)
        assert rt.complete("tiny", {"session": "user=ana", "query": "What is 2+2?"}).text == new["a"]

    make_lora(tiny_llama, cand, seed=3)  # another file under the same path
    with pytest.raises(GatekeeperError, match="approved .* with digest"):
        Runtime(lora_ws, engine="tiny", response_cache=False)


def test_the_distance_is_read_teacher_forced_and_a_kld_bound_refuses_a_pass(lora_ws, tiny_llama, tmp_path, run_cli):
    """The adapter moves every next-token distribution (KL > 0 over the flag-off answers) while the A/A floor of
    the deterministic torch engine is 0; under a max_kld bound it moves too far, so the statistical PASS is a FAIL."""
    cand = make_lora(tiny_llama, tmp_path / "lora", seed=1)
    wide_suite(lora_ws, 30)
    (lora_ws / "policies" / "adapter.yaml").write_text(DISTANCE + "margin: 0.15\n")
    code, out = gate(run_cli, lora_ws, "adapter", "--candidate", cand, "--suite", "wide")
    moved, floor = out["distance"]["distance"], out["distance"]["floor"]
    assert out["verdict"] == "PASS" and moved["positions"] >= 30 and moved["kld"]["mean"] > 0, out["reasons"]
    assert floor["kld"]["max"] == 0 and floor["same_top1"] == 1 and any(r.startswith("kld: mean") for r in out["reasons"])
    # the exports show it beside the floor: a table, the quantiles, and in HTML the quantiles drawn
    code, md, _ = run_cli("--workspace", lora_ws, "ledger", "export", str(out["evaluation_id"]), "--format", "md")
    assert code == 0 and "## Teacher-forced distance" in md, md
    assert f"| off~on | {moved['positions']} | {moved['kld']['mean']:.3g} ± " in md and "| A/A floor |" in md
    assert f"| p99 | {moved['kld']['p99']:.3g} | 0 |" in md
    code, page, _ = run_cli("--workspace", lora_ws, "ledger", "export", str(out["evaluation_id"]), "--format", "html")
    assert code == 0 and 'aria-label="KLD quantiles, log scale"' in page and f"{moved['kld']['max']:.2g}</text>" in page
    (lora_ws / "policies" / "adapter.yaml").write_text(DISTANCE + f"margin: 0.15\nmax_kld: {moved['kld']['mean'] / 2}\n")
    code, out = gate(run_cli, lora_ws, "adapter", "--candidate", cand, "--suite", "wide")
    assert code == 1 and out["verdict"] == "FAIL" and out["reasons"][0].startswith("distance:"), out["reasons"]


def test_a_distance_beyond_doubt_refuses_a_change_too_few_cases_cannot_judge(lora_ws, tiny_llama, tmp_path, run_cli):
    """Four cases cannot bound the flips (INCONCLUSIVE, underpowered), but a KL far above max_kld is a FAIL on its
    own; one above it only at the point estimate leaves the verdict INCONCLUSIVE."""
    cand = make_lora(tiny_llama, tmp_path / "lora", seed=1)
    wide_suite(lora_ws, 4)
    (lora_ws / "policies" / "adapter.yaml").write_text(DISTANCE + "margin: 0.15\n")
    code, out = gate(run_cli, lora_ws, "adapter", "--candidate", cand, "--suite", "wide")
    k = out["distance"]["distance"]["kld"]
    assert out["verdict"] == "INCONCLUSIVE" and any(r.startswith("underpowered:") for r in out["reasons"])
    assert k["mean"] > 1.645 * k["se"] > 0, k
    for bound, verdict in ((k["mean"] - k["se"], "INCONCLUSIVE"), ((k["mean"] - 1.645 * k["se"]) / 2, "FAIL")):
        (lora_ws / "policies" / "adapter.yaml").write_text(DISTANCE + f"margin: 0.15\nmax_kld: {bound}\n")
        code, out = gate(run_cli, lora_ws, "adapter", "--candidate", cand, "--suite", "wide")
        assert out["verdict"] == verdict, out["reasons"]
    assert code == 1 and out["reasons"][0].startswith("distance: kld mean") and "even its lower 95% bound" in out["reasons"][0]


def test_flip_with_a_swapped_adapter_file_is_refused_as_stale(lora_ws, tiny_llama, tmp_path, run_cli):
    cand = make_lora(tiny_llama, tmp_path / "lora", seed=1)
    wide_suite(lora_ws, 30)
    (lora_ws / "policies" / "adapter.yaml").write_text(ADAPTER + "margin: 0.15\n")
    code, out = gate(run_cli, lora_ws, "adapter", "--candidate", cand)
    assert out["verdict"] == "PASS", out["reasons"]
    make_lora(tiny_llama, cand, seed=2)
    code, result = flip_on(run_cli, lora_ws, "adapter", out["evaluation_id"])
    assert code == 1 and result["action"] == "refused" and result["state"] == "off"
    assert result["reasons"][0].startswith("stale:") and "candidate" in result["reasons"][0]


def test_the_policy_margin_alpha_and_clusters_are_applied_and_recorded(lora_ws, tiny_llama, tmp_path, run_cli):
    cand = make_lora(tiny_llama, tmp_path / "lora", seed=1)
    cases = wide_suite(lora_ws, 40)
    base = base_answers(run_cli, lora_ws, cand, cases)
    # four of 40 cases pin their flag-off answer: the adapter can lose at most those four
    wide_suite(lora_ws, 40, lambda i: [{"type": "max-length", "value": 10000}] +
               ([{"type": "equals", "value": base[f"wide/w{i}"], "name": "known-answer"}] if i < 4 else []))
    verdicts = {}
    for margin, extra in ((0.5, ""), (0.5, "alpha: 0.001\n"), (0.5, "cluster: suite\n")):
        (lora_ws / "policies" / "adapter.yaml").write_text(ADAPTER + f"margin: {margin}\n" + extra)
        code, out = gate(run_cli, lora_ws, "adapter", "--candidate", cand, "--suite", "wide")
        stats = out["paired"]
        verdicts[extra or "default"] = (out["verdict"], stats["alpha"], stats["clusters"])
        with ledger(lora_ws) as lg:
            assert lg.evaluation(out["evaluation_id"])["verdict_record"]["summary"]["paired"] == stats
        assert stats["n"] == 44 and stats["margin"] == margin and 0 < stats["harmful"] <= 4
    # a wide margin passes; one suite as the only cluster is one observation: nothing can be ruled out. The three
    # policies judge the change base_answers evaluated first, so they are its looks 2, 3 and 4, each at its share of
    # the policy's alpha (gate/stats/looks.py: alpha * 2^-look)
    assert verdicts["default"] == ("PASS", 0.0125, 40)
    assert verdicts["alpha: 0.001\n"][1:] == (0.000125, 40)
    assert verdicts["cluster: suite\n"] == ("INCONCLUSIVE", 0.003125, 1)


def test_candidate_is_required_for_the_adapter_flag_and_refused_elsewhere(lora_ws, run_cli, tmp_path):
    code, out = gate(run_cli, lora_ws, "adapter")
    assert code == 2 and "--candidate" in out["error"]
    code, out = gate(run_cli, lora_ws, "prefix_cache", "--candidate", tmp_path)
    assert code == 2 and "non_inferiority" in out["error"]
    assert not (lora_ws / "ledger" / "evidence.db").exists()


def test_mlx_loads_an_mlx_lm_format_adapter(tiny_ws, tiny_llama, tmp_path):
    adapter = make_mlx_lora(tiny_llama, tmp_path / "mlx_lora")
    (tiny_ws / "engines" / "mlx_lora.yaml").write_text(profile("mlx", tiny_llama) + f"adapter_path: {adapter}\n")
    base, tuned = texts(tiny_ws, engine="tiny_mlx"), texts(tiny_ws, engine="mlx_lora")
    assert base != tuned
    with Runtime(tiny_ws, engine="mlx_lora", response_cache=False) as rt:
        assert rt.adapter_digest == directory_digest(adapter)


def make_mlx_lora(base, path):
    """A random LoRA in mlx-lm's adapter format (adapter_config.json + adapters.safetensors)."""
    import mlx.core as mx
    import mlx_lm
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.utils import linear_to_lora_layers

    config = {"fine_tune_type": "lora", "num_layers": 2,
              "lora_parameters": {"rank": 2, "scale": 20.0, "dropout": 0.0, "keys": ["self_attn.q_proj", "self_attn.v_proj"]}}
    model, _ = mlx_lm.load(str(base))
    linear_to_lora_layers(model, config["num_layers"], config["lora_parameters"])
    mx.random.seed(0)
    weights = {k: mx.random.normal(v.shape) * 0.5 for k, v in tree_flatten(model.trainable_parameters())
               if k.endswith(("lora_a", "lora_b"))}
    path.mkdir()
    mx.save_safetensors(str(path / "adapters.safetensors"), weights)
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path
