"""A bug in gatekeeper is never a verdict about an engine, and a step after the cases that fails still ends in a
verdict; the torch adapter reads a recurrent cache layer in every layout the admitted transformers releases have."""

from __future__ import annotations

import pytest
from conftest import evaluate, ledger
from tiny_models import tiny_hybrid  # noqa: F401  (fixture)

from gatekeeper.errors import InternalError, described, origin


class OldLayer:
    """A linear-attention cache layer as transformers 5.5 to 5.15 hold it: one tensor and one flag per kind."""

    def __init__(self, conv=None, recurrent=None):
        self.conv_states, self.recurrent_states = conv, recurrent
        self.is_conv_states_initialized, self.is_recurrent_states_initialized = conv is not None, recurrent is not None
        self.has_previous_state, self.conv_kernel_size = False, None


def test_an_exception_is_placed_in_gatekeeper_or_outside_it():
    import torch

    from gatekeeper.engines import torch_kv

    layer = OldLayer(conv=torch.ones(2, 3))
    layer.is_conv_states_initialized = torch.ones(3)  # a flag that is a tensor: bool() of it raises in torch_kv
    with pytest.raises(RuntimeError) as ours:
        torch_kv._held(layer, "conv_states")
    where, mine = origin(ours.value)
    assert mine and where.startswith("gatekeeper/engines/torch_kv.py:"), where
    with pytest.raises(RuntimeError) as theirs:
        torch.zeros(2).view(3)
    assert origin(theirs.value)[1] is False  # raised here, in a test: not gatekeeper's package
    assert origin(InternalError("x", "gatekeeper/a.py:1")) == ("gatekeeper/a.py:1", True)
    assert described(ours.value).startswith("RuntimeError: Boolean value of Tensor") and "torch_kv.py:" in described(ours.value)


def test_both_layouts_of_a_recurrent_layer_save_and_load_alike(tiny_hybrid, tmp_path):  # noqa: F811
    """A state of the tiny hybrid computed here (dicts by index, transformers >= 5.16) and the same state in the older
    layout (one tensor per kind) are saved to the same tensors, and a loaded state continues the model as a recomputed one."""
    import torch
    from safetensors.torch import load_file

    from gatekeeper.engines import torch_kv
    from gatekeeper.engines.registry import build_engine
    from gatekeeper.workspace import EngineProfile

    with build_engine(EngineProfile(adapter="torch", model=str(tiny_hybrid), dtype="float32", device="cpu")) as model:
        assert model.hybrid
        ops, prompt = model.state_ops, model.tokenize("The router reads the request and picks a tool.")
        state = model._new_state()
        model._forward(state, prompt)
        ops.save(state, tmp_path / "dicts.safetensors")
        linear = [layer for layer in state.layers if torch_kv._linear(layer)]
        assert linear and all(torch_kv._held(layer, "recurrent_states") for layer in linear)
        old = [OldLayer(layer.conv_states[0], layer.recurrent_states[0]) for layer in linear]
        for o, layer in zip(old, linear):
            o.has_previous_state = layer.has_previous_state[0]
        saved = {"dicts": load_file(tmp_path / "dicts.safetensors")}
        converted = [i for i, layer in enumerate(state.layers) if torch_kv._linear(layer)]
        for i, o in zip(converted, old):  # the same state in the old layout, then saved
            state.layers[i] = o
        torch_kv.Linear, real = OldLayer, torch_kv.Linear  # the old layer is what _linear recognises now
        try:
            ops.save(state, tmp_path / "single.safetensors")
            assert ops.nbytes(state) > 0 and all(torch_kv._held(o, "conv_states") for o in old)
            fresh = OldLayer()
            for kind in torch_kv.STATES:
                torch_kv._put(fresh, kind, 0, torch_kv._held(old[0], kind)[0])
            torch_kv._put(fresh, "has_previous_state", 0, True)
            assert fresh.is_conv_states_initialized is True and fresh.conv_kernel_size == old[0].conv_states.shape[-1]
            with pytest.raises(ValueError, match="one state of each kind"):
                torch_kv._put(fresh, "conv_states", 1, old[0].conv_states)
        finally:
            torch_kv.Linear = real
        saved["single"] = load_file(tmp_path / "single.safetensors")
        newer = {k for k in saved["dicts"] if k.endswith(".cumulative_length_linear")}  # a count 5.25 added
        assert newer and saved["dicts"].keys() - newer == saved["single"].keys()
        assert all(torch.equal(saved["dicts"][k], saved["single"][k]) for k in saved["single"])
        nxt = model.tokenize(" Then it answers.")  # (a file of the old layout loads under its release: test_runtime_releases)
        expected = model._forward(ops.load(tmp_path / "dicts.safetensors"), nxt)
        recomputed = model._new_state()
        model._forward(recomputed, prompt)
        assert (model._forward(recomputed, nxt) == expected).all()


def test_gatekeepers_own_bug_on_the_generate_path_is_exit_3_never_a_crash_of_the_side(tiny_ws, tiny_llama, run_cli,
                                                                                    monkeypatch):
    """An exception gatekeeper's code raises while transformers' generate runs aborts the evaluation as a bug (exit 3,
    module and line), where the runtime's own exception is a ``crashed:`` FAIL of that side (test_generate_path.py)."""
    import torch

    from gatekeeper.engines import torch_generate, torch_kv

    def broken(*args, **kwargs):
        layer = OldLayer(conv=torch.ones(2, 3))
        layer.is_conv_states_initialized = torch.ones(3)
        return torch_kv._held(layer, "conv_states")  # raises inside gatekeeper's torch_kv

    (tiny_ws / "engines" / "gen.yaml").write_text(f"adapter: torch\nmodel: {tiny_llama}\ndtype: float32\ndevice: cpu\n"
                                                  "prefill: monolithic\noptions: {cache_implementation: dynamic}\n")
    monkeypatch.setattr(torch_generate, "run_generate", broken)
    code, out, err = run_cli("--workspace", tiny_ws, "evaluate", "--flag", "prefix_cache", "--engine", "gen",
                             "--operator", "ci", "--limit", "1")
    assert code == 3, (out, err)
    assert "internal error, a bug in gatekeeper: RuntimeError: Boolean value of Tensor" in err
    assert "at gatekeeper/engines/torch_kv.py:" in err and "crashed" not in out + err
    with ledger(tiny_ws) as lg:
        (ev,) = lg.evaluations()
        assert ev["status"] == "aborted" and lg.verify().ok


def test_a_failed_step_after_the_cases_is_recorded_and_the_verdict_still_comes(tiny_ws, run_cli, monkeypatch):
    """The teacher-forced distance, the reference arm and a cache probe that raise are named in the reasons
    (step_failed:, the probe line), and the cases' verdict stands."""
    from gatekeeper.gate.arms import forced, probes, reference

    def raising(*args, **kwargs):
        raise RuntimeError("planted")

    policy = tiny_ws / "policies" / "prefix_cache.yaml"
    policy.write_text(policy.read_text().replace("probes: off\n", "").replace("distance: false\n", "")
                      .replace("reference: false\n", ""))
    monkeypatch.setattr(forced, "measure", raising)
    monkeypatch.setattr(reference, "read", raising)
    real_base = probes.base
    calls = []

    def base_then_broken_split(session, p, mode):  # the split probe reads the session's split: make it raise
        calls.append(1)
        b = real_base(session, p, mode)
        monkeypatch.setattr(type(session), "split", raising)
        return b

    monkeypatch.setattr(probes, "base", base_then_broken_split)
    code, result = evaluate(run_cli, tiny_ws, "tiny", "--limit", "2")
    assert (code, result["verdict"]) == (0, "PASS"), result["reasons"]
    failed = [r for r in result["reasons"] if r.startswith("step_failed: distance: RuntimeError: planted")]
    assert len(failed) == 1 and calls, result["reasons"]
    assert [r for r in result["reasons"] if r.startswith("step_failed: reference: RuntimeError: planted")], result["reasons"]
    assert result["reference"]["not_observable"].startswith("the reference step failed: RuntimeError: planted")
    assert result["probes"]["split"].startswith("skipped: failed: RuntimeError: planted"), result["probes"]
    assert result["probes"]["repeat"] == "equal"
