"""gatekeeper.gate.stats.paired: Tango's score interval, the design effect, and the verdicts they decide.

The simulations are seeded (random.Random) and sized to run in about a second each.
"""

from __future__ import annotations

import json
import math
import random
from statistics import NormalDist

import pytest

from gatekeeper.gate.stats import paired
from gatekeeper.gate.stats.paired import by_suite, cases_needed, decide, equivalence, supported_margin, tango_bounds

Z95 = NormalDist().inv_cdf(0.95)


def counted(b: int, c: int, n: int, size: int = 1) -> list[paired.Pair]:
    """n pairs with b harmful and c beneficial flips, ``size`` consecutive pairs to a cluster."""
    outcomes = [(True, False)] * b + [(False, True)] * c + [(True, True)] * (n - b - c)
    return [(f"case{i // size}", off, on) for i, (off, on) in enumerate(outcomes)]


def iid_pairs(rng: random.Random, n: int, p10: float, p01: float) -> list[paired.Pair]:
    """n independent pairs: harmful with probability p10, beneficial with p01."""
    b = c = 0
    for _ in range(n):
        u = rng.random()
        if u < p10:
            b += 1
        elif u < p10 + p01:
            c += 1
    return counted(b, c, n)


def clustered_pairs(rng: random.Random, clusters: int, size: int, p10: float, p01: float) -> list[paired.Pair]:
    """Clusters of ``size`` perfectly correlated pairs: a flip flips every assertion of its case."""
    out: list[paired.Pair] = []
    for k in range(clusters):
        u = rng.random()
        off, on = (True, False) if u < p10 else (False, True) if u < p10 + p01 else (True, True)
        out += [(f"case{k}", off, on)] * size
    return out


def pass_rate(draw, runs: int, margin: float, alpha: float = 0.05) -> float:
    return sum(decide(draw(), margin, alpha).verdict == "pass" for _ in range(runs)) / runs


# --- Tango's interval against published values -----------------------------------------------------------


def test_tango_matches_fagerland_2014_bentur_example():
    # Fagerland, Lydersen & Laake (2014), "Recommended tests and confidence intervals for paired binomial
    # proportions", Stat Med 33:2850, Table II data (Bentur et al. 2009: n11 1, n12 1, n21 7, n22 12) and
    # Table V, Tango asymptotic score interval: (-0.517, -0.026). (Quoted in ratesci's V_PAIRBINCI.SAS validation.)
    lower, upper = tango_bounds(1, 7, 21, alpha=0.025)  # two-sided 95% = two one-sided 97.5% bounds
    assert round(lower, 3) == -0.517
    assert round(upper, 3) == -0.026


def test_tango_matches_fagerland_book_cavo_example():
    # Fagerland, Lydersen & Laake, "Statistical Analysis of Contingency Tables" (2017), chapter 8, Cavo et al. 2012
    # (n11 59, n12 6, n21 16, n22 80): Tango asymptotic score CI, estimate -0.0621, 95% CI -0.1240 to -0.0054,
    # as the book's R package contingencytables asserts in tests/testthat/test-ch8.R.
    lower, upper = tango_bounds(6, 16, 161, alpha=0.025)
    assert (6 - 16) / 161 == pytest.approx(-0.0621, abs=5e-5)
    assert lower == pytest.approx(-0.1240, abs=5e-5)
    assert upper == pytest.approx(-0.0054, abs=5e-5)


def test_tango_bounds_are_ordered_and_monotone():
    for b, c, n in [(0, 0, 5), (3, 0, 10), (0, 4, 10), (5, 5, 40), (10, 0, 10), (0, 10, 10)]:
        lower, upper = tango_bounds(b, c, n)
        assert -1.0 <= lower <= (b - c) / n <= upper <= 1.0
    # a harmful flip more moves both bounds up
    assert tango_bounds(3, 1, 50) < tango_bounds(4, 1, 50)


# --- zero discordance -------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [4, 8, 20, 64, 500])
def test_zero_discordance_upper_bound_is_z2_over_n_plus_z2(n):
    lower, upper = tango_bounds(0, 0, n, alpha=0.05)
    assert upper > 0
    assert upper == pytest.approx(Z95**2 / (n + Z95**2), abs=1e-9)
    assert lower == pytest.approx(-upper, abs=1e-9)


def test_no_pass_at_20_clean_cases_and_margin_005():
    v = decide(counted(0, 0, 20), margin=0.05)
    assert v.verdict == "underpowered"
    assert v.upper == pytest.approx(0.119, abs=5e-4)
    # z^2 (1 - m) / m = 51.4: 52 clean pairs are the first whose bound z^2 / (n + z^2) is <= 0.05
    assert v.needed == 52
    assert tango_bounds(0, 0, 51)[1] > 0.05 >= tango_bounds(0, 0, 52)[1]
    assert v.supported_margin == pytest.approx(v.upper, abs=1e-6)
    assert v.reason().startswith("underpowered: upper bound 0.119 > margin 0.05 with 20 assertion pairs")
    assert "needs 52" in v.reason() and "add cases or widen the margin" in v.reason()
    assert decide(counted(0, 0, 52), margin=0.05).verdict == "pass"


def test_pass_and_fail_reasons_and_to_dict():
    v = decide(counted(0, 0, 64), margin=0.05)  # one pair per case: iid
    assert v.verdict == "pass" and v.deff == 1.0
    assert v.reason() == (
        "non_inferior: loss 0.000 (0 harmful, 0 beneficial flips of 64 assertions in 64 cases); "
        "one-sided 95% upper bound 0.041 <= margin 0.05 (Tango score interval)"
    )
    d = json.loads(json.dumps(v.to_dict()))
    assert d["verdict"] == "pass" and d["reason"] == v.reason() and d["method"] == "Tango score interval, one-sided alpha 0.05"
    bad = decide(counted(30, 2, 200), margin=0.05)
    assert bad.verdict == "fail" and bad.lower > 0.05
    assert bad.reason().startswith("inferior: loss 0.140 (30 harmful, 2 beneficial flips of 200 assertions in 200 cases)")


def test_margin_zero_needs_improvements():
    v = decide(counted(1, 1, 100), margin=0.0)
    assert v.verdict == "underpowered" and math.isinf(v.needed)
    assert "margin 0 needs improvements to pass" in v.reason()
    assert v.to_dict()["needed"] is None
    assert decide(counted(0, 12, 100), margin=0.0).verdict == "pass"  # beneficial flips outweigh: upper < 0


# --- sample size ------------------------------------------------------------------------------------------


def test_cases_needed_and_supported_margin():
    # the Wald-variance formula gives 464 at psi 0.03, margin 0.02; the score test needs its restricted variance
    simple = (Z95 + NormalDist().inv_cdf(0.8)) ** 2 * 0.03 / 0.02**2
    assert math.ceil(simple) == 464
    assert 540 <= cases_needed(0.03, 0.02) <= 570
    assert cases_needed(0.0, 0.05) == math.ceil(Z95**2 * 0.95 / 0.05)  # the zero-discordance minimum
    assert cases_needed(0.001, 0.05) >= cases_needed(0.0, 0.05)
    assert math.isinf(cases_needed(0.1, 0.05, loss=0.05)) and math.isinf(cases_needed(0.1, 0.05, loss=0.08))
    assert cases_needed(0.1, 0.05, loss=0.02) > cases_needed(0.1, 0.05)
    n = cases_needed(0.03, 0.02)
    assert supported_margin(n, 0.03) == pytest.approx(0.02, abs=2e-4)
    assert supported_margin(20, 0.0) == pytest.approx(Z95**2 / (20 + Z95**2))


# --- simulations ------------------------------------------------------------------------------------------


def test_sim_true_loss_above_margin_rarely_passes():
    runs, alpha = 3000, 0.05
    tol = alpha + 3 * math.sqrt(alpha * (1 - alpha) / runs)
    rng = random.Random(11)
    # a true loss of 0.08 against margin 0.05 (9% harmful, 1% beneficial flips)
    assert pass_rate(lambda: iid_pairs(rng, 200, 0.09, 0.01), runs, 0.05) <= tol
    # and at the boundary, a true loss equal to the margin: the size of the test
    assert pass_rate(lambda: iid_pairs(rng, 200, 0.075, 0.025), runs, 0.05) <= tol


def test_sim_power_at_cases_needed():
    rng = random.Random(12)
    psi, margin, power = 0.1, 0.05, 0.8
    n = int(cases_needed(psi, margin, power=power))
    assert pass_rate(lambda: iid_pairs(rng, n, psi / 2, psi / 2), 2000, margin) == pytest.approx(power, abs=0.07)
    assert pass_rate(lambda: iid_pairs(rng, n // 2, psi / 2, psi / 2), 1000, margin) < power - 0.1


def test_sim_eight_cases_never_pass():
    rng = random.Random(13)
    for p10 in (0.0, 0.05, 0.2):
        assert pass_rate(lambda p10=p10: iid_pairs(rng, 8, p10, 0.0), 300, 0.05) == 0.0


def test_sim_clusters_need_the_design_effect():
    runs, alpha = 1500, 0.05
    tol = alpha + 3 * math.sqrt(alpha * (1 - alpha) / runs)
    rng = random.Random(14)
    # 80 cases of 5 perfectly correlated assertions, true loss 0.06 > margin 0.05
    samples = [paired._tally(clustered_pairs(rng, 80, 5, 0.06, 0.0)) for _ in range(runs)]
    honest = sum(paired._decide(t, 0.05, alpha, 0.8).verdict == "pass" for t in samples) / runs
    naive = sum(paired._decide(t, 0.05, alpha, 0.8, deff=1.0).verdict == "pass" for t in samples) / runs
    assert honest <= tol
    assert naive > tol  # treating the 200 assertions as independent passes a harmful change far too often


def test_design_effect_estimates():
    assert paired._design_effect(paired._tally(counted(3, 1, 50))) == 1.0  # one pair per case
    assert paired._design_effect(paired._tally(counted(0, 0, 100, size=5))) == pytest.approx(5.0)  # no flips: worst case
    assert paired._design_effect(paired._tally(counted(10, 0, 100, size=5))) > 4.0  # two whole cases flipped
    v = decide(counted(10, 0, 100, size=5), margin=0.05)
    assert v.clusters == 20 and "Rao-Scott design effect" in v.method and "over 20 clusters" in v.method


# --- equivalence and suites ---------------------------------------------------------------------------------


def test_equivalence():
    assert equivalence(counted(3, 3, 400), margin=0.05).verdict == "pass"
    assert "equivalent:" in equivalence(counted(3, 3, 400), margin=0.05).reason()
    assert equivalence(counted(2, 60, 400), margin=0.05).verdict == "fail"  # improves by far more than the margin
    assert equivalence(counted(3, 3, 40), margin=0.05).verdict == "underpowered"
    exact = equivalence(counted(0, 0, 10), margin=0.0)
    assert exact.verdict == "pass" and exact.reason().startswith("exact: margin 0 asks for identical outcomes")
    assert equivalence(counted(1, 1, 1000), margin=0.0).verdict == "fail"


def test_by_suite_bonferroni():
    clean = counted(0, 0, 60)  # upper 0.043 at alpha 0.05, 0.060 at 0.025
    assert decide(clean, 0.05).verdict == "pass"
    s = by_suite({"math": clean, "code": clean, "chat": clean}, {"math": 0.05, "code": 0.05})
    assert s.corrected_alpha == pytest.approx(0.025) and s.unjudged == ["chat"]
    assert s.verdict == "underpowered" and all(p.alpha == pytest.approx(0.025) for p in s.suites.values())
    assert by_suite({"math": clean}, {"math": 0.05}).verdict == "pass"
    s = by_suite({"math": counted(0, 0, 200), "code": counted(40, 0, 200)}, {"math": 0.05, "code": 0.05})
    assert s.verdict == "fail" and s.suites["math"].verdict == "pass"
    assert json.loads(json.dumps(s.to_dict()))["corrected_alpha"] == pytest.approx(0.025)
    assert by_suite({"math": clean}, {"math": 0.05, "code": 0.05}).suites["code"].verdict == "underpowered"
    empty = decide([], 0.05)
    assert empty.verdict == "underpowered" and empty.n == 0 and empty.upper == 1.0


def test_one_harmful_flip_never_turns_an_underpowered_battery_into_a_pass():
    """20 cases of 8 assertions: with no flips the cases are the observations (underpowered at margin 0.03); one
    harmful flip must not make the 160 assertions count as independent (a design effect estimated from one flip)."""
    clean = [(f"case{i}", True, True) for i in range(20) for _ in range(8)]
    one = [("case0", True, False)] + clean[1:]
    for pairs in (clean, one, one[:1] + [("case1", True, False)] + clean[2:]):
        result = paired.decide(pairs, 0.03)
        assert result.verdict == "underpowered" and result.deff > 7, result.reason()
