"""The runtime: flags from the ledger, answers keyed by the pipeline-version hash, flushes on identity change."""

import json
import shutil
import sqlite3
from contextlib import closing

from conftest import profile
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gatekeeper.ledger import Ledger
from gatekeeper.runtime import Runtime

VARS = [{"session": "user=ana", "query": "What is 2+2?"}, {"session": "user=ben", "query": "Book the flight."}]


def open_runtime(ws, tmp, engine="tiny"):
    return Runtime(ws, engine=engine, response_cache=tmp / "responses.db")


def test_second_call_is_served_from_the_response_cache(tiny_ws, tmp_path):
    with open_runtime(tiny_ws, tmp_path) as rt:
        first = rt.complete("tiny", VARS[0])
        again = rt.complete("tiny", VARS[0])
        other = rt.complete("tiny", VARS[1])
    assert not first.from_response_cache and again.from_response_cache and not other.from_response_cache
    assert again.text == first.text and again.tokens == first.tokens
    assert first.pipeline_hash == again.pipeline_hash


def test_flag_on_in_the_ledger_turns_the_engine_cache_on(tiny_ws, tmp_path):
    with open_runtime(tiny_ws, tmp_path) as rt:
        assert rt.flags == {"prefix_cache": "off"} and not rt.session.cache
        off_hash = rt.pipeline_hash
    with Ledger(f"sqlite:///{tiny_ws / 'ledger' / 'evidence.db'}") as lg:
        lg.add_flip("prefix_cache", "on", "ops", "test")
    with open_runtime(tiny_ws, tmp_path) as rt:
        assert rt.session.cache and rt.pipeline_hash != off_hash
        a = rt.complete("tiny", VARS[0])
        b = rt.complete("tiny", VARS[1])
    assert not a.from_response_cache  # made under the flag-off hash, so not served now
    assert b.cached_tokens > 0  # the stage's static prefix is pinned


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.sampled_from(["flip", "model", "request0", "request1"]), min_size=2, max_size=7))
def test_cache_never_serves_across_pipeline_versions(tiny_ws, tiny_llama, tmp_path_factory, actions):
    tmp = tmp_path_factory.mktemp("prop")
    model = tmp / "model"
    shutil.copytree(tiny_llama, model)
    (tiny_ws / "engines" / "prop.yaml").write_text(profile("torch", model))
    db = f"sqlite:///{tmp / 'evidence.db'}"
    flag, revision = "off", 0
    produced: set[tuple[str, str]] = set()  # (pipeline hash, prompt) pairs answered by the engine
    rt = Runtime(tiny_ws, engine="prop", ledger=db, response_cache=tmp / "responses.db")
    try:
        for action in actions:
            if action in ("flip", "model"):
                before = rt.pipeline_hash
                rt.close()
                if action == "flip":
                    flag = "on" if flag == "off" else "off"
                    with Ledger(db) as lg:
                        lg.add_flip("prefix_cache", flag, "ops", "property test")
                else:
                    revision += 1
                    config = json.loads((model / "config.json").read_text())
                    config["rms_norm_eps"] = 1e-6 * (1 + revision)
                    (model / "config.json").write_text(json.dumps(config))
                rt = Runtime(tiny_ws, engine="prop", ledger=db, response_cache=tmp / "responses.db")
                assert rt.pipeline_hash != before, f"{action} did not change the pipeline-version hash"
                assert rt.flags["prefix_cache"] == flag
            else:
                values = VARS[int(action[-1])]
                c = rt.complete("tiny", values)
                key = (rt.pipeline_hash, json.dumps(values, sort_keys=True))
                assert c.pipeline_hash == rt.pipeline_hash
                if c.from_response_cache:
                    assert key in produced, "served an answer made under another pipeline version"
                else:
                    produced.add(key)
    finally:
        rt.close()


def make_lora(base, path, seed):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base)
    lora = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    lora.save_pretrained(path)
    return path


def test_adapter_change_flushes_responses_and_records_it(tiny_ws, tiny_llama, tmp_path):
    adapter = make_lora(tiny_llama, tmp_path / "lora", seed=1)
    (tiny_ws / "engines" / "lora.yaml").write_text(profile("torch", tiny_llama) + f"adapter_path: {adapter}\n")
    evidence = tiny_ws / "ledger" / "evidence.db"

    with open_runtime(tiny_ws, tmp_path, "lora") as rt:
        assert rt.flushed == [] and rt.adapter_digest
        first = rt.complete("tiny", VARS[0])
    with open_runtime(tiny_ws, tmp_path, "lora") as rt:  # same bytes: nothing flushed
        assert rt.flushed == [] and rt.complete("tiny", VARS[0]).from_response_cache
    assert not evidence.exists()

    make_lora(tiny_llama, tmp_path / "lora", seed=2)  # same path, new bytes
    with open_runtime(tiny_ws, tmp_path, "lora") as rt:
        assert rt.flushed == ["adapter"]
        with closing(sqlite3.connect(tmp_path / "responses.db")) as db:  # the old identity's answers are gone
            assert db.execute("SELECT COUNT(*) FROM response").fetchone() == (0,)
        again = rt.complete("tiny", VARS[0])
    assert not again.from_response_cache and again.pipeline_hash != first.pipeline_hash
    with Ledger(f"sqlite:///{evidence}") as lg:
        (flush,) = lg.flushes()
        assert flush["trigger"] == "adapter" and flush["detail"]["responses_purged"] == 1
        assert flush["old"]["adapter_digest"] != flush["new"]["adapter_digest"]
        assert lg.verify().ok


def test_a_sampled_stage_draws_afresh_and_is_never_replayed(tiny_ws, tmp_path):
    suite = tiny_ws / "assertions" / "tiny.yaml"
    suite.write_text(suite.read_text().replace("decoding: {max_tokens: 12}", "decoding: {max_tokens: 12, temperature: 1.0}"))
    with open_runtime(tiny_ws, tmp_path) as rt:
        answers = [rt.complete("tiny", VARS[0]) for _ in range(3)]
    assert not any(a.from_response_cache for a in answers)
    assert len({tuple(a.tokens) for a in answers}) > 1  # a tiny random model at temperature 1 rarely repeats itself
