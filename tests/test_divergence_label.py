"""How a first divergence is labelled: "near-tie" only when both sides' top-2 margins are near a tie
(a few ULPs can flip either), "one-sided collapse" when only one side's is (the other's above twice NEAR_TIE
and at least COLLAPSE times it: rounding cannot explain that), neither otherwise or where a side has no
top-2 logits. The gate's reasons, ``ledger diff``/JUnit (``divergence_text``) and ``ledger export``
print it in one wording (``kinds.divergence``)."""

from __future__ import annotations

import pytest

from gatekeeper.gate.kinds import COLLAPSE, NEAR_TIE, ByteEquivalence, Evidence, divergence, token_diff
from gatekeeper.reports.export import _differences, _labels
from gatekeeper.reports.outcomes import divergence_text
from gatekeeper.workspace import Policy

PIECES = {5: "cat", 7: "dog", 1: "the"}


def detok(ids):
    return "".join(PIECES.get(i, "?") for i in ids)


def result(tokens, top2):
    """One turn as the gate records it: token ids, text and, per generated step, the top-2 [id, logit]."""
    return {"turns": [{"tokens": tokens, "text": detok(tokens), "top2": top2}], "outcomes": []}


def step(best, second, ids):
    return [[ids[0], best], [ids[1], second]]


def pair(margin_off, margin_on):
    """Flag off picks 5 over 7 by ``margin_off`` at step 1, flag on picks 7 over 5 by ``margin_on``;
    step 0 is shared (the, by 3.0 on both). The runner-up's logit is 0 so that each margin is exact.
    A margin of None: that side recorded no top-2 logits."""
    off = result([1, 5], None if margin_off is None else [step(4.0, 1.0, (1, 5)), step(margin_off, 0.0, (5, 7))])
    on = result([1, 7], None if margin_on is None else [step(4.0, 1.0, (1, 5)), step(margin_on, 0.0, (7, 5))])
    return off, on


def reason(d, sides=("with the flag off", "with the flag on")):
    policy = Policy(flag="prefix_cache", gate="byte_equivalence")
    verdict, reasons = ByteEquivalence(policy, sides).decide(
        Evidence(1, [("s/a", {"pair": "off#0~on#0", **d})], {"off": 0, "on": 0}, 10, 10, True, 2))
    assert verdict == "FAIL" and len(reasons) == 1
    return reasons[0]


def test_a_one_sided_collapse_is_not_a_near_tie():
    # The case: flag off 0.206, flag on 0.003 was called a near-tie, which a reviewer reads as noise.
    d = token_diff(*pair(0.206, 0.003), detok)
    assert (d["turn"], d["first_divergent_position"], d["a"]["token"], d["b"]["token"]) == (1, 1, 5, 7)
    assert d["a"]["margin"] == pytest.approx(0.206) and d["b"]["margin"] == pytest.approx(0.003)
    assert d["near_tie"] is False and d["collapse"] == "b"

    assert divergence(d) == ("(5 vs 7, margin 0.206 vs 0.003, one-sided collapse: the margin fell to 0.003 (flag-on) "
                             "while it is 0.206 (flag-off); rounding cannot explain it)")
    why = reason(d)
    assert why == ("differs: s/a turn 1 first divergent token at position 1 (5 vs 7, margin 0.206 vs 0.003, one-sided "
                   "collapse: the margin fell to 0.003 (with the flag on) while it is 0.206 (with the flag off); "
                   "rounding cannot explain it)")
    assert "near-tie" not in why

    # The ledger's one-line view (ledger diff, JUnit) and the export say the same.
    text = divergence_text({"pair": "off#0~on#0", **d})
    assert text == ("turn 1 position 1: tokens (5 'cat' vs 7 'dog', margin 0.206 vs 0.003, one-sided collapse: the "
                    "margin fell to 0.003 (flag-on) while it is 0.206 (flag-off); rounding cannot explain it)")
    (view,) = _differences({"comparisons": [{"case_id": "s/a", "equal": False, "detail": {"pair": "off#0~on#0", **d}}]})
    assert _labels(view) == "near-tie: no; one-sided collapse: yes, on#0"
    assert "one-sided collapse: the margin fell to 0.003 (on#0) while it is 0.206 (off#0)" in view["divergence"]


def test_the_collapse_names_the_side_that_collapsed():
    d = token_diff(*pair(0.003, 0.206), detok)
    assert d["near_tie"] is False and d["collapse"] == "a"
    assert "the margin fell to 0.003 (flag-off) while it is 0.206 (flag-on)" in divergence(d)
    # a baseline that disagreed with itself names its two runs
    text = divergence_text({"pair": "off#0~off#1", **d})
    assert "the margin fell to 0.003 (off#0) while it is 0.206 (off#1)" in text


def test_both_margins_small_is_a_near_tie():
    d = token_diff(*pair(0.01, 0.02), detok)
    assert d["near_tie"] is True and d["collapse"] is None
    assert divergence(d) == "(5 vs 7, margin 0.01 vs 0.02, near-tie)"
    assert reason(d).endswith("(5 vs 7, margin 0.01 vs 0.02, near-tie)")
    # one side a thousand times the other, both near a tie: rounding can flip either, so a near-tie
    d = token_diff(*pair(0.1, 0.0001), detok)
    assert d["near_tie"] is True and d["collapse"] is None


def test_both_margins_large_is_neither():
    d = token_diff(*pair(2.5, 1.5), detok)
    assert d["near_tie"] is False and d["collapse"] is None
    assert divergence(d) == "(5 vs 7, margin 2.5 vs 1.5)"
    assert "collapse" not in reason(d) and "near-tie" not in reason(d)


@pytest.mark.parametrize("off, on", [(None, 0.003), (0.206, None), (None, None), (0.003, None)])
def test_a_side_without_top2_is_neither(off, on):
    d = token_diff(*pair(off, on), detok)
    assert d["near_tie"] is False and d["collapse"] is None
    text = divergence(d)
    assert "n/a" in text and "near-tie" not in text and "collapse" not in text


def test_the_collapse_rule_at_its_edges():
    assert (NEAR_TIE, COLLAPSE) == (0.1, 10)
    # one side near a tie, the other above NEAR_TIE but under COLLAPSE times it: neither label
    d = token_diff(*pair(0.3, 0.05), detok)
    assert d["near_tie"] is False and d["collapse"] is None
    # at NEAR_TIE exactly on one side, ten times that on the other: a collapse
    d = token_diff(*pair(1.0, 0.1), detok)
    assert d["collapse"] == "b" and d["near_tie"] is False
    # a side at an exact tie, the other at 0.125 (a bfloat16 monolithic hit did this): within rounding, neither
    d = token_diff(*pair(0.0, 0.125), detok)
    assert d["collapse"] is None and d["near_tie"] is False
    # the other clear of twice NEAR_TIE: a collapse
    d = token_diff(*pair(0.0, 0.21), detok)
    assert d["collapse"] == "a"


def test_old_entries_without_collapse_still_render():
    d = token_diff(*pair(0.206, 0.003), detok)
    old = {k: v for k, v in d.items() if k != "collapse"}
    old["near_tie"] = True  # what the old rule (the smaller margin alone) recorded
    assert divergence(old).endswith(", near-tie)")
    (view,) = _differences({"comparisons": [{"case_id": "s/a", "equal": False, "detail": {"pair": "off#0~on#0", **old}}]})
    assert _labels(view) == "near-tie: yes; one-sided collapse: not recorded"
