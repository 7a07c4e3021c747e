"""The printed bounds bound what they say (issue #60, items 7, 9 and 10).

- The paired loss bound (``gate/stats/paired.py``) is monotone in harm: one more harmful flip never lowers the upper bound on
  the loss, so it never turns a verdict that is not a PASS into one; its size at a true loss equal to the margin and
  its power at a stated effect are shown by seeded simulations of clustered outcomes.
- The unpaired total-variation bound (``gate/stats/unpaired.py``, ``gate/stats/distance.py``) is an upper bound where the KL is
  read from top-k rows (a lower bound), and an unpaired PASS never rests on that lumped KL.
- The coupled walk (``gate/stats/coupling.py``) counts a parting with no differing token (one answer a strict prefix of the
  other) as one mismatched step.

The simulations are seeded (random.Random) and sized to run in about a second each.
"""

from __future__ import annotations

import math
import random

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from gatekeeper.engines.base import Scored
from gatekeeper.gate.stats import coupling, distance, paired, unpaired

# --- item 7: the paired bound is monotone in harm -------------------------------------------------------------------

OUTCOMES = [(True, True), (False, False), (True, False), (False, True)]  # concordant x2, harmful, beneficial


def nine_beneficial(harmful_in_tenth: bool) -> list[paired.Pair]:
    """20 cases of 8 assertions; 9 beneficial flips, each in a case of its own; optionally one harmful in a 10th."""
    pairs = [(f"case{case}", True, True) for case in range(20) for _ in range(8)]
    for case in range(9):
        pairs[8 * case] = (f"case{case}", False, True)
    if harmful_in_tenth:
        pairs[8 * 9] = ("case9", True, False)
    return pairs


def test_a_harmful_flip_in_a_tenth_case_does_not_make_a_pass():
    before = paired.decide(nine_beneficial(False), 0.05)
    after = paired.decide(nine_beneficial(True), 0.05)
    assert before.verdict == "underpowered" and before.upper > 0.05, before.reason()
    assert after.harmful == 1 and after.beneficial == 9 and after.n == before.n == 160
    assert after.upper >= before.upper and after.verdict != "pass", after.reason()


@st.composite
def battery(draw: st.DrawFn) -> list[paired.Pair]:
    """A battery of 1 to 14 clusters of 1 to 8 assertions, each pair's outcome drawn (flips made likely)."""
    sizes = draw(st.lists(st.integers(1, 8), min_size=1, max_size=14))
    return [(f"case{k}", *draw(st.sampled_from(OUTCOMES))) for k, m in enumerate(sizes) for _ in range(m)]


def more_harm(pairs: list[paired.Pair], i: int) -> list[paired.Pair] | None:
    """The same battery with pair ``i`` one step more harmful: concordant -> harmful, beneficial -> concordant."""
    cluster, off, on = pairs[i]
    if off and not on:
        return None  # already harmful
    out = list(pairs)
    out[i] = (cluster, True, False) if off == on else (cluster, True, True)
    return out


@settings(max_examples=300, deadline=None, derandomize=True)
@given(battery(), st.data(), st.sampled_from([0.0, 0.02, 0.05, 0.1, 0.2, 0.3]), st.sampled_from([0.05, 0.025, 0.1]))
def test_more_harm_never_lowers_the_upper_bound_nor_makes_a_pass(pairs, data, margin, alpha):
    """On one battery (its cases and assertions fixed), one more harmful flip, or one beneficial flip fewer, never
    lowers either bound on the loss: a verdict that was not a PASS stays one, and a FAIL stays a FAIL."""
    i = data.draw(st.integers(0, len(pairs) - 1))
    worse = more_harm(pairs, i)
    if worse is None:
        return
    before, after = paired.decide(pairs, margin, alpha), paired.decide(worse, margin, alpha)
    assert after.upper >= before.upper - 1e-12, (before.reason(), after.reason())
    assert after.lower >= before.lower - 1e-12, (before.reason(), after.reason())
    assert before.verdict == "pass" or after.verdict != "pass", (before.reason(), after.reason())
    assert before.verdict != "fail" or after.verdict == "fail", (before.reason(), after.reason())


def clustered(rng: random.Random, clusters: int, size: int, p10: float, p01: float, rho: float) -> list[paired.Pair]:
    """Clusters whose pairs share their case's outcome with chance ``rho``, else draw their own: each pair is harmful
    with chance p10 and beneficial with p01 whatever rho, and pairs of one case are correlated (rho = 1: wholly)."""

    def one() -> tuple[bool, bool]:
        u = rng.random()
        return (True, False) if u < p10 else (False, True) if u < p10 + p01 else (True, True)

    out: list[paired.Pair] = []
    for k in range(clusters):
        shared = one()
        out += [(f"case{k}", *(shared if rng.random() < rho else one())) for _ in range(size)]
    return out


def passes(rng: random.Random, runs: int, margin: float, **kw: float) -> float:
    """The share of ``runs`` batteries drawn by ``clustered(rng, **kw)`` that PASS at ``margin``."""
    draws = (clustered(rng, **kw) for _ in range(runs))  # type: ignore[arg-type]
    return sum(paired.decide(pairs, margin).verdict == "pass" for pairs in draws) / runs


def test_sim_size_at_a_true_loss_equal_to_the_margin_clustered():
    """A true loss of 0.05 at margin 0.05 (7.5% harmful, 2.5% beneficial flips), 120 cases of 3 assertions: the false
    PASS rate stays at or below alpha (within three Monte Carlo standard errors), for wholly and half-correlated cases."""
    runs, alpha = 1500, 0.05
    tol = alpha + 3 * math.sqrt(alpha * (1 - alpha) / runs)
    rng = random.Random(60)
    for rho in (1.0, 0.5):
        rate = passes(rng, runs, 0.05, clusters=120, size=3, p10=0.075, p01=0.025, rho=rho)
        assert rate <= tol, (rho, rate)


def test_sim_power_at_a_stated_effect_clustered():
    """No true loss, discordance 0.1 (5% each way), margin 0.05: at ``cases_needed`` (274) cases of 3 wholly
    correlated assertions the PASS rate is about the power asked (0.8), and half-correlated cases pass no less often
    (the worst-case design effect costs power there, never size)."""
    rng = random.Random(61)
    k = int(paired.cases_needed(0.1, 0.05))
    assert k == 274
    whole = passes(rng, 800, 0.05, clusters=k, size=3, p10=0.05, p01=0.05, rho=1.0)
    half = passes(rng, 800, 0.05, clusters=k, size=3, p10=0.05, p01=0.05, rho=0.5)
    assert abs(whole - 0.8) <= 0.07, whole
    assert half >= whole - 0.05, (half, whole)


# --- item 9: the unpaired total-variation bound ---------------------------------------------------------------------

VOCAB, K = 60, 3


def tail_moved() -> tuple[Scored, Scored, float]:
    """Two distributions over 60 tokens with the same top 3 (0.3, 0.2, 0.1) and the other 0.4 on disjoint tails:
    their top-3 rows, lumped, read a KL of 0; their total variation is about 0.4."""
    eps = 1e-12
    p = np.full(VOCAB, eps)
    q = np.full(VOCAB, eps)
    p[:3] = q[:3] = [0.3, 0.2, 0.1]
    p[3:32] = 0.4 / 29
    q[32:] = 0.4 / 28
    p, q = p / p.sum(), q / q.sum()
    tv = 0.5 * float(np.abs(p - q).sum())
    rows_p, rows_q = np.log(np.stack([p, p])), np.log(np.stack([q, q]))
    return Scored.from_logprobs(rows_p, [0, 1], top_k=K), Scored.from_logprobs(rows_q, [0, 1], top_k=K), tv


def test_a_tail_moved_outside_the_top_k_is_not_reported_below_its_total_variation():
    a, b, tv = tail_moved()
    assert tv > 0.39
    d = distance.distance(a, b)
    assert d.approximation and d.kld.max < 1e-6  # the lumped KL sees nothing
    assert d.tv_max is not None and d.tv_max >= tv - 1e-6, (d.tv_max, tv)
    u = unpaired.Unpaired(1, 1, "case0")
    verdict, reasons = u.judge(True, distance.Compared(d, distance.distance(a, a)), True, None).on(
        "PASS", ["equal: placeholder"])
    assert verdict != "PASS", reasons
    assert u.tv_max is not None and u.tv_max >= tv - 1e-6, u
    assert any("lower bound" in r for r in reasons), reasons


def test_the_top_k_bound_holds_the_true_total_variation_on_random_distributions():
    rng = np.random.default_rng(60)
    la = rng.normal(size=(50, 200)) * 2
    lb = la + rng.normal(size=(50, 200)) * rng.uniform(0, 2, size=(50, 1))  # from nearly equal to far apart
    tokens = [int(t) for t in rng.integers(0, 200, 50)]
    a, b = Scored.from_logits(la, tokens), Scored.from_logits(lb, tokens)
    exact = distance.positions(a, b).tv
    for k in (1, 5, 20):
        bound = distance.positions(a.top(k), b.top(k)).tv
        assert (bound >= exact - 1e-6).all() and (bound <= 1.0).all(), k
    assert distance.distance(a, b).tv_max == float(exact.max())


def test_full_rows_keep_pinsker_and_a_peaked_top_k_may_still_pass():
    # identical full rows: KL 0, Pinsker's bound 0, an unpaired exact check PASSes
    rows = np.log(np.full((2, VOCAB), 1.0 / VOCAB))
    same = Scored.from_logprobs(rows, [0, 1])
    u = unpaired.Unpaired(1, 1, "case0")
    verdict, _ = u.judge(True, distance.Compared(distance.distance(same, same), None), True, None).on("PASS", [])
    assert verdict == "PASS" and u.tv_max == 0.0
    # identical, sharply peaked top-3 rows (all but 1e-9 of the mass shown): the TV bound is tiny, a PASS stands
    peak = np.full(VOCAB, 1e-9 / (VOCAB - 3))
    peak[:3] = [0.5, 0.3, 0.2 - 1e-9]
    top = Scored.from_logprobs(np.log(np.stack([peak, peak])), [0, 1], top_k=K)
    u = unpaired.Unpaired(1, 1, "case0")
    verdict, reasons = u.judge(True, distance.Compared(distance.distance(top, top), None), True, None).on("PASS", [])
    assert verdict == "PASS", reasons
    assert u.tv_max is not None and u.tv_max < 1e-5


# --- item 10: a parting with no differing token ---------------------------------------------------------------------


def walked(a: list[int], b: list[int]) -> tuple[coupling.Coupled, bool]:
    c = coupling.Coupled({}, 1)
    parted = coupling._walk(c, "case0 turn 1", {"tokens": a}, {"tokens": b})
    return c, parted


def test_one_answer_a_strict_prefix_of_the_other_is_one_mismatch():
    for a, b in (([5, 6, 7], [5, 6]), ([5, 6], [5, 6, 7]), ([], [5])):
        c, parted = walked(a, b)
        assert parted and c.mismatches == 1 and c.steps == min(len(a), len(b)) + 1, (a, b, c)
    c, parted = walked([5, 6, 7], [5, 6, 7])
    assert not parted and c.mismatches == 0 and c.steps == 3
    c, parted = walked([5, 6, 7], [5, 9, 7])  # a differing token: one mismatch, the walk stops there
    assert parted and c.mismatches == 1 and c.steps == 2


def test_a_sampled_parting_with_equal_logits_is_the_seeds_not_the_kernels():
    """#60 item 12: two runs of a sampled case that part where both read the same top-2 logits drew twice from one
    distribution (a seed batching broke); other top-2 logits there, or a greedy case, are the numerics'."""
    from gatekeeper.gate.run.production import seed_broken

    def run(tokens, top2, draws=True):
        turn = {"tokens": tokens, "top2": top2, **({"draws": [[-1.0, -1.0, -0.5]] * len(tokens)} if draws else {})}
        return {"turns": [turn], "outcomes": []}

    same = [[[5, 2.0], [9, 1.9]], [[788, 1.2], [10345, 1.1]]]
    moved = [[[5, 2.0], [9, 1.9]], [[788, 1.2], [10345, 1.1000001]]]
    assert seed_broken(run([5, 788], same), run([5, 10345], same), 1, 1)
    assert not seed_broken(run([5, 788], same), run([5, 10345], moved), 1, 1)
    assert not seed_broken(run([5, 788], same, draws=False), run([5, 10345], same, draws=False), 1, 1)
