"""The strength of a PASS: top-2 logit drift between the flag-off and flag-on runs, graded
``bit_exact`` or ``equal_outputs``; ``require: bit_exact`` makes a drift INCONCLUSIVE; and the
near-tie census of the flag-off baseline, with ``insensitive:`` advice for a battery far from every tie.

Through the real CLI on the tiny llama (the tiny suite's shared 12-rule prefix and the chained turns
of ``tiny/loop`` give the hits). The aligned plan cuts the cold prefill where a hit lands, so the
cache changes no shape and nothing drifts. The monolithic plan in bfloat16 prefills a hit's suffix in
one pass of another shape than the cold run's; how that rounds is the CPU's (a drift with equal
outputs on one, outputs parting at the first step on another, nothing at all with torch's AVX2
kernels), so it is held only to the grade its own records call for, and a drift with equal outputs
is built on purpose instead: planted noise on the restored state under the aligned plan in float32
(``near_tie.NoisyHit``)."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import evaluate, ledger, read_reference
from near_tie import noisy_hit_profile

ALIGNED = {dtype: f"aligned_{dtype}" for dtype in ("float32", "bfloat16")}


def write_profile(ws, name, model, *, dtype, prefill):
    (ws / "engines" / f"{name}.yaml").write_text(
        f"adapter: torch\nmodel: {model}\ndtype: {dtype}\ndevice: cpu\nprefill: {prefill}\nchunk: 256\n")


def require_bit_exact(ws):
    policy = ws / "policies" / "prefix_cache.yaml"
    policy.write_text(policy.read_text().rstrip("\n") + "\nrequire: bit_exact\n")


def runs(ws, evaluation_id):
    """{(config, repeat): {case id: result}} from the ledger: the raw evidence the figures must agree with."""
    with ledger(ws) as lg:
        record = lg.evaluation(evaluation_id)
    out: dict = {}
    for r in record["case_results"]:
        out.setdefault((r["config"], r["repeat"]), {})[r["case_id"]] = r["result"]
    return out


def shared_drifts(off, on):
    """{(case, turn, step): (drift, smaller margin)} at the steps both sides share before they part,
    recomputed here from the recorded top-2 values."""
    out = {}
    for cid, a in off.items():
        for n, (ta, tb) in enumerate(zip(a["turns"], on[cid]["turns"]), 1):
            same = 0
            while same < min(len(ta["tokens"]), len(tb["tokens"])) and ta["tokens"][same] == tb["tokens"][same]:
                p, q = ta["top2"][same], tb["top2"][same]
                out[(cid, n, same)] = (max(abs(p[0][1] - q[0][1]), abs(p[1][1] - q[1][1])),
                                       min(p[0][1] - p[1][1], q[0][1] - q[1][1]))
                same += 1
            if ta["tokens"] != tb["tokens"]:
                break  # a later turn extends another transcript
    return out


def export(run_cli, ws, evaluation_id, fmt):
    code, out, _ = run_cli("--workspace", ws, "ledger", "export", evaluation_id, "--format", fmt)
    assert code == 0
    return out


@pytest.mark.parametrize("dtype", sorted(ALIGNED))
def test_aligned_plan_is_bit_exact(run_cli, tiny_ws, tiny_llama, dtype):
    write_profile(tiny_ws, ALIGNED[dtype], tiny_llama, dtype=dtype, prefill="aligned")
    require_bit_exact(tiny_ws)  # satisfied: the grade is bit_exact
    code, out = evaluate(run_cli, tiny_ws, ALIGNED[dtype])
    assert (code, out["verdict"]) == (0, "PASS"), out["reasons"]
    s = out["strength"]
    assert s["grade"] == "bit_exact" and s["max_drift"] == 0.0 and s["where"] is None, s
    assert s["steps_at_risk"] == 0 and s["unknown"] == 0
    assert f"bit_exact: top-2 logits identical at all {s['steps']} generated steps of both configurations" in out["reasons"]

    r = runs(tiny_ws, out["evaluation_id"])
    off, on = r[("off", 0)], r[("on", 0)]
    assert s["steps"] == sum(len(t["tokens"]) for res in on.values() for t in res["turns"]) > 0
    for cid in off:  # the claim, checked on the raw evidence: every step's top-2 ids and values identical
        assert [t["top2"] for t in off[cid]["turns"]] == [t["top2"] for t in on[cid]["turns"]], cid
    assert out["tokens"]["cached_on"] > 0  # and the cache did serve: the hits changed nothing


def test_monolithic_bfloat16_is_graded_by_what_it_recorded(run_cli, tiny_ws, tiny_llama, record_property):
    """The real monolithic plan in bfloat16: a hit prefills its suffix in a pass of another shape than
    the cold run's. What that does is the CPU's bf16 kernels' business: here (AMD, AVX-512 BF16) the
    logits drift and the outputs stay equal; on an Intel Xeon with AMX the outputs part at the first
    step; with torch's AVX2 kernels (``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2``) nothing
    moves. So this asserts what holds on every CPU: the verdict and grade are the ones the recorded
    top-2 values call for, the figures are theirs, and ``require: bit_exact`` passes only bit_exact.
    (``test_drift_with_equal_outputs_...`` below builds a drift on purpose.)"""
    write_profile(tiny_ws, "mono_bf16", tiny_llama, dtype="bfloat16", prefill="monolithic")
    code, out = evaluate(run_cli, tiny_ws, "mono_bf16")
    s = out["strength"]
    assert out["tokens"]["cached_on"] > 0

    r = runs(tiny_ws, out["evaluation_id"])
    off, on = r[("off", 0)], r[("on", 0)]
    parted = sorted(cid for cid in off if [t["tokens"] for t in off[cid]["turns"]] != [t["tokens"] for t in on[cid]["turns"]])
    drifts = shared_drifts(off, on)
    moved = max((d for d, _ in drifts.values()), default=0.0)
    record_property("monolithic_bf16", f"{out['verdict']} {s['grade']} max drift {s['max_drift']}, parted: {parted}")
    if parted:
        assert (code, out["verdict"]) == (1, "FAIL") and sorted(out["differing_cases"]) == parted, out["reasons"]
        assert s["grade"] is None
    else:
        assert (code, out["verdict"]) == (0, "PASS"), out["reasons"]
        assert s["grade"] == ("equal_outputs" if moved else "bit_exact"), s
        assert any(x.startswith(f"{s['grade']}:") for x in out["reasons"]), out["reasons"]

    # The figures agree with the recorded top-2 values (only steps before any divergence count).
    assert s["steps"] == len(drifts) and s["unknown"] == 0
    assert s["max_drift"] == (moved if drifts else None)
    if moved:
        assert drifts[(s["where"]["case"], s["where"]["turn"], s["where"]["step"])][0] == s["max_drift"]
        assert s["steps_at_risk"] == sum(m <= 10 * moved for _, m in drifts.values())
    else:
        assert s["where"] is None and s["steps_at_risk"] == 0

    require_bit_exact(tiny_ws)
    code, strict = evaluate(run_cli, tiny_ws, "mono_bf16")
    assert strict["strength"] == s  # the same run, the same drift
    expected = "FAIL" if parted else "INCONCLUSIVE" if moved else "PASS"  # a requirement never softens a FAIL
    assert (code, strict["verdict"]) == (int(expected != "PASS"), expected), strict["reasons"]


def test_drift_with_equal_outputs_is_graded_and_bit_exact_policy_is_inconclusive(run_cli, tiny_ws, tiny_llama):
    """A drift built on purpose: the aligned plan in float32 (bit-exact, above) with the package's planted
    noise on every restored state, small enough that the logits move and no token can flip (the seeded
    noise moves them the same on every CPU, to float32 rounding)."""
    (tiny_ws / "engines" / "drift.yaml").write_text(noisy_hit_profile(tiny_llama, noise=1e-4))
    read_reference(tiny_ws)
    code, out = evaluate(run_cli, tiny_ws, "drift")
    assert (code, out["verdict"]) == (0, "PASS"), out["reasons"]
    # the reference arm sees the planted noise in the flag-on arm's top-2 gaps, never a token it would not pick:
    # drift, reported, which the policy decides (below: require bit_exact)
    assert out["reference"]["departs"] == {"off": False, "on": True} and out["reference"]["arms"]["on"]["flipped"] == 0
    assert any(x.startswith("departs_from_reference: the flag-on arm") and "top-2 gaps only" in x
               for x in out["reasons"]), out["reasons"]
    s = out["strength"]
    assert s["grade"] == "equal_outputs" and s["max_drift"] > 0 and s["where"] is not None, s
    # The construction's premise: the largest drift is far below the smallest top-2 margin, so no step flips.
    assert 4 * s["max_drift"] < out["near_ties"]["tiny"]["min_margin"], (s, out["near_ties"])
    where = f"{s['where']['case']} turn {s['where']['turn']} step {s['where']['step']}"

    # The figures agree with the recorded top-2 values (every step is shared: the outputs are equal).
    r = runs(tiny_ws, out["evaluation_id"])
    drifts = shared_drifts(r[("off", 0)], r[("on", 0)])
    assert s["steps"] == len(drifts) == sum(len(t["tokens"]) for res in r[("on", 0)].values() for t in res["turns"])
    assert max(d for d, _ in drifts.values()) == s["max_drift"]
    assert drifts[(s["where"]["case"], s["where"]["turn"], s["where"]["step"])][0] == s["max_drift"]
    assert s["steps_at_risk"] == sum(m <= 10 * s["max_drift"] for _, m in drifts.values()) > 0

    (graded,) = [x for x in out["reasons"] if x.startswith("equal_outputs:")]
    assert graded == (f"equal_outputs: max drift {s['max_drift']:.3g} at {where}; {s['steps_at_risk']} of "
                      f"{s['steps']} steps at risk (top-2 margin within 10× the drift)")
    assert not any(x.startswith("bit_exact:") for x in out["reasons"])

    md = export(run_cli, tiny_ws, out["evaluation_id"], "md")
    assert "## Strength (off#0~on#0)" in md and f"- where: {where}" in md
    assert f"- max top-2 logit drift: {s['max_drift']:.4g}" in md
    assert f"- steps at risk (top-2 margin within 10× the drift): {s['steps_at_risk']} of {s['steps']}" in md
    page = export(run_cli, tiny_ws, out["evaluation_id"], "html")
    assert f"<td>{where}</td>" in page and "<h2>Strength" in page
    assert json.loads(export(run_cli, tiny_ws, out["evaluation_id"], "json"))["strength"]["where"] == s["where"]

    require_bit_exact(tiny_ws)
    code, strict = evaluate(run_cli, tiny_ws, "drift")
    assert strict["strength"] == s  # the same seeded noise, the same drift
    assert (code, strict["verdict"]) == (1, "INCONCLUSIVE"), strict["reasons"]
    assert strict["reasons"][0] == (f"drift: the policy requires bit_exact, but top-2 logits moved by "
                                    f"{s['max_drift']:.3g} at {where} ({s['steps_at_risk']} of {s['steps']} steps at risk)")


def test_bit_exact_policy_never_softens_a_fail(run_cli, tiny_ws):
    require_bit_exact(tiny_ws)
    read_reference(tiny_ws)
    code, out = evaluate(run_cli, tiny_ws, "short")  # a cache that restores one position short
    assert (code, out["verdict"]) == (1, "FAIL") and out["differing_cases"], out["reasons"]
    assert out["strength"]["grade"] is None
    # advice (insensitive:), the teacher-forced distance (kld:) and the reference arm's finding are beside the FAIL
    assert out["reasons"][-1].startswith("departs_from_reference: the flag-on arm"), out["reasons"]
    assert all(x.startswith("differs:") for x in out["reasons"][:-1] if not x.startswith(("insensitive:", "kld:"))), out["reasons"]


def sharpened(src, dst, factor):
    """``src`` with its final norm's weight times ``factor``: every logit scaled by it, so the greedy
    choices stay and every top-2 margin grows ``factor``-fold."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = load_file(dst / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] * factor
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def census_from(results):
    margins = [p[0][1] - p[1][1] for res in results.values() for t in res["turns"] for p in t["top2"]]
    return len(margins), sum(m <= 0.1 for m in margins), min(margins)


def test_battery_far_from_every_tie_is_insensitive(run_cli, tiny_ws, tiny_llama, tmp_path):
    write_profile(tiny_ws, "sharp", sharpened(tiny_llama, tmp_path / "sharp", 100.0), dtype="float32", prefill="monolithic")
    code, out = evaluate(run_cli, tiny_ws, "sharp")
    assert (code, out["verdict"]) == (0, "PASS"), out["reasons"]  # advice, not a failure
    row = out["near_ties"]["tiny"]
    steps, ties, smallest = census_from(runs(tiny_ws, out["evaluation_id"])[("off", 0)])
    assert (row["steps"], row["near_ties"], row["min_margin"]) == (steps, 0, smallest) and ties == 0
    assert smallest > 1.0  # far from the threshold, not just past it
    (advice,) = [x for x in out["reasons"] if x.startswith("insensitive:")]
    assert advice.startswith(f"insensitive: suite tiny: none of its {steps} flag-off decode steps has a top-2 margin "
                             f"at or below 0.1 (smallest {smallest:.3g})")

    md = export(run_cli, tiny_ws, out["evaluation_id"], "md")
    assert f"| tiny | {steps} | 0 | {smallest:.4g} | 0 |" in md
    assert "- **insensitive**: suite tiny never came near a tie" in md and f"- {advice}" in md
    page = export(run_cli, tiny_ws, out["evaluation_id"], "html")
    assert '<tr class="insensitive"><td>tiny</td>' in page and "<strong>insensitive</strong>: suite tiny" in page
    assert json.loads(export(run_cli, tiny_ws, out["evaluation_id"], "json"))["near_ties"][0]["insensitive"] is True


def test_a_bit_exact_pass_far_from_every_tie_gets_no_advice(run_cli, tiny_ws, tiny_llama, tmp_path):
    """The same sharpened model on the aligned plan: the top-2 logits match at every step, so no drift was there for
    an output to show, and the census (still recorded) is no reason for advice (the shipped router suite's case)."""
    write_profile(tiny_ws, "sharp", sharpened(tiny_llama, tmp_path / "sharp", 100.0), dtype="float32", prefill="aligned")
    code, out = evaluate(run_cli, tiny_ws, "sharp")
    assert (code, out["verdict"]) == (0, "PASS"), out["reasons"]
    assert out["strength"]["grade"] == "bit_exact" and out["near_ties"]["tiny"]["near_ties"] == 0
    assert not any(x.startswith("insensitive:") for x in out["reasons"]), out["reasons"]


def test_battery_with_near_ties_gets_no_advice(run_cli, tiny_ws, monkeypatch, capsys):
    code, out = evaluate(run_cli, tiny_ws, "tiny")
    assert (code, out["verdict"]) == (0, "PASS"), out["reasons"]
    steps, ties, smallest = census_from(runs(tiny_ws, out["evaluation_id"])[("off", 0)])
    assert ties > 0 and out["near_ties"]["tiny"] == {"steps": steps, "near_ties": ties, "min_margin": smallest, "unknown": 0}
    assert not any(x.startswith("insensitive:") for x in out["reasons"])

    from gatekeeper.cli.tables import print_outcome
    from gatekeeper.gate.evaluator import Outcome

    monkeypatch.setenv("COLUMNS", "250")
    print_outcome(Outcome(**out))
    shown = capsys.readouterr().out
    assert f"{ties} of {steps} decode steps with a top-2 margin <= 0.1 (smallest {smallest:.3g})" in shown
    assert "strength off~on" in shown and out["strength"]["grade"] in shown


# --- the figures on hand-made results: unknown drift, and a FAIL's steps ---------------------------


def result(tokens, top2):
    return {"turns": [{"tokens": tokens, "text": "", "top2": top2}], "outcomes": []}


def step(best, second=0.0, ids=(1, 2)):
    return [[ids[0], best], [ids[1], second]]


def test_no_top2_means_drift_unknown_never_bit_exact():
    from gatekeeper.gate.kinds import ByteEquivalence, Evidence, strength
    from gatekeeper.workspace import Policy

    off = result([1, 1], [step(3.0), step(2.0)])
    s = strength([("s/a", off, result([1, 1], None))], outputs_differ=False)
    assert (s.grade, s.max_drift, s.unknown, s.steps) == ("equal_outputs", None, 2, 2)
    assert s.unknown_where == {"case": "s/a", "turn": 1, "step": 0}
    assert s.reason().startswith("equal_outputs: drift unknown at 2 of 2 steps")

    policy = Policy(flag="prefix_cache", gate="byte_equivalence", require="bit_exact")
    verdict, reasons = ByteEquivalence(policy).decide(Evidence(1, [], {"off": 0, "on": 0}, 10, 10, True, 2, s))
    assert verdict == "INCONCLUSIVE" and reasons[0].startswith("drift: the policy requires bit_exact, but the drift is unknown")
    # A drift bound cannot be shown to hold where no step had top-2 logits on both sides.
    policy = Policy(flag="prefix_cache", gate="byte_equivalence", max_drift=1.0)
    verdict, reasons = ByteEquivalence(policy).decide(Evidence(1, [], {"off": 0, "on": 0}, 10, 10, True, 2, s))
    assert verdict == "INCONCLUSIVE" and reasons[0] == ("drift: the policy bounds the drift at 1, but no top-2 logits "
                                                        "were compared (none at 2 of 2 steps)")


def test_a_fail_counts_only_the_steps_before_the_divergence():
    from gatekeeper.gate.kinds import strength

    off = result([1, 1, 5, 1], [step(3.0), step(2.0, 1.99), step(9.0), step(1.0)])
    on = result([1, 1, 6, 1], [step(3.0), step(2.25, 1.99), step(1.0, ids=(6, 5)), step(90.0)])
    s = strength([("s/a", off, on)], outputs_differ=True)
    assert (s.grade, s.steps, s.max_drift, s.where) == (None, 2, 0.25, {"case": "s/a", "turn": 1, "step": 1})
    assert s.steps_at_risk == 1  # step 1's margin 0.01 is within 10 × 0.25; step 0's 3.0 is not
