"""The reference arm's floor is calibrated, and says what it bounds (issue #60, item 11).

A correct release of a hybrid model (attention and state-space layers) decodes by a recurrence while a one-pass read
runs a chunked scan: every emitted token is the reference's own pick and every top-2 gap is off by a few hundredths of
a nat. The floor is read from the decode path the arms run (the engine's own model stepping through calibration answers
on a fresh cache), and gaps alone void a verdict only where more of an arm's positions exceed it than exchangeable
noise gives with probability ``reference.ALPHA``. The inputs ``reference.read`` consumes are built here with numpy:
engines that read from tables, no model. The simulations are seeded and run in about a second.
"""

from __future__ import annotations

import itertools
import math
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
from tiny_models import tiny_hybrid  # noqa: F401  (fixture)

from gatekeeper.engines.base import Referenced
from gatekeeper.gate.arms import reference
from gatekeeper.gate.arms.probes import PREFIX

VOCAB = 64
EXAMPLE = 0.034  # the example's gap difference (on a 0.204 nat margin), every emitted token the reference's pick


class Tables:
    """An engine whose reads come from tables: ``R`` the reference's one-pass rows per sequence, ``decode`` the rows
    its decode path computes (what the arms emitted from, and what a fresh-cache decode of the same tokens gives)."""

    name = "tables"
    profile = SimpleNamespace(reference_model=None)

    def __init__(self, R: dict, decode: dict, own_noise: float = 1e-7, shared: bool = False):
        self.R, self.decode, self.own_noise, self.shared = R, decode, own_noise, shared

    def unreferenced(self):
        return None

    def reference_key(self):
        return "the tables" if self.shared else id(self)

    def reference(self, sequence, steps, asked, batch=1, own=False):
        rows = self.R[tuple(sequence)]
        if own:  # the engine's own one-pass read: the scan the reference runs, in another precision
            rows = rows + self.own_noise * np.cos(np.arange(rows.size)).reshape(rows.shape)
        return Referenced.of(rows, asked, "float32" if own else "float64", "tables")

    def stepped(self, sequence, steps, asked):
        return Referenced.of(self.decode[tuple(sequence)], asked, "float32", "tables")


def battery(seed: int, answers: int = 12, length: int = 15, size: float = EXAMPLE, flip_at: int | None = None,
            shift: float = 0.0):
    """``answers`` answers of ``length`` tokens, each a cache probe's one turn on both arms. The decode path's logits are
    the reference's plus a smooth difference (a random direction times a slow wave, its gap differences up to about
    ``size``; every top-1 margin of the reference at least 0.2, so no token moves). Planted, on the arms only (never in
    the fresh-cache decode): ``flip_at``, a position of every answer where the arm emits the reference's second
    choice, which the reference leads by 2 nats; ``shift``, a difference of that size on every step's logits."""
    rng = np.random.default_rng(seed)
    R: dict = {}
    decode: dict = {}
    probed = {}
    for a in range(answers):
        prompt = [int(t) for t in rng.integers(0, VOCAB, 10)]
        ref = rng.normal(0.0, 1.5, (length, VOCAB))
        for row in ref:  # a clear pick everywhere: top-1 at least 0.2 above top-2
            top, second = np.sort(row)[::-1][:2]
            row[int(np.argmax(row))] += max(0.0, 0.2 - (top - second))
        if flip_at is not None:  # the reference leads its second choice by 2 nats there
            first, second = np.argsort(-ref[flip_at])[:2]
            ref[flip_at, first] = ref[flip_at, second] + 2.0
        direction = rng.normal(0.0, 1.0, VOCAB)
        wave = size / 1.5 * rng.uniform(0.5, 1.0) * (1 + np.sin(np.arange(length) / 3 + rng.uniform(0, 6))) / 2
        clean = ref + wave[:, None] * direction[None, :]
        arm = clean.copy()
        if shift:
            arm += shift * rng.normal(0.0, 1.0, arm.shape)
            for row, r in zip(arm, ref):  # the defect moves gaps, not picks
                row[int(np.argmax(r))] = row.max() + 0.2
        if flip_at is not None:  # and the arm emits that second choice
            arm[flip_at, second] = arm[flip_at].max() + 0.5
        rows = arm - np.log(np.exp(arm).sum(-1, keepdims=True))  # what the arm reports: log-probabilities
        tokens = [int(np.argmax(row)) for row in rows]
        top2 = [[[int(i), float(row[i])] for i in np.argsort(-row, kind="stable")[:2]] for row in rows]
        sequence = prompt + tokens
        R[tuple(sequence)], decode[tuple(sequence)] = ref, clean
        probed[f"{PREFIX}block{a}"] = ({"turns": [{"tokens": tokens, "top2": top2, "text": ""}]}, [sequence])
    return R, decode, probed


def read(R, decode, probed, shared: bool = False):
    """``reference.read`` over the probes alone (no cases), both arms with the same answers on engines of their own
    (``shared``: engines that read with the same weights)."""
    config = SimpleNamespace(profile=SimpleNamespace(reference_model=None))
    plan = SimpleNamespace(items=[], configs={"off": config, "on": config})
    runs = {name: [SimpleNamespace(results={pid: result for pid, (result, _) in probed.items()},
                                   read={pid: seqs for pid, (_, seqs) in probed.items()}, decoding=None)]
            for name in ("off", "on")}
    models = {name: Tables(R, decode, shared=shared) for name in ("off", "on")}
    found = reference.read(plan, models, {"off": [], "on": []}, lambda _: None, runs)  # type: ignore[arg-type]
    assert isinstance(found, reference.Read)
    return found


def verdict(found):
    from gatekeeper.gate.arms import independent

    said = reference.judge(found, "the shared cache path", str).on("PASS", ["equal: all answers identical"])
    return independent.judge(found.second, str).on(*said)


# --- the example: a smooth decode-vs-scan difference on every position ---------------------------------------------


def test_a_smooth_decode_difference_with_every_pick_the_references_is_no_base_defect():
    found = read(*battery(seed=1))
    off = found.arms["off"]
    assert off.positions == 12 * 15 and off.flips == 0  # every emitted token is the reference's pick
    assert 0.01 < off.max_gap < 0.06  # the example's size of difference, on every answer
    said, reasons = verdict(found)
    assert said == "PASS" and not any(x.startswith("base_defect") for x in reasons), reasons
    assert not found.departs("off") and not found.departs("on")
    # the record says where the floor came from: which reads, how many positions, which order statistic, the rate
    c = found.calibration
    assert c["source"].startswith("the engine's own model stepping through"), c
    assert c["reads"] >= reference.CONTROLS and c["positions"] == 15 * c["reads"] and c["order"] == reference.ORDER
    assert c["alpha"] == reference.ALPHA and found.floor["calibration"] == c["floor"] > 0.001
    assert found.tolerance["gap"] == reference.GAP * max(found.floor.values())
    assert any(x.startswith("reference: both arms agree") and "calibrat" in x for x in reasons), reasons


def test_an_answer_both_arms_gave_on_the_same_weights_is_read_once_and_judged_alike():
    """Two engines whose reference reads the same weights (``Engine.reference_key``): each answer is read once, for
    both arms, and what R says of each arm is what two reads of their own say."""
    apart, once = read(*battery(seed=1)), read(*battery(seed=1), shared=True)
    assert apart.reads == 2 * 12 and once.reads == 12
    assert once.arms == apart.arms and once.floor == apart.floor and once.calibration == apart.calibration


def test_a_torch_engines_reference_is_keyed_by_its_weights_not_its_dtype_or_cache(tiny_llama, tmp_path):
    from gatekeeper.engines.torch import TorchEngine
    from gatekeeper.workspace import EngineProfile

    def key(model=tiny_llama, **extra):
        return TorchEngine(EngineProfile(name="t", adapter="torch", model=str(model), device="cpu", **extra)).reference_key()

    other = tmp_path / "other"
    shutil.copytree(tiny_llama, other)
    assert key(dtype="float32") == key(dtype="bfloat16", prefill="aligned") != key(other, dtype="float32")


def test_the_calibration_answers_are_not_judged_by_their_gaps():
    found = read(*battery(seed=2))
    c = found.calibration
    for arm in found.arms.values():
        assert arm.controls == c["positions"] and arm.judged == arm.positions - arm.controls
        assert arm.needed is not None and arm.exceeded < arm.needed and arm.p > reference.ALPHA


# --- a real departure still departs ----------------------------------------------------------------------------------


def test_a_token_the_reference_would_not_pick_by_far_more_than_the_floor_still_departs():
    found = read(*battery(seed=3, flip_at=7))
    for arm in found.arms.values():
        assert arm.flipped == 12 and arm.departed >= 12, arm  # one clear flip in every answer
        first = arm.departures[0]
        assert first.position == 7 and first.emitted != first.reference and first.margin > found.tolerance["flip_margin"]
    said, reasons = verdict(found)
    assert said == "INCONCLUSIVE" and reasons[0].startswith("base_defect: both arms depart"), reasons
    assert "the reference picks" in reasons[0]


def test_a_gap_defect_the_fresh_cache_does_not_share_departs_by_its_count():
    """Every step's logits moved by about a nat, no pick changed (as a cache that forgets a slot moves them):
    the gaps alone depart, because nearly every judged position exceeds a floor the fresh-cache decode set."""
    found = read(*battery(seed=4, shift=1.0))
    for arm in found.arms.values():
        assert arm.flips == 0 and arm.exceeded >= arm.needed and arm.p <= reference.ALPHA, arm
        assert arm.departed == arm.exceeded and arm.departures
    said, reasons = verdict(found)
    assert said == "INCONCLUSIVE" and reasons[0].startswith("base_defect: both arms depart"), reasons


# --- the test the floor feeds: its law, its size and its power -------------------------------------------------------


def test_the_count_above_an_order_statistic_has_the_law_of_exchangeable_ranks():
    """P(X >= x), X the judged values above the k-th largest of n calibration values, against every arrangement."""
    for n, m, k in [(3, 4, 1), (4, 3, 2), (5, 5, 3), (2, 6, 2)]:
        counts = [0] * (m + 1)
        for judged in itertools.combinations(range(n + m), m):  # ranks of the judged values, 0 the largest
            calibration = sorted(set(range(n + m)) - set(judged))
            counts[sum(r < calibration[k - 1] for r in judged)] += 1
        total = math.comb(n + m, m)
        for x in range(m + 2):
            assert reference.tail(n, m, k, x) == pytest.approx(sum(counts[x:]) / total, abs=1e-12)
    assert reference.needed(24, 48, 2, 0.01) == 15 and reference.needed(4, 4, 1, 0.001) is None


def simulate(trials: int, n: int, m: int, seed: int, depart: float = 0.0, share: float = 0.0) -> float:
    """The share of ``trials`` in which an arm of ``m`` judged positions departs by its gaps, judged against a floor
    set by ``n`` calibration positions, every value |N(0, 1)| noise (exchangeable); ``share`` of the judged positions
    moved by ``depart`` times that noise's scale (a departure)."""
    rng = np.random.default_rng(seed)
    departed = 0
    for _ in range(trials):
        calibration, judged = np.abs(rng.normal(size=n)), np.abs(rng.normal(size=m))
        judged[: int(share * m)] += depart
        floor, k = reference.order_statistic(calibration.tolist())
        test = reference.gap_test(judged.tolist(), reference.GAP * floor, n, k)
        departed += test.p <= reference.ALPHA
    return departed / trials


def test_the_gap_test_holds_its_false_alarm_rate_under_exchangeable_noise():
    """At the floor itself (no allowance), the law is exact: the rate is at most ALPHA; with the allowance the rule
    applies (gaps counted above GAP times the floor), it can only be lower."""
    rng = np.random.default_rng(11)
    n, m, trials = 24, 48, 20000
    at_floor = 0
    for _ in range(trials):
        calibration, judged = np.abs(rng.normal(size=n)), np.abs(rng.normal(size=m))
        floor, k = reference.order_statistic(calibration.tolist())
        at_floor += reference.gap_test(judged.tolist(), floor, n, k).p <= reference.ALPHA
    size = reference.tail(n, m, reference.ORDER, reference.needed(n, m, reference.ORDER, reference.ALPHA))
    assert size <= reference.ALPHA
    assert at_floor / trials <= reference.ALPHA + 3 * math.sqrt(reference.ALPHA / trials), at_floor / trials
    assert simulate(2000, n, m, seed=12) == 0.0


def test_the_gap_test_has_power_at_a_stated_departure():
    """Stated in docs/workflow.md: with n = 24 calibration and m = 48 judged positions (two answers of the tiny suite
    against four), a third of the judged positions moved by 50 times the noise's scale (the floor, the second largest
    of 24, sits near 2 of it; GAP times it near 20) departs with power at least 0.99; two positions never do (fewer
    than the count the test needs): gaps at a handful of positions are drift, which the comparison grades."""
    assert simulate(400, 24, 48, seed=13, depart=50.0, share=1 / 3) >= 0.99
    assert simulate(400, 24, 48, seed=14, depart=50.0, share=1 / 24) == 0.0


# --- the read the floor is calibrated on, on a real hybrid through transformers ---------------------------------------


@pytest.mark.slow
def test_a_hybrid_engine_steps_through_an_answer_as_its_decode_did(tiny_hybrid, tiny_llama):
    """The tiny Gated DeltaNet hybrid: ``Engine.stepped`` (its own model on a fresh cache, one token at a time) gives the
    top-2 its cold decode gave, bit for bit, where the one-pass reads run the chunked scan; a model of attention layers
    alone has no such read (its own one-pass read calibrates it)."""
    from gatekeeper.engines.registry import build_engine
    from gatekeeper.workspace import EngineProfile

    hybrid, llama = (build_engine(EngineProfile(adapter="torch", model=str(m), dtype="float32", device="cpu",
                                                prefill="monolithic")) for m in (tiny_hybrid, tiny_llama))
    try:
        prompt = hybrid.tokenize(hybrid.render([{"role": "user", "content": "Book the cheapest flight to Porto."}]))
        with hybrid.session() as s:
            g = s.generate(prompt, max_tokens=12, top2=True)
        sequence, asked = prompt + list(g.tokens), [[t[0][0], t[1][0]] for t in g.top2]
        stepped = hybrid.stepped(sequence, len(g.tokens), asked)
        assert stepped is not None and stepped.dtype == "float32"
        gap = lambda t: t[0][1] - t[1][1]  # noqa: E731  (the arm gives logits, a read log-probabilities: gaps agree)
        assert [[i for i, _ in t] for t in stepped.top2] == [[i for i, _ in t] for t in g.top2]
        assert [gap(t) for t in stepped.top2] == pytest.approx([gap(t) for t in g.top2], abs=1e-6)
        own = hybrid.reference(sequence, len(g.tokens), asked, own=True)  # the scan: not the decode's arithmetic
        assert [t[0][0] for t in own.top2] == [t[0][0] for t in g.top2]
        assert llama.stepped(sequence, 3, asked[-3:]) is None
    finally:
        hybrid.close()
        llama.close()
