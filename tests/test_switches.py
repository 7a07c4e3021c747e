"""The flags as objects (gate/state/switches.py): each built-in flag and a declared change says its gate, its side
labels and its two configurations, and whether evidence is current reads the battery once for every flag."""

import pytest
from conftest import SUITE, profile

from gatekeeper.gate import planning
from gatekeeper.gate.enable import current
from gatekeeper.gate.state import pipeline, switches
from gatekeeper.workspace import BUILTIN_FLAGS, Workspace


@pytest.fixture
def ws(workspace, tiny_llama):
    (workspace / "assertions" / "assistant.yaml").unlink()
    (workspace / "assertions" / "tiny.yaml").write_text(SUITE)
    (workspace / "engines" / "tiny.yaml").write_text(profile("torch", tiny_llama))
    for flag, gate in (("static_first", "assertion_equivalence"), ("adapter", "non_inferiority")):
        (workspace / "policies" / f"{flag}.yaml").write_text(f"flag: {flag}\ngate: {gate}\n")
    (workspace / "policies" / "half.yaml").write_text(
        "flag: half\ngate: non_inferiority\nmargin: 0.05\nchange: {profile: {dtype: bfloat16}}\n")
    return workspace


def test_each_builtin_flag_has_its_switch_and_a_declared_flag_the_base():
    assert {name: type(switches.of(name)) for name in BUILTIN_FLAGS} == {
        "prefix_cache": switches.PrefixCache, "static_first": switches.StaticFirst, "adapter": switches.Adapter}
    assert type(switches.of("half")) is switches.Switch
    assert switches.of("half").labels == ("without half", "with half")
    assert [s.exercises_cache for s in map(switches.of, ("prefix_cache", "static_first", "adapter", "half"))] == \
        [True, False, False, False]


def test_each_flag_plans_its_own_two_configurations(ws, tmp_path):
    w = Workspace(ws)
    force = pipeline.in_force(w, None)
    configs = {}
    adapter_dir = tmp_path / "lora"
    adapter_dir.mkdir()
    (adapter_dir / "adapter_config.json").write_text("{}")
    for flag in ("prefix_cache", "static_first", "adapter", "half"):
        p = planning.plan(w, flag, "tiny", force=force, candidate=adapter_dir if flag == "adapter" else None)
        configs[flag] = {k: (c.cache, c.render, c.profile.dtype, c.profile.adapter_path) for k, c in p.configs.items()}
        assert p.kind.sides == switches.of(flag).labels and p.exercises_cache == (flag == "prefix_cache")
    # static_first has a policy here and is off: the others render as written
    assert configs["prefix_cache"] == {"off": (False, "as_written", "float32", None), "on": (True, "as_written", "float32", None)}
    assert configs["static_first"] == {"off": (False, "as_written", "float32", None), "on": (False, "partitioned", "float32", None)}
    assert configs["adapter"]["on"][3] == str(adapter_dir.resolve()) and configs["adapter"]["off"][3] is None
    assert configs["half"] == {"off": (False, "as_written", "float32", None), "on": (False, "as_written", "bfloat16", None)}


def test_a_candidate_is_for_the_adapter_flag_only(ws, tmp_path):
    from gatekeeper.errors import GatekeeperError

    w = Workspace(ws)
    with pytest.raises(GatekeeperError, match="--candidate is for the adapter flag"):
        planning.plan(w, "half", "tiny", force=pipeline.in_force(w, None), candidate=tmp_path)
    with pytest.raises(GatekeeperError, match="add --candidate PATH"):
        planning.plan(w, "adapter", "tiny", force=pipeline.in_force(w, None))


def test_evidence_for_every_flag_reads_the_battery_once(ws, monkeypatch):
    """``status`` asks identity_now for every flag: one workspace object reads its battery once, a new one again."""
    from gatekeeper.battery import suites

    reads = []
    real = suites.read
    monkeypatch.setattr(suites, "read", lambda *a, **k: reads.append(a) or real(*a, **k))
    w = Workspace(ws)
    evaluation = {"flag": "half", "config": {"engine": "tiny", "suites": None, "limit": None}}
    first = current.identity_now(w, {**evaluation}, None)
    for flag in ("prefix_cache", "static_first", "half"):
        current.identity_now(w, {**evaluation, "flag": flag}, None)
    assert len(reads) == 1
    assert current.identity_now(Workspace(ws), evaluation, None) == first and len(reads) == 2
