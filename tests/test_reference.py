"""The reference arm (gate/arms/reference.py): each arm's answers read again with no cache object, so a defect both arms
share is seen, and a flag-only defect still FAILs."""

import pytest

from tests.conftest import evaluate, profile, read_reference


@pytest.fixture
def tiny_ws(tiny_ws):
    """The tiny workspace with the reference arm read, as shipped: it is this file's subject."""
    read_reference(tiny_ws)
    return tiny_ws


def _reference_on(ws):
    policy = ws / "policies" / "prefix_cache.yaml"
    policy.write_text(policy.read_text().replace("probes: off\n", "").replace("distance: false\n", ""))  # as shipped


def test_a_healthy_engine_agrees_with_the_reference_and_passes(tiny_ws, run_cli):
    from gatekeeper.gate.arms.reference import GAP

    _reference_on(tiny_ws)
    code, out = evaluate(run_cli, tiny_ws, "tiny")
    assert (code, out["verdict"]) == (0, "PASS"), out["reasons"]
    r = out["reference"]
    assert r["dtype"] == "float64" and not any(r["departs"].values())
    assert r["arms"]["off"]["positions"] > 0 and r["arms"]["off"]["controls"] > 0
    assert r["arms"]["on"]["positions"] == r["arms"]["off"]["positions"]
    assert max(r["floor"].values()) > 0 and r["tolerance"]["gap"] == GAP * max(r["floor"].values())
    assert r["calibration"]["source"] == "the engine's own model in one pass" and r["calibration"]["positions"] > 0
    assert any(x.startswith("reference: both arms agree") for x in out["reasons"])
    # the cache probes' answers are read too, and agree
    assert r["arms"]["on"]["probed"] > 0 and any("of them in the cache probes" in x for x in out["reasons"])


def test_a_defect_both_arms_share_is_a_base_defect_never_a_pass(tiny_ws, tiny_llama, run_cli):
    _reference_on(tiny_ws)
    (tiny_ws / "engines" / "shared.yaml").write_text(profile("fault_engines:ForgetsFirstSlot", tiny_llama))
    code, out = evaluate(run_cli, tiny_ws, "shared")
    assert out["verdict"] == "INCONCLUSIVE" and code != 0, out["reasons"]
    assert out["reasons"][0].startswith("base_defect: both arms depart"), out["reasons"]
    assert "engines/shared.yaml" in out["reasons"][0]
    r = out["reference"]
    assert r["departs"] == {"off": True, "on": True}
    first = r["arms"]["off"]["departures"][0]
    assert first["position"] >= 1  # the first answer token comes from the prefill, which the defect does not touch
    # the evidence reads where every reason is read: the table, the exports, the review app's page
    eid = str(out["evaluation_id"])
    code, md, _ = run_cli("--workspace", tiny_ws, "ledger", "export", eid, "--format", "md")
    assert "## Reference arm" in md and "| flag-off |" in md and f"turn {first['turn']} token {first['position']}" in md
    code, html, _ = run_cli("--workspace", tiny_ws, "ledger", "export", eid, "--format", "html")
    assert "<h2>Reference arm" in html
    code, junit, _ = run_cli("--workspace", tiny_ws, "ledger", "export", eid, "--format", "junit")
    assert 'name="reference_departed_off" value="' in junit and 'name="verdict" value="INCONCLUSIVE"' in junit
    from gatekeeper.review import pages
    from gatekeeper.review.source import Source

    page = pages.evaluation(Source(tiny_ws, f"sqlite:///{tiny_ws / 'ledger' / 'evidence.db'}"), eid)
    assert [row[0] for row in page["reference"]["rows"]] == ["flag-off", "flag-on"]
    code, text, _ = run_cli("--workspace", tiny_ws, "evaluate", "--flag", "prefix_cache", "--engine", "shared")
    assert "reference arm off / on" in text and "base_defect: both arms depart" in text
    # the on/off comparison alone is blind to it
    policy = tiny_ws / "policies" / "prefix_cache.yaml"
    policy.write_text(policy.read_text() + "reference: false\n")
    code, blind = evaluate(run_cli, tiny_ws, "shared")
    assert blind["verdict"] == "PASS" and blind["reference"] is None


def test_a_defect_of_the_flag_alone_still_fails_and_the_reference_says_which_arm(tiny_ws, run_cli):
    _reference_on(tiny_ws)
    code, out = evaluate(run_cli, tiny_ws, "short")
    assert out["verdict"] == "FAIL", out["reasons"]
    assert out["reference"]["departs"] == {"off": False, "on": True}
    assert any(x.startswith("departs_from_reference: the flag-on arm") for x in out["reasons"])


def test_a_defect_of_the_base_alone_is_reported_as_repaired_by_the_flag(tiny_ws, tiny_llama, run_cli):
    """Planted: the flag-off side's decode is broken and the flag-on side's is not (on this model it moves the logits,
    not the tokens: equal outputs, a PASS graded by its drift). The reference arm says which side is wrong: the base,
    which the flag repairs. (Each arm is judged on the two candidates it gave: this caught R reading the flag-on arm's
    gaps against the flag-off arm's second choices where their tokens were equal.)"""
    (tiny_ws / "engines" / "repaired.yaml").write_text(profile("fault_engines:RepairedByTheFlag", tiny_llama))
    code, out = evaluate(run_cli, tiny_ws, "repaired")
    assert (code, out["verdict"]) == (0, "PASS") and out["strength"]["grade"] == "equal_outputs", out["reasons"]
    assert out["reference"]["departs"] == {"off": True, "on": False}
    (line,) = [x for x in out["reasons"] if x.startswith("repairs_base:")]
    assert "the flag-off arm departs from a cache-free read of its own answers at " in line
    assert not any(x.startswith(("base_defect:", "departs_from_reference:")) for x in out["reasons"])


def test_the_reference_against_itself_under_another_batch_shape_is_within_the_floor(tiny_llama):
    import numpy as np

    from gatekeeper.engines.registry import build_engine
    from gatekeeper.workspace import EngineProfile

    engine = build_engine(EngineProfile(adapter="torch", model=str(tiny_llama)))
    tokens = engine.tokenize("The quick brown fox jumps over the lazy dog, again and again.")
    asked = [[t, 0] for t in tokens[1:]]
    one, two = (engine.reference(tokens, len(tokens) - 1, asked, batch=b) for b in (1, 2))
    assert one.dtype == "float64"
    assert np.allclose([a for a, _ in one.asked], [a for a, _ in two.asked], rtol=0, atol=1e-12)
    # the engine's own float32 forward agrees with its float64 reference far within the gap tolerance
    with engine.session() as s:
        own = s.score(tokens[:1], tokens[1:])
    np.testing.assert_allclose(own.token_logprobs, [a for a, _ in one.asked], atol=1e-4)
    engine.close()


def test_mlx_reads_the_reference_torch_reads_and_an_mlx_evaluation_is_checked_by_it(tiny_ws, tiny_llama, run_cli):
    """mlx-lm's forward with no cache object (float32) against the torch reference (float64) on the same weights:
    the same picks, the gaps within the tolerance the arm would apply; and an evaluation on mlx reads it."""
    from gatekeeper.engines.registry import build_engine
    from gatekeeper.gate.arms.reference import FLOOR, GAP
    from gatekeeper.workspace import EngineProfile

    torch_, mlx = (build_engine(EngineProfile(adapter=a, model=str(tiny_llama), dtype="float32")) for a in ("torch", "mlx"))
    try:
        tokens = torch_.tokenize("The quick brown fox jumps over the lazy dog, again and again.")
        steps, asked = len(tokens) - 1, [[t, t] for t in tokens[1:]]
        want, got = torch_.reference(tokens, steps, asked), mlx.reference(tokens, steps, asked)
        own = torch_.reference(tokens, steps, asked, own=True)
    finally:
        torch_.close()
        mlx.close()
    gap = lambda top2: top2[0][1] - top2[1][1]  # noqa: E731
    floor = max(FLOOR, *(abs(gap(a) - gap(b)) for a, b in zip(want.top2, own.top2)))
    assert got.dtype == "float32" and [t[0][0] for t in got.top2] == [t[0][0] for t in want.top2]
    assert max(abs(gap(a) - gap(b)) for a, b in zip(want.top2, got.top2)) <= GAP * floor
    _reference_on(tiny_ws)
    code, out = evaluate(run_cli, tiny_ws, "tiny_mlx")
    assert (code, out["verdict"]) == (0, "PASS"), out["reasons"]
    assert out["reference"]["dtype"] == "float32" and not any(out["reference"]["departs"].values())


def test_an_engine_whose_logits_are_not_finite_is_named_with_case_and_step(tiny_ws, tiny_llama, run_cli):
    (tiny_ws / "engines" / "nan.yaml").write_text(profile("fault_engines:NotFinite", tiny_llama))
    code, out = evaluate(run_cli, tiny_ws, "nan")
    assert out["verdict"] == "FAIL" and code == 1, out["reasons"]
    assert out["reasons"][0].startswith("crashed: "), out["reasons"]
    assert "non-finite logits at generated step 3 of case tiny/" in out["reasons"][0], out["reasons"]


def test_a_read_is_log_probabilities_of_its_rows_and_a_row_not_finite_stops_it():
    import math

    import numpy as np
    import pytest

    from gatekeeper.engines.base import Referenced
    from gatekeeper.errors import GatekeeperError

    r = Referenced.of(np.array([[0.0, 2.0, 1.0], [3.0, 3.0, 0.0]]), [[1, 0], [2, 1]], "float64", "m")
    z = math.log(1 + math.e ** 2 + math.e)
    assert [t[0] for t in r.top2[0]] == [1, 2] and abs(r.top2[0][0][1] - (2 - z)) < 1e-12
    assert [t[0] for t in r.top2[1]] == [0, 1]  # a tie: the lowest id first, as greedy picks
    assert abs(r.asked[0][1] - (0 - z)) < 1e-12 and len(r.asked) == 2
    with pytest.raises(GatekeeperError, match="reference read of m gave non-finite logits at position 2 of 2"):
        Referenced.of(np.array([[0.0, 1.0], [np.nan, 1.0]]), [[0, 1], [0, 1]], "float32", "m")


def test_a_defect_only_the_cache_probes_reach_is_read_there(tiny_ws, tiny_llama, run_cli):
    """Planted: positions wrap past 600 tokens on both arms (``PositionsWrap``); no case is that long, a block probe
    past 512 tokens is. R reads the probes' answers too (the window crossing, the block edge, the continuation start, the stage-prefix
    cut): ``base_defect:`` named at the probe, where the cases and the on/off comparison see nothing."""
    _reference_on(tiny_ws)
    policy = tiny_ws / "policies" / "prefix_cache.yaml"
    policy.write_text(policy.read_text() + "probes:\n  block: 512\n")
    (tiny_ws / "engines" / "wraps.yaml").write_text(profile("fault_engines:PositionsWrap", tiny_llama))
    code, out = evaluate(run_cli, tiny_ws, "wraps")
    assert out["verdict"] == "INCONCLUSIVE" and code != 0, out["reasons"]
    assert out["reasons"][0].startswith("base_defect: both arms depart"), out["reasons"]
    arms = out["reference"]["arms"]
    for arm in arms.values():
        assert arm["probed"] > 0 and arm["departures"]
        assert {d["case"] for d in arm["departures"]} == {"probe:block"}, arm["departures"]
    assert out["probes"]["block"] == "equal"  # the on/off comparison of the probe is blind to it
