"""`gatekeeper pin` on a hybrid model: each stage boundary's snapshot (attention KV plus the
recurrent layers' conv and recurrent states) is saved in the result layer and loaded at the next
start, on torch and on mlx."""

import json

import pytest
from test_recipe import forwarded, home  # noqa: F401  (fixtures)
from tiny_models import tiny_hybrid  # noqa: F401  (fixture)

from gatekeeper.cache import results
from gatekeeper.runtime import Runtime

ON = {"prefix_cache": "on"}
# Two stages, two boundaries; short prompts, as mlx's CPU backend is slow.
SUITE = """suite: {stage}
stage: {stage}
prompt:
  - {{role: system, static: true, text: "{rules}"}}
  - {{role: user, static: false, text: "{{query}}"}}
decoding: {{max_tokens: 6}}
cases:
  - {{id: a, vars: {{query: "What is 2+2?"}}, assert: [{{type: min-length, value: 0}}]}}
  - {{id: b, vars: {{query: "Book the flight to Porto."}}, assert: [{{type: min-length, value: 0}}]}}
"""
STAGES = {"router": "The router reads the request, picks a tool, and passes the arguments on.",
          "notes": "You are a careful assistant. Answer the question using the notes below."}
QUERIES = ["What is 2+2?", "Book the flight to Porto."]


@pytest.fixture
def hybrid_ws(workspace, tiny_hybrid):
    (workspace / "assertions" / "assistant.yaml").unlink()
    for stage, rules in STAGES.items():
        (workspace / "assertions" / f"{stage}.yaml").write_text(SUITE.format(stage=stage, rules=rules))
    for name, adapter in (("hybrid", "torch"), ("hybrid_mlx", "mlx")):
        (workspace / "engines" / f"{name}.yaml").write_text(
            f"adapter: {adapter}\nmodel: {tiny_hybrid}\ndtype: float32\ndevice: cpu\n"
            "prefill: aligned\nchunk: 8\nsnapshots: boundaries\n")
    return workspace


def answers(ws, engine, flags):
    """Every stage's answers, the tokens the cache served for each, and where each pin came from."""
    with Runtime(ws, engine=engine, flags=flags, response_cache=False) as rt:
        out = [rt.complete(stage, {"query": q}) for stage in STAGES for q in QUERIES]
        return [(c.tokens, c.text) for c in out], [c.cached_tokens for c in out], rt.prefix_sources


def shift_conv_windows(state):
    """A planted fault: each recurrent layer's conv window moved one position, as if the snapshot
    had been taken one token off (torch ``LinearAttentionLayer`` or mlx ``ArraysCache``)."""
    for layer in getattr(state, "layers", state):
        if hasattr(layer, "conv_states"):
            layer.conv_states[0] = layer.conv_states[0].roll(1, -1)
        elif type(layer).__name__ == "ArraysCache":
            import mlx.core as mx

            layer.cache[0] = mx.roll(layer.cache[0], 1, 1)
    return state


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["hybrid", "hybrid_mlx"])
def test_hybrid_boundary_snapshots_round_trip(hybrid_ws, home, run_cli, forwarded, monkeypatch, engine):
    cold, _, sources = answers(hybrid_ws, engine, {"prefix_cache": "off"})
    assert sources == {}  # a cold session pins no state

    code, out, _ = run_cli("--workspace", hybrid_ws, "pin", "--engine", engine, "--json")
    assert code == 0, out
    rows = {row["stage"]: row for row in json.loads(out)["stages"]}
    assert {s: r["state"] for s, r in rows.items()} == {"router": "computed", "notes": "computed"}
    saved = {json.loads(p.read_text())["content_hash"]: p.with_suffix(".safetensors")
             for p in (home / "prefix_states").glob("*.json")}
    files = {stage: saved[row["content_hash"]] for stage, row in rows.items()}  # one snapshot per boundary
    boundaries = [rows[stage]["boundary"] for stage in STAGES for _ in QUERIES]

    # A restart loads both snapshots without running the model, and every call restores its
    # stage's snapshot whole (the tokens a restore serves) with the answers of a cold start.
    forwarded["tokens"] = 0
    with Runtime(hybrid_ws, engine=engine, flags=ON, response_cache=False) as rt:
        assert rt.prefix_sources == {"router": "loaded", "notes": "loaded"} and rt.recipe_stale == {}
        assert forwarded["tokens"] == 0
        warm = [rt.complete(stage, {"query": q}) for stage in STAGES for q in QUERIES]
        assert rt.session.snapshot_stats()["restored"] == len(warm)
    assert [(c.tokens, c.text) for c in warm] == cold
    assert [c.cached_tokens for c in warm] == boundaries

    # A tampered snapshot (same size, one byte changed) is recomputed, the other one still loads.
    data = bytearray(files["router"].read_bytes())
    data[-1] ^= 0x55
    files["router"].write_bytes(bytes(data))
    again, cached, sources = answers(hybrid_ws, engine, ON)
    assert sources == {"router": "recomputed", "notes": "loaded"} and again == cold and cached == boundaries
    _, _, sources = answers(hybrid_ws, engine, ON)
    assert sources == {"router": "loaded", "notes": "loaded"}

    # The comparison has teeth: a loaded snapshot one position off changes the answers.
    from gatekeeper.engines.mlx import MLXKV
    from gatekeeper.engines.torch_kv import TorchKV

    ops = TorchKV if engine == "hybrid" else MLXKV
    monkeypatch.setattr(ops, "load", lambda self, path, real=ops.load: shift_conv_windows(real(self, path)))
    shifted, _, sources = answers(hybrid_ws, engine, ON)
    assert sources == {"router": "loaded", "notes": "loaded"} and shifted != cold

    # A model or adapter change purges them by their records' digests, as it does attention states.
    assert results.purge(home / "prefix_states", rt.model_digest, rt.adapter_digest) == 2
    assert not any((home / "prefix_states").iterdir())
