"""The sampler (``engines/sampler.py``) and what its coupled draws certify (``gate/stats/coupling.py``), checked against
distributions known in closed form: the draws follow the processed probabilities, each stage of the chain does what
it declares, a draw depends on its key and step alone, and the coupling bound's false PASS rate is at most alpha."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gatekeeper.engines.sampler import Draw, Sampler, key
from gatekeeper.gate.stats.coupling import upper, upper_anytime
from gatekeeper.workspace import Decoding


def probs(d: Decoding, logits, prompt=(), answer=()) -> np.ndarray:
    return np.exp(Sampler(d, (0, 0)).processed(np.asarray(logits, dtype=np.float32), list(prompt), list(answer)))


def test_draws_follow_the_processed_distribution():
    """Chi-square over 4,000 keyed draws against the processed probabilities (a fixed seed: the statistic is known)."""
    logits = np.random.default_rng(1).normal(size=50).astype(np.float32) * 2
    d = Decoding(temperature=0.8, top_p=0.9)
    p = probs(d, logits)
    counts = np.bincount([Draw(d, key(0, "c", s, 0)).sampler().pick(logits, [], [])[0] for s in range(4000)], minlength=50)
    assert counts[p == 0].sum() == 0  # nothing outside the top-p set
    kept = p > 0
    chi2 = float((((counts - 4000 * p) ** 2)[kept] / (4000 * p[kept])).sum())
    assert chi2 < 2 * kept.sum() + 30, (chi2, kept.sum())  # about its degrees of freedom when the draws are right


def test_each_stage_of_the_chain():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    assert np.allclose(probs(Decoding(temperature=1.0), logits), [0.5, 0.3, 0.15, 0.05])
    hot = probs(Decoding(temperature=2.0), logits)
    assert np.allclose(hot, np.sqrt([0.5, 0.3, 0.15, 0.05]) / np.sqrt([0.5, 0.3, 0.15, 0.05]).sum())
    assert np.count_nonzero(probs(Decoding(temperature=1.0, top_k=2), logits)) == 2
    assert np.allclose(probs(Decoding(temperature=1.0, top_p=0.8), logits), [0.625, 0.375, 0, 0])  # 0.5 + 0.3 holds 0.8
    assert np.count_nonzero(probs(Decoding(temperature=1.0, min_p=0.35), logits)) == 2  # at least 0.35 * 0.5
    # a repetition penalty divides a positive logit and multiplies a negative one, for every token seen
    raw = np.array([2.0, -1.0, 0.5, 0.0])
    pen = Sampler(Decoding(temperature=1.0, repetition_penalty=2.0), (0, 0)).processed(raw, [0, 1], [])
    assert np.allclose(pen, Sampler(Decoding(temperature=1.0), (0, 0)).processed(np.array([1.0, -2.0, 0.5, 0.0]), [], []))
    # presence and frequency count the answer only
    base = Decoding(temperature=1.0, presence_penalty=1.0, frequency_penalty=0.5)
    assert np.allclose(probs(base, raw, prompt=[2]), probs(Decoding(temperature=1.0), raw))
    assert np.allclose(probs(base, raw, answer=[2, 2]), probs(Decoding(temperature=1.0), raw - [0, 0, 2.0, 0]))
    # greedy with a penalty takes the likeliest penalised token
    assert Sampler(Decoding(repetition_penalty=5.0), (0, 0)).pick(raw, [0], [])[0] == 2


def test_a_draw_depends_on_its_key_and_step_alone():
    logits = np.zeros(1000, dtype=np.float32)
    d = Decoding(temperature=1.0)
    a, b = Sampler(d, key(7, "s/c", 1, 0)), Sampler(d, key(7, "s/c", 1, 0))
    first = [a.pick(logits, [], [0] * n)[0] for n in range(20)]
    assert first == [b.pick(logits, [], [0] * n)[0] for n in reversed(range(20))][::-1]  # any call order
    assert first != [Sampler(d, key(7, "s/c", 2, 0)).pick(logits, [], [0] * n)[0] for n in range(20)]
    assert len(set(first)) > 15  # uniform over 1,000 tokens: 20 steps rarely repeat


@pytest.mark.parametrize("tv", [0.0, 0.01, 0.05])
def test_the_coupling_bound_covers_the_true_distance_at_least_one_minus_alpha_of_the_time(tv):
    """Two next-token distributions at a known total-variation distance, coupled by the same keyed noise: over 200
    simulated evaluations of 300 coupled steps, the share whose bound falls below the true distance is at most alpha
    (plus the binomial slack of 200 trials)."""
    rng = np.random.default_rng(3)
    p = rng.dirichlet(np.ones(30))
    q = p.copy()
    moved = min(tv, p[0])  # move tv of mass from token 0 to token 1
    q[0] -= moved
    q[1] += moved
    assert math.isclose(0.5 * np.abs(p - q).sum(), moved)
    d = Decoding(temperature=1.0)
    below, alpha = 0, 0.05
    for trial in range(200):
        mismatches = 0
        for step in range(300):
            s = Sampler(d, key(trial, "sim", 0, 0))
            g = s.noise(step, 30)
            mismatches += int(np.argmax(np.log(p) + g) != np.argmax(np.log(np.maximum(q, 1e-300)) + g))
        below += upper(mismatches, 300, alpha) < moved
    assert below / 200 <= alpha + 3 * math.sqrt(alpha * (1 - alpha) / 200), below


def test_the_clopper_pearson_bound():
    assert upper(0, 0, 0.05) == 1.0 and upper(5, 5, 0.05) == 1.0
    assert math.isclose(upper(0, 100, 0.05), 1 - 0.05 ** (1 / 100))
    # k = 1 of 20 at 95%: the rate p at which P(Binomial(20, p) <= 1) = 0.05 (a published table gives 0.2161)
    assert abs(upper(1, 20, 0.05) - 0.2161) < 1e-3


def test_the_confidence_sequence_holds_at_every_stop_where_clopper_pearson_read_at_every_stop_does_not():
    """A sequential run looks after every step and may stop at the first look whose bound certifies: the false
    certification rate is the chance the bound EVER falls below the true mismatch rate. Simulated at rate 0.02 over
    2,000 steps, read at every step: Clopper-Pearson's fixed-n bound does so far more often than alpha, the
    confidence sequence (``upper_anytime``) at most alpha (plus the slack of 150 trials)."""
    rng = np.random.default_rng(5)
    rate, alpha, trials, steps = 0.02, 0.05, 150, 2000
    ever = {"fixed": 0, "anytime": 0}
    looks = np.unique(np.geomspace(10, steps, 40).astype(int))
    for _ in range(trials):
        k = np.cumsum(rng.random(steps) < rate)
        ever["fixed"] += any(upper(int(k[n - 1]), int(n), alpha) < rate for n in looks)
        ever["anytime"] += any(upper_anytime(int(k[n - 1]), int(n), alpha) < rate for n in looks)
    slack = 3 * math.sqrt(alpha * (1 - alpha) / trials)
    assert ever["anytime"] / trials <= alpha + slack, ever
    assert ever["fixed"] / trials > alpha + slack, ever  # why a sequential run needs the sequence
    # the sequence is wider than the fixed-n bound, and tightens as steps come in
    assert upper_anytime(0, 100, alpha) > upper(0, 100, alpha)
    assert math.isclose(upper_anytime(0, 100, alpha), 1 - (alpha / 101) ** (1 / 100), rel_tol=1e-9)
    assert upper_anytime(0, 1000, alpha) < upper_anytime(0, 100, alpha)
