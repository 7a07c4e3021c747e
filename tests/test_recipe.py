"""`gatekeeper pin`: the recipe in the workspace and the result layer of saved prefix states."""

import json

import pytest
from conftest import profile
from test_runtime import VARS, make_lora

from gatekeeper.errors import GatekeeperError
from gatekeeper.ledger import Ledger
from gatekeeper.runtime import Runtime

ON = {"prefix_cache": "on"}


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("GATEKEEPER_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def forwarded(monkeypatch):
    """Counts the tokens the built-in engines run through their models."""
    from gatekeeper.engines.mlx import MLXEngine
    from gatekeeper.engines.torch import TorchEngine

    seen = {"tokens": 0}
    for cls in (TorchEngine, MLXEngine):
        def counting(self, state, tokens, real=cls._forward):
            seen["tokens"] += len(tokens)
            return real(self, state, tokens)

        monkeypatch.setattr(cls, "_forward", counting)
    return seen


def answers(ws, engine, flags):
    with Runtime(ws, engine=engine, flags=flags, response_cache=False) as rt:
        out = [rt.complete("tiny", v) for v in VARS]
        return [(c.tokens, c.text) for c in out], [c.cached_tokens for c in out], rt.prefix_sources


@pytest.mark.parametrize("engine,prefill", [("tiny", "monolithic"), ("tiny", "aligned"), ("tiny_mlx", "aligned")])
def test_recipe_round_trip(tiny_ws, home, run_cli, forwarded, engine, prefill):
    path = tiny_ws / "engines" / f"{engine}.yaml"
    path.write_text(path.read_text().replace("prefill: monolithic", f"prefill: {prefill}\nchunk: 16"))
    cold, _, _ = answers(tiny_ws, engine, {"prefix_cache": "off"})

    code, out, _ = run_cli("--workspace", tiny_ws, "pin", "--engine", engine, "--json")
    assert code == 0, out
    (row,) = json.loads(out)["stages"]
    recipe = json.loads((tiny_ws / "recipe.json").read_text())
    assert row["stage"] == "tiny" and row["state"] == "computed" and recipe["stages"]["tiny"]["boundary"] == row["boundary"] > 0
    (saved,) = sorted((home / "prefix_states").glob("*.safetensors"))

    # A restart loads the prefix state: the model never runs on the prefix, and answers match a cold start.
    forwarded["tokens"] = 0
    with Runtime(tiny_ws, engine=engine, flags=ON, response_cache=False) as rt:
        assert rt.prefix_sources == {"tiny": "loaded"} and rt.recipe_stale == {}
        assert forwarded["tokens"] == 0
    warm, cached, _ = answers(tiny_ws, engine, ON)
    assert warm == cold and min(cached) >= row["boundary"]

    # A tampered state (same size, one byte changed) is detected, recomputed and saved again.
    data = bytearray(saved.read_bytes())
    data[-1] ^= 0x55
    saved.write_bytes(bytes(data))
    again, _, sources = answers(tiny_ws, engine, ON)
    assert sources == {"tiny": "recomputed"} and again == cold
    _, _, sources = answers(tiny_ws, engine, ON)
    assert sources == {"tiny": "loaded"}


def test_a_recipe_that_no_longer_matches_says_so(tiny_ws, home, run_cli):
    assert run_cli("--workspace", tiny_ws, "pin", "--engine", "tiny")[0] == 0
    suite = tiny_ws / "assertions" / "tiny.yaml"
    suite.write_text(suite.read_text().replace("Rule 0:", "Rule zero:"))
    with Runtime(tiny_ws, engine="tiny", flags=ON, response_cache=False) as rt:
        assert list(rt.recipe_stale) == ["tiny"] and "content_hash changed" in rt.recipe_stale["tiny"]
        assert rt.prefix_sources == {"tiny": "computed"}  # new content, new key: nothing to load


def test_a_broken_recipe_is_a_clear_error(tiny_ws, home, run_cli):
    (tiny_ws / "recipe.json").write_text('{"version": 7}')
    with pytest.raises(GatekeeperError, match="recipe.json.*'version'.*gatekeeper pin"):
        Runtime(tiny_ws, engine="tiny", response_cache=False)
    (tiny_ws / "recipe.json").write_text("{not json")
    assert run_cli("--workspace", tiny_ws, "pin", "--engine", "tiny")[0] == 0  # pin rewrites it
    assert json.loads((tiny_ws / "recipe.json").read_text())["stages"]["tiny"]["boundary"] > 0


def test_adapter_change_purges_saved_prefix_states(tiny_ws, tiny_llama, home, tmp_path, run_cli):
    adapter = make_lora(tiny_llama, tmp_path / "lora", seed=1)
    (tiny_ws / "engines" / "lora.yaml").write_text(profile("torch", tiny_llama) + f"adapter_path: {adapter}\n")
    assert run_cli("--workspace", tiny_ws, "pin", "--engine", "lora")[0] == 0
    with Runtime(tiny_ws, engine="lora", flags=ON) as rt:  # records the identity it saw
        assert rt.prefix_sources == {"tiny": "loaded"}
    assert len(list((home / "prefix_states").glob("*.safetensors"))) == 1

    make_lora(tiny_llama, tmp_path / "lora", seed=2)  # same path, new bytes
    with Runtime(tiny_ws, engine="lora", flags=ON) as rt:
        assert rt.flushed == ["adapter"] and rt.prefix_sources == {"tiny": "computed"}
        assert rt.recipe_stale == {"tiny": "adapter_digest changed"}
    states = list((home / "prefix_states").glob("*.json"))
    assert [json.loads(p.read_text())["adapter_digest"] for p in states] == [rt.adapter_digest]
    with Ledger(f"sqlite:///{tiny_ws / 'ledger' / 'evidence.db'}") as lg:
        (flush,) = lg.flushes()
        assert flush["detail"]["prefix_states_purged"] == 1
