"""The coupled total-variation bound says what it bounds (issue #60, item 5).

The coupled walk (``gate/stats/coupling.py``) stops at an answer's first mismatch, so a bound on all compared steps pooled
is a bound on their average, weighted toward early positions: a defect late in answers or in one stage hides in it.
The bound a verdict uses is therefore per position class (thirds of the flag-off answers' positions) and per stage,
each a Clopper-Pearson bound at alpha/m (Bonferroni over the m classes), and ``tv_bound`` is the largest of them; the
pooled figure stays as ``tv_mean_bound``.

The records are synthetic, in the shape ``couple`` reads (per case, turns holding ``tokens``), drawn under a maximal
coupling: at a step whose two next-token distributions are ``tv`` apart the sides draw apart with chance exactly
``tv`` (Gumbel-max draws part at least that often, so a bound that holds here holds for them). The simulations are
seeded (numpy) and sized to run in seconds.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np
import pytest

from gatekeeper.battery.suites import Item
from gatekeeper.gate.stats import coupling
from gatekeeper.workspace import Case, Decoding, Segment, Suite

MAX_TV = 0.1
ALPHA = 0.05


def battery(stages: dict[str, int], samples: int = 1, max_tokens: int = 64) -> list[Item]:
    """Sampled items: per stage (one suite each) its number of cases, each drawn ``samples`` times."""
    items = []
    for stage, cases in stages.items():
        suite = Suite(suite=stage, stage=stage, prompt=[Segment(role="user", static=True, text="Answer.")],
                      decoding=Decoding(max_tokens=max_tokens, temperature=1.0, samples=samples),
                      cases=[Case(id=f"c{i}") for i in range(cases)])
        items += [Item(suite, case, k) for case in suite.cases for k in range(samples)]
    return items


def records(items: list[Item], tv: Callable[[Item, int], float], length: int,
            rng: np.random.Generator) -> tuple[dict[str, Any], dict[str, Any]]:
    """Each item's flag-off and flag-on answer of ``length`` tokens, drawn under a maximal coupling: at position j
    the sides draw apart with chance ``tv(item, j)``, and after that each goes its own way."""
    off, on = {}, {}
    for item in items:
        a = rng.integers(10, 1000, length)
        b = a.copy()
        parts = rng.random(length) < np.array([tv(item, j) for j in range(length)])
        if parts.any():
            j = int(np.argmax(parts))
            b[j] = a[j] + 1000  # another token there, and from there on another history
            b[j + 1:] = rng.integers(10, 1000, length - j - 1)
        off[item.case_id] = {"turns": [{"tokens": a.tolist()}]}
        on[item.case_id] = {"turns": [{"tokens": b.tolist()}]}
    return off, on


def coupled(items: list[Item], tv: Callable[[Item, int], float], length: int = 64, seed: int = 0,
            anytime: bool = False) -> coupling.Coupled:
    c = coupling.couple(items, *records(items, tv, length, np.random.default_rng(seed)), ALPHA, None, anytime)
    assert c is not None
    return c


def by_name(c: coupling.Coupled) -> dict[str, dict[str, Any]]:
    return {k["class"]: k for k in c.classes}


# --- the two defects the pooled figure hid ---------------------------------------------------------------------------


def test_a_defect_late_in_answers_is_bounded_where_it_lives():
    """TV 0.3 at every position from 32 on, in 200 answers of 64 tokens: the pooled figure bounds the average over the
    compared steps under 0.1 (it was the reported ``tv_bound``), the late classes' bounds cover 0.3, and ``max_tv``
    0.1 withholds the PASS."""
    c = coupled(battery({"writer": 50}, samples=4), lambda item, j: 0.3 if j >= 32 else 0.0)
    assert c.answers == 200 and c.tv_mean_bound < MAX_TV  # what the average over compared steps says
    classes = by_name(c)
    assert list(classes) == ["position 0-21", "position 22-42", "position 43+"]  # one stage: no stage class
    assert classes["position 0-21"]["mismatches"] == 0 and classes["position 0-21"]["steps"] == 200 * 22
    assert c.tv_bound >= 0.3 and c.tv_bound == max(k["bound"] for k in c.classes)
    assert classes["position 43+"]["bound"] >= 0.3  # the class wholly inside the defect covers its TV
    for k in c.classes:  # each class: Clopper-Pearson at alpha over the 3 classes
        assert k["bound"] == pytest.approx(coupling.upper(k["mismatches"], k["steps"], ALPHA / 3))
    verdict, reasons = c.judge("PASS", [], MAX_TV).on("PASS", [])
    assert verdict == "INCONCLUSIVE" and reasons[0].startswith("tv_bound: "), reasons
    worst = max(c.classes, key=lambda k: k["bound"])["class"]
    assert worst in reasons[0], reasons[0]
    record = c.to_dict()
    assert record["tv_bound"] == c.tv_bound and record["tv_mean_bound"] == c.tv_mean_bound
    assert [set(k) >= {"class", "steps", "mismatches", "bound"} for k in record["classes"]] == [True] * 3


def test_a_defect_in_one_stage_is_bounded_in_that_stage():
    """10% of the prompts (one stage of two) at TV 0.2 at every step: the pooled figure bounds the average at about
    0.003; the stage's own bound covers 0.2, and ``max_tv`` 0.1 withholds the PASS."""
    items = battery({"reader": 18, "writer": 2}, samples=10)
    c = coupled(items, lambda item, j: 0.2 if item.suite.stage == "writer" else 0.0)
    assert c.tv_mean_bound < 0.01
    classes = by_name(c)
    assert set(classes) == {"position 0-21", "position 22-42", "position 43+", "stage reader", "stage writer"}
    assert classes["stage writer"]["answers"] == 20 and classes["stage reader"]["mismatches"] == 0
    assert classes["stage writer"]["bound"] >= 0.2 and c.tv_bound == classes["stage writer"]["bound"]
    assert classes["stage writer"]["bound"] == pytest.approx(
        coupling.upper(classes["stage writer"]["mismatches"], classes["stage writer"]["steps"], ALPHA / 5))
    verdict, reasons = c.judge("PASS", [], MAX_TV).on("PASS", [])
    assert verdict == "INCONCLUSIVE" and reasons[0].startswith("tv_bound: ") and "stage writer" in reasons[0], reasons
    line = c.line()
    assert "stage writer" in line and "averaged over all compared steps" in line and "per-token" not in line, line


def test_a_clean_run_still_passes_max_tv():
    """No defect: every class's bound is Clopper-Pearson's with no mismatch at alpha/m, and ``max_tv`` 0.1 passes,
    in a battery of two stages and in one as small as the tiny suite's (12 answers of 12 tokens)."""
    c = coupled(battery({"reader": 18, "writer": 2}, samples=10), lambda item, j: 0.0)
    assert len(c.classes) == 5 and c.mismatches == 0
    for k in c.classes:
        assert k["mismatches"] == 0 and k["bound"] == pytest.approx(1 - (ALPHA / 5) ** (1 / k["steps"]))
    assert c.judge("PASS", [], MAX_TV).on("PASS", [])[0] == "PASS"
    small = coupled(battery({"tiny": 4}, samples=3, max_tokens=12), lambda item, j: 0.0, length=12)
    assert [k["class"] for k in small.classes] == ["position 0-3", "position 4-7", "position 8+"]
    assert small.tv_bound == pytest.approx(1 - (ALPHA / 3) ** (1 / 48)) and small.tv_bound < MAX_TV
    assert small.judge("PASS", [], MAX_TV).on("PASS", [])[0] == "PASS"
    # the pooled figure is the old bound on all compared steps, at alpha
    assert small.tv_mean_bound == pytest.approx(coupling.upper(0, 144, ALPHA))


def test_the_position_classes_are_thirds_of_the_flag_off_answers_positions():
    """The edges split the flag-off answers' token positions into thirds (read from where those answers end, never
    from where the sides part); the stop step of an answer the other side outruns falls in the class of its
    position."""
    items = battery({"s": 3})
    off = {items[0].case_id: {"turns": [{"tokens": list(range(30))}]},
           items[1].case_id: {"turns": [{"tokens": list(range(6))}]},
           items[2].case_id: {"turns": [{"tokens": list(range(6))}, {"tokens": list(range(6))}]}}
    on = {**off, items[1].case_id: {"turns": [{"tokens": list(range(8))}]}}  # outruns at position 6
    c = coupling.couple(items, off, on, ALPHA, None)
    assert c is not None
    # 48 positions: a third is 16 (positions 0-3 hold 4 x 4), two thirds 32 (positions 0-13 hold 14 + 3 x 6)
    assert c.edges == [4, 14]
    classes = by_name(c)
    assert list(classes) == ["position 0-3", "position 4-13", "position 14+"]
    assert (classes["position 4-13"]["steps"], classes["position 4-13"]["mismatches"]) == (10 + 3 + 2 * 2, 1)
    assert sum(k["steps"] for k in c.classes) == c.steps == 30 + 7 + 12


# --- size and power, by seeded simulation ------------------------------------------------------------------------------


@pytest.mark.parametrize("anytime", [False, True])
def test_size_at_max_tv_in_every_class(anytime):
    """Per-step TV exactly at max_tv at every position of every stage (a maximal coupling: the sides part with chance
    max_tv at each step): the chance that any class's bound falls below it (the table's claims hold together at
    1 - alpha, Bonferroni) is at most alpha within Monte Carlo error, each class's at most alpha/m, and a false PASS
    under ``max_tv`` (every class below it) rarer still; for Clopper-Pearson (fixed n) and for the confidence
    sequence (a sequential run). Measured at 3,000 runs (Clopper-Pearson): any class 0.022, each class 0.002-0.007
    against alpha/m = 0.01."""
    runs, items = 300, battery({"reader": 6, "writer": 4}, samples=4)  # 40 answers, m = 3 + 2 classes
    below = passed = 0
    per_class: dict[str, int] = {}
    for seed in range(runs):
        c = coupled(items, lambda item, j: MAX_TV, length=30, seed=seed, anytime=anytime)
        below += any(k["bound"] < MAX_TV for k in c.classes)
        passed += c.judge("PASS", [], MAX_TV).on("PASS", [])[0] == "PASS"
        for k in c.classes:
            per_class[k["class"]] = per_class.get(k["class"], 0) + (k["bound"] < MAX_TV)
    assert len(per_class) == 5
    assert below / runs <= ALPHA + 3 * math.sqrt(ALPHA * (1 - ALPHA) / runs), below
    assert passed <= below
    for name, n in per_class.items():
        assert n / runs <= ALPHA / 5 + 3 * math.sqrt(ALPHA / 5 / runs), (name, n)


def test_power_at_a_late_defect():
    """Stated effect: TV 0.2 at every position from 40 on (the last third of 60-token answers), none before, 40
    answers of one stage. ``max_tv`` 0.1 withholds the PASS in at least 95% of runs; the pooled figure, the old
    ``tv_bound``, would have passed nearly every one of them."""
    runs, items = 200, battery({"writer": 10}, samples=4)
    caught = pooled = 0
    for seed in range(runs):
        c = coupled(items, lambda item, j: 0.2 if j >= 40 else 0.0, length=60, seed=seed)
        caught += c.judge("PASS", [], MAX_TV).on("PASS", [])[0] != "PASS"
        pooled += c.tv_mean_bound > MAX_TV
    assert caught / runs >= 0.95, caught
    assert pooled / runs <= 0.05, pooled
