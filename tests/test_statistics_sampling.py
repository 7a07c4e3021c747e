"""Sampled evidence means what it says (issue #60, items 6 and 8).

- gatekeeper's own sampler (``engines/sampler.py``) gives each step a Philox stream of its own: the old scheme, keyed
  at counter (step, 0, 0, 0), made step s + 1's noise step s's shifted by one block (4 token ids), which a
  high-entropy toy shows as a huge excess of tokens 4 ids below the previous one; the new one shows none.
- The PIT check (``gate/stats/pit.py``) tests the independence of consecutive steps' transforms, not only their uniformity:
  its size under correct draws and its power against the old correlated sampler by seeded simulation, and a side
  drawn by the old sampler departs through it.
- The planted control (``gate/arms/controls.py``) is ``undecided`` where the doubled temperature could not change the
  processed distribution (a one-token nucleus at every step), ``seen`` where it does, and ``missed`` stays possible.

Every simulation is seeded and sized to run in a few seconds.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from gatekeeper.engines.sampler import Sampler, key, log_softmax, transform
from gatekeeper.gate.arms import controls
from gatekeeper.gate.stats import pit
from gatekeeper.workspace import Decoding

HOT = Decoding(temperature=1.0)


class OldSampler(Sampler):
    """The scheme before the fix: every step's noise read from counter (step, 0, 0, 0), one generator whose blocks
    (4 uint64 each) step s + 1 starts one block later than step s."""

    def noise(self, step, vocab):
        bits = np.random.Philox(key=np.array(self.key, dtype=np.uint64), counter=np.array([step, 0, 0, 0], dtype=np.uint64))
        u = np.random.Generator(bits).random(vocab)
        return -np.log(-np.log(np.maximum(u, 1e-300)))


def old_transform(lp, token, k, step):
    """The old scheme's transform: its uniform at counter (step, 1, 0, 0)."""
    before = (lp > lp[token]) | ((lp == lp[token]) & (np.arange(len(lp)) < token))
    bits = np.random.Philox(key=np.array(k, dtype=np.uint64), counter=np.array([step, 1, 0, 0], dtype=np.uint64))
    return float(np.exp(lp[before]).sum() + np.random.Generator(bits).random() * np.exp(lp[token]))


def answer(sampler_class, k, rows, old=False):
    """One sampled answer over the toy's logits ``rows`` (one per step, independent of the history): its tokens, the
    draws as an engine records them (raw, processed, likeliest processed, transform) and each step's processed row."""
    s, tokens, draws, lps = sampler_class(HOT, k), [], [], []
    for row in rows:
        token, weights, lp = s.pick(row, [], tokens)
        weights.append((old_transform if old else transform)(lp, token, k, len(tokens)))
        tokens.append(token)
        draws.append(weights)
        lps.append(lp)
    return tokens, draws, lps


def toy(rng, steps, vocab=256, scale=1.0):
    """A high-entropy toy: each step's logits standard normal times ``scale`` (about 5 nats over 256 tokens)."""
    return rng.normal(size=(steps, vocab)) * scale


# --- item 6: the sampler's steps are independent --------------------------------------------------------------------

def test_each_step_draws_from_a_stream_of_its_own():
    """The old scheme's consecutive noise vectors are one stream shifted by 4 token ids; the new ones share nothing,
    and the transform's uniform is none of the noise's."""
    k, vocab = key(0, "toy", 0, 0), 256
    old = OldSampler(HOT, k)
    assert np.array_equal(old.noise(1, vocab)[:-4], old.noise(0, vocab)[4:])  # the defect, reproduced
    new = Sampler(HOT, k)
    steps = [new.noise(s, vocab) for s in range(8)]
    assert len(np.unique(np.concatenate(steps))) == 8 * vocab
    lp = np.full(vocab, -math.log(vocab))
    # the transform's uniform v = (u - F(before)) / p(token), at token 0 with nothing before it: v = u * vocab
    vs = [transform(lp, 0, k, s) * vocab for s in range(8)]
    noise_uniforms = np.exp(-np.exp(-np.concatenate(steps)))  # the uniforms the noise came from
    assert not np.isin(np.round(vs, 12), np.round(noise_uniforms, 12)).any()


def test_the_old_scheme_draws_the_token_4_ids_below_the_last_far_too_often_and_the_new_one_does_not():
    """9,600 steps (96 answers of 100) in the high-entropy toy: the count of steps whose token is 4 ids below the
    previous one, against its expectation under independent draws (the sum of each step's processed probability
    of that token)."""
    rng = np.random.default_rng(6)
    rows = [toy(rng, 100) for _ in range(96)]
    counts = {}
    for name, cls in (("old", OldSampler), ("new", Sampler)):
        hits, expected = 0, 0.0
        for a, r in enumerate(rows):
            tokens, _, lps = answer(cls, key(0, "toy", a, 0), r)
            for s in range(1, len(tokens)):
                below = tokens[s - 1] - 4
                expected += float(np.exp(lps[s][below])) if below >= 0 else 0.0
                hits += tokens[s] == below
        counts[name] = (hits, expected)
    hits, expected = counts["old"]
    assert hits > 10 * expected, counts  # measured: 3,984 against 36
    hits, expected = counts["new"]
    assert abs(hits - expected) < 4 * math.sqrt(expected), counts


def _serial_p(answers) -> float:
    return pit.serial([[d[3] for d in draws] for draws in answers])[2]


@pytest.mark.parametrize("sides,answers,steps", [(400, 10, 12), (200, 3, 6)])
def test_the_serial_test_holds_its_size_under_correct_draws(sides, answers, steps):
    """Simulated sides drawn by the sampler with fresh keys, of 110 consecutive pairs (the p-value read from the normal
    distribution) and of 15 (read from simulated chains): the share whose serial test rejects at alpha is at most
    alpha (plus three binomial standard errors), at the policy's 0.05 and at the 0.0125 each side's test runs at;
    and the p-values are uniform."""
    rng = np.random.default_rng(7)
    ps = []
    for trial in range(sides):
        answered = [answer(Sampler, key(trial, "size", a, 0), toy(rng, steps, vocab=64))[1] for a in range(answers)]
        ps.append(_serial_p(answered))
    for alpha in (0.05, 0.0125):
        rate = sum(p < alpha for p in ps) / len(ps)
        assert rate <= alpha + 3 * math.sqrt(alpha * (1 - alpha) / len(ps)), (alpha, rate)
    assert pit.ks_uniform(ps)[1] > 0.001  # measured: 0.017 and 0.60


def test_the_serial_test_catches_the_old_sampler():
    """30 simulated sides of 40 answers of 25 steps (960 pairs) drawn by the old scheme in the high-entropy toy: the
    serial test rejects at the 0.0125 a side's test runs at in nearly all of them (measured: every one, the largest
    p 0.0077)."""
    rng = np.random.default_rng(8)
    rejected = 0
    for trial in range(30):
        answers = [answer(OldSampler, key(trial, "power", a, 0), toy(rng, 25), old=True)[1] for a in range(40)]
        rejected += _serial_p(answers) < 0.0125
    assert rejected >= 27, rejected


def _side(answers):
    """``pit.read``'s inputs for one evaluation whose two sides drew ``answers`` (one sampled case per answer)."""
    items = [SimpleNamespace(case_id=f"toy/c{a}", suite=SimpleNamespace(decoding=HOT)) for a in range(len(answers))]
    run = {f"toy/c{a}": {"turns": [{"draws": draws}]} for a, draws in enumerate(answers)}
    return items, {"off": [run], "on": [run]}


def test_a_side_drawn_by_the_old_sampler_departs_through_the_independence_test():
    """The PIT check as the evaluator uses it (``read`` then ``judge``): the old sampler's side departs, named by its
    serial statistic; the new sampler's side passes, its serial statistic recorded beside the KS one."""
    rng = np.random.default_rng(9)
    rows = [toy(rng, 25) for _ in range(40)]
    old = [answer(OldSampler, key(0, "wired", a, 0), r, old=True)[1] for a, r in enumerate(rows)]
    sides = pit.read(*_side(old))
    assert sides is not None and sides["off"].pairs == 40 * 24 and sides["off"].serial_p < 0.0125, sides
    assert sides["off"].p > 0.0125  # its transforms are uniform one by one: Kolmogorov-Smirnov alone passes it
    verdict, reasons = pit.judge(sides, 0.05).on("PASS", [])
    assert verdict == "INCONCLUSIVE" and reasons[0].startswith("base_defect:") and "consecutive" in reasons[0], reasons
    new = [answer(Sampler, key(0, "wired", a, 0), r)[1] for a, r in enumerate(rows)]
    sides = pit.read(*_side(new))
    assert sides is not None and pit.judge(sides, 0.05).on("PASS", []) == ("PASS", []), sides
    recorded = pit.to_dict(sides)["on"]
    assert {"steps", "statistic", "p", "pairs", "serial", "serial_p"} <= recorded.keys()


def test_an_impossible_draw_breaks_the_chain_of_pairs():
    """Pairs are consecutive steps of one turn, both transformed: a draw the declared decoding gives no chance, or
    one that carries no transform, is no member of a pair."""
    draws = [[0.0, 0.0, 0.0, 0.3], [0.0, 0.0, 0.0, -1.0], [0.0, 0.0, 0.0, 0.6], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.2],
             [0.0, 0.0, 0.0, 0.9]]
    sides = pit.read(*_side([draws]))
    assert sides is not None and sides["off"].pairs == 1 and sides["off"].impossible == 1


# --- item 8: the planted control on a confident case ----------------------------------------------------------------

def generate(decoding: Decoding, k, rows) -> dict:
    """A turn as an engine records it: tokens and draws (raw, processed, likeliest processed, transform)."""
    s, tokens, draws = Sampler(decoding, k), [], []
    for row in rows:
        token, weights, lp = s.pick(row, [], tokens)
        weights.append(transform(lp, token, k, len(tokens)))
        tokens.append(token)
        draws.append(weights)
    return {"tokens": tokens, "draws": draws}


def judge(rows, decoding: Decoding, planted: Decoding | None = None):
    """The controls of one case whose flag-off answer and control draws ran over ``rows``; ``planted``: the decoding
    the planted draw actually followed (an engine that ignores the temperature follows the declared one)."""
    k = key(0, "suite/case", 0, 0)
    hotter = decoding.model_copy(update={"temperature": 2 * decoding.temperature})
    drawn = {"case": "suite/case", "unpaired": generate(decoding, key(1, "fresh", 0, 0), rows),
             "planted": generate(planted or hotter, k, rows)}
    return controls.judge(drawn, {"suite/case": {"turns": [generate(decoding, k, rows)]}}, 0.05)


def confident(steps=8, vocab=32):
    """Rows whose likeliest token holds all but 3e-4 at temperature 0.7 and about 0.9 at 1.4: above top-p 0.8."""
    rows = np.zeros((steps, vocab))
    rows[np.arange(steps), np.arange(steps) % vocab] = 8.0
    return rows


DECLARED = Decoding(temperature=0.7, top_p=0.8)


def test_a_confident_case_leaves_the_planted_control_undecided():
    """One token in the nucleus at every step, at both temperatures: the doubled temperature cannot change what is
    drawn or how it is weighed, so the control had no chance to show and says so (it said ``missed``, turning a good
    run INCONCLUSIVE)."""
    rows = confident()
    hotter = DECLARED.model_copy(update={"temperature": 1.4})
    assert all(np.count_nonzero(np.isfinite(Sampler(d, (0, 0)).processed(r, [], []))) == 1
               for r in rows for d in (DECLARED, hotter))
    c = judge(rows, DECLARED)
    assert c is not None and (c.unpaired, c.planted) == ("undecided", "undecided"), c
    verdict, reasons = c.judge().on("PASS", [])
    assert verdict == "PASS" and reasons[-1].startswith("controls:"), reasons


def test_the_planted_control_is_seen_where_the_temperature_matters_and_missed_where_an_engine_ignores_it():
    rng = np.random.default_rng(10)
    rows = np.vstack([confident(4), rng.normal(size=(8, 32))])  # confident steps, then ones a temperature moves
    c = judge(rows, DECLARED)
    assert c is not None and c.planted == "seen", c
    # an engine that ignores the temperature draws and weighs the planted draw as the declared one: missed
    c = judge(rows, DECLARED, planted=DECLARED)
    assert c is not None and c.planted == "missed", c
    assert c.judge().on("PASS", [])[0] == "INCONCLUSIVE"
    # and on a confident case the same engine had no chance to show it
    c = judge(confident(), DECLARED, planted=DECLARED)
    assert c is not None and c.planted == "undecided", c


def test_a_confident_flag_off_answer_and_a_hotter_one_that_weighs_otherwise_is_seen():
    """A nucleus of one token at the declared temperature and of several at the doubled one: the planted draw
    weighs its token otherwise (or parts), so the control shows."""
    rows = np.zeros((6, 32))
    rows[:, 0] = 5.5  # declared (0.7): token 0 holds about 0.99; doubled (1.4), about 0.62
    c = judge(rows, Decoding(temperature=0.7, top_p=0.9))
    assert c is not None and c.planted == "seen", c


def test_log_softmax_of_one_kept_token_is_exactly_zero():
    """What makes a one-token nucleus readable from the record: its processed log-probability is 0.0 exactly."""
    x = np.full(5, -np.inf)
    x[2] = 3.7
    assert log_softmax(x)[2] == 0.0
