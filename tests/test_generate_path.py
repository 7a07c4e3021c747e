"""The torch adapter on transformers' own generate (``options.cache_implementation``): each cache class a pipeline
uses, the flag-on side reusing the stage prefix through it; a broken reuse refused; bad options exit 2."""

from __future__ import annotations

import pytest
from conftest import evaluate, ledger, profile

from gatekeeper.engines.registry import build_engine
from gatekeeper.workspace import Workspace


def generate_profile(model, impl: str, *extra: str, adapter: str = "torch") -> str:
    return (profile(adapter, model) + f"options: {{cache_implementation: {impl}, max_cache_len: 1024}}\n"
            + "".join(f"{e}\n" for e in extra))


# transformers 5 folds the sliding-window and hybrid caches into StaticCache (its layers follow the config)
@pytest.mark.parametrize("impl, cache_class", [("dynamic", "DynamicCache"), ("static", "StaticCache"),
                                                ("sliding_window", "StaticCache"), ("hybrid", "StaticCache")])
def test_each_cache_implementation_passes_with_the_prefix_reused_through_it(tiny_ws, tiny_llama, run_cli, impl, cache_class):
    (tiny_ws / "engines" / "gen.yaml").write_text(generate_profile(tiny_llama, impl))
    code, out = evaluate(run_cli, tiny_ws, "gen")
    assert code == 0 and out["verdict"] == "PASS", out
    assert out["tokens"]["cached_on"] == out["tokens"]["stable_prefix_bound"] > 0
    with ledger(tiny_ws) as lg:
        engine = lg.evaluation(out["evaluation_id"])["identity"]["on"]["engine"]
    assert engine["generate"] == {"cache_implementation": impl, "max_cache_len": 1024}
    with build_engine(Workspace(tiny_ws).engine("gen"), workspace_root=tiny_ws) as model:
        session = model.session(cache=True)
        prefix = model.tokenize("The router reads the request, picks a tool")
        session.pin(prefix)
        (entry,) = session.prefix_cache.entries
        assert type(entry.state).__name__ == cache_class and session.ops.length(entry.state) == len(prefix)


def test_generate_gives_the_tokens_of_gatekeepers_own_loop(tiny_ws, tiny_llama):
    """transformers' greedy generate and gatekeeper's greedy loop read one model: the same tokens, EOS and stop included."""
    ws = Workspace(tiny_ws)
    (tiny_ws / "engines" / "gen.yaml").write_text(generate_profile(tiny_llama, "static", "prefill: monolithic"))
    prompt_text = "Session: user=ana, locale=pt-PT. What is 2+2? The answer is"
    outs = {}
    for name in ("tiny", "gen"):
        with build_engine(ws.engine(name), workspace_root=tiny_ws) as model:
            prompt = model.tokenize(prompt_text)
            with model.session() as s:
                outs[name] = [s.generate(prompt, max_tokens=24, top2=True), s.generate(prompt, max_tokens=24, stop=["4"])]
    for a, b in zip(outs["tiny"], outs["gen"]):
        assert a.tokens == b.tokens and a.text == b.text
    assert [m[0][0] for m in outs["gen"][0].top2] == outs["gen"][0].tokens


def test_assisted_generate_keeps_the_models_greedy_tokens_and_one_top2_each(tiny_ws, tiny_llama):
    """transformers' assisted decoding with a draft (here the model itself): its greedy tokens, one top-2 per kept
    token though it scores drafts it rejects."""
    ws = Workspace(tiny_ws)
    (tiny_ws / "engines" / "plain.yaml").write_text(generate_profile(tiny_llama, "dynamic"))
    (tiny_ws / "engines" / "draft.yaml").write_text(generate_profile(tiny_llama, "dynamic").replace(
        "max_cache_len: 1024}", f"max_cache_len: 1024, draft_model: {tiny_llama}, draft_tokens: 3}}"))
    outs = {}
    for name in ("plain", "draft"):
        with build_engine(ws.engine(name), workspace_root=tiny_ws) as model, model.session() as s:
            outs[name] = s.generate(model.tokenize("What is 2+2? The answer is"), max_tokens=20, top2=True)
    assert outs["draft"].tokens == outs["plain"].tokens
    assert [m[0][0] for m in outs["draft"].top2] == outs["draft"].tokens


def test_a_zero_slot_in_the_reused_cache_is_refused(tiny_ws, tiny_llama, run_cli):
    (tiny_ws / "engines" / "zero.yaml").write_text(generate_profile(tiny_llama, "static", adapter="fault_engines:ZeroSlotGenerate"))
    code, out = evaluate(run_cli, tiny_ws, "zero")
    assert code == 1 and out["verdict"] == "FAIL" and out["differing_cases"], out


@pytest.mark.parametrize("extra, says", [
    ("prefill: aligned", "field 'prefill': generate prefills a prompt in one pass"),
    ("options: {cache_implementation: rolling}", "'rolling' is none of dynamic, static"),
    ("options: {max_cache_len: 64}", "with cache_implementation"),
    ("options: {cache_implementation: static, draft_model: default}", "field 'options.draft_model'"),
])
def test_bad_generate_options_are_exit_2(tiny_ws, tiny_llama, run_cli, extra, says):
    body = profile("torch", tiny_llama)
    body = body.replace("prefill: monolithic\n", "") if extra.startswith("prefill") else body
    if extra.startswith("prefill"):
        extra += "\noptions: {cache_implementation: static}"
    (tiny_ws / "engines" / "bad.yaml").write_text(body + extra + "\n")
    code, out = evaluate(run_cli, tiny_ws, "bad")
    assert code == 2 and says in out["error"] and "engines/bad.yaml" in out["error"], out


def test_a_cache_too_small_for_a_call_is_exit_2_naming_the_option(tiny_ws, tiny_llama, run_cli):
    (tiny_ws / "engines" / "small.yaml").write_text(generate_profile(tiny_llama, "static").replace("1024", "64"))
    code, out = evaluate(run_cli, tiny_ws, "small")
    assert code == 2 and "field 'options.max_cache_len'" in out["error"] and "raise it" in out["error"], out


def test_calibration_says_its_faults_need_gatekeepers_own_cache(tiny_ws, tiny_llama, run_cli):
    (tiny_ws / "engines" / "gen.yaml").write_text(generate_profile(tiny_llama, "static"))
    code, out, _ = run_cli("--workspace", tiny_ws, "calibrate", "--flag", "prefix_cache", "--engine", "gen", "--json")
    assert code == 2 and "field 'options.cache_implementation'" in out and "without cache_implementation" in out, out
