"""Repeated evaluations of one change are repeated looks (gate/stats/looks.py): alpha is spent across them, look j of a
change at alpha * 2^-j, and ``flip`` judges the change's history, not its best run.

The simulation uses the project's own paired bound (``paired.decide``) and the rule ``flip`` applies
(``looks.problems``) on histories shaped as the ledger reads them; the CLI test runs the planted lossy change of
``fault_engines:Lossy`` on the tiny model (probes, distance and reference arm off), so it takes seconds."""

from __future__ import annotations

import json
import math
import random
from functools import lru_cache

import pytest
from conftest import ledger, wide_suite

from gatekeeper.gate.stats import looks, paired

ALPHA, MARGIN = 0.05, 0.05


# --- the simulation ------------------------------------------------------------------------------------------------


@lru_cache(maxsize=None)
def judged(b: int, c: int, n: int, alpha: float) -> dict:
    """The paired verdict of n independent pairs (one assertion per case) with b harmful and c beneficial flips."""
    pairs = ([("h", True, False)] * b + [("c", False, True)] * c + [("s", True, True)] * (n - b - c))
    return paired.decide([(f"case{i}", off, on) for i, (_, off, on) in enumerate(pairs)], MARGIN, alpha).to_dict()


IDENTITY = {"off": {"engine": {"name": "tiny"}, "flags": {"lossy": "off"}, "battery_digest": "b"},
            "on": {"engine": {"name": "tiny"}, "flags": {"lossy": "on"}, "change": {"profile": {"dtype": "q"}},
                   "battery_digest": "b"}}


def row(eid: int, status: str, summary: dict | None, battery: str = "b", gate: str = "non_inferiority") -> dict:
    """One evaluation as ``Ledger.history`` reads it back."""
    identity = {side: {**part, "battery_digest": battery} for side, part in IDENTITY.items()}
    return {"id": eid, "flag": "lossy", "gate": gate, "identity": identity, "status": status, "summary": summary}


def evaluate(history: list[dict], counts: tuple[int, int, int]) -> dict:
    """One more evaluation of the change, as the evaluator runs it: it takes its look from the history, is judged at
    that look's alpha and records both; the battery grew, so its digest is another."""
    eid = len(history) + 1
    history.append(row(eid, "running", None, battery=f"b{eid}"))
    look = looks.take(history, eid, "non_inferiority", MARGIN, ALPHA)
    assert look is not None and look.index == eid and look.of_change == list(range(1, eid + 1))
    stats = judged(*counts, look.alpha_spent)
    verdict = {"pass": "PASS", "fail": "FAIL", "underpowered": "INCONCLUSIVE"}[stats["verdict"]]
    history[-1] = row(eid, verdict, {"paired": stats, "looks": look.to_dict()}, battery=f"b{eid}")
    return history[-1]


def simulate(n_looks: int, runs: int, seed: int, step: int = 100, discordance: float = 0.15) -> tuple[float, float]:
    """A change whose true loss is the margin (the null), evaluated on ``step`` cases, then ``step`` more (the same
    cases and new ones) and evaluated again, up to ``n_looks`` times, stopping at the first PASS. Returns the share of
    runs that end with a PASS flip would take: today's rule (any PASS at the full alpha) and the history rule."""
    rng = random.Random(seed)
    p12, p21 = (discordance + MARGIN) / 2, (discordance - MARGIN) / 2  # p12 - p21 = the margin
    naive = ruled = 0
    for _ in range(runs):
        b = c = n = 0
        history: list[dict] = []
        naive_pass = ruled_pass = False
        for _ in range(n_looks):
            for u in (rng.random() for _ in range(step)):
                b, c = b + (u < p12), c + (p12 <= u < p12 + p21)
            n += step
            naive_pass = naive_pass or judged(b, c, n, ALPHA)["verdict"] == "pass"
            if not ruled_pass:
                record = evaluate(history, (b, c, n))
                ruled_pass = record["status"] == "PASS" and not looks.problems(history, record["id"])
        naive += naive_pass
        ruled += ruled_pass
    return naive / runs, ruled / runs


@pytest.mark.parametrize("n_looks, seed", [(2, 11), (3, 12)])
def test_looks_at_the_null_keep_the_false_pass_rate_within_alpha(n_looks, seed):
    """Today's rule (any PASS of the change, each at the full alpha) passes a change whose loss is at the margin in
    about 9% of runs with two looks and 11% with three (alpha 0.05); the history rule stays within alpha."""
    runs = 3000
    tol = 3 * math.sqrt(ALPHA * (1 - ALPHA) / runs)
    naive, ruled = simulate(n_looks, runs, seed)
    assert naive > ALPHA + tol, naive  # the defect: repeated looks inflate the error
    assert ruled <= ALPHA + tol, ruled
    assert ruled <= sum(looks.allotted(j, ALPHA) for j in range(1, n_looks + 1)) + tol  # the union bound
    assert ruled > 0  # and the rule can still pass: the looks spend alpha, they do not forbid a PASS


def test_the_schedule_sums_to_alpha_and_halves():
    assert [looks.allotted(j, 0.05) for j in (1, 2, 3)] == [0.025, 0.0125, 0.00625]
    assert sum(looks.allotted(j, 0.05) for j in range(1, 60)) == pytest.approx(0.05)
    with pytest.raises(ValueError):
        looks.allotted(0, 0.05)


# --- the rule on histories -----------------------------------------------------------------------------------------


def legacy(eid: int, counts: tuple[int, int, int], status: str = "PASS", alpha: float = ALPHA) -> dict:
    """A verdict recorded before looks were counted: judged at the policy's full alpha, no ``looks``."""
    return row(eid, status, {"paired": judged(*counts, alpha)})


def test_a_pass_recorded_before_looks_is_judged_again_at_its_looks_alpha():
    # 0 flips in 100 pairs: upper bound 0.026 at alpha 0.05 and 0.037 at 0.025, within 0.05 at either: it holds
    assert looks.problems([legacy(1, (0, 0, 100))], 1) == []
    # 6 harmful, 2 beneficial flips of 200: upper bound 0.048 at alpha 0.05, 0.055 at 0.025 (look 1's alpha)
    assert judged(6, 2, 200, 0.05)["verdict"] == "pass" and judged(6, 2, 200, 0.025)["verdict"] == "underpowered"
    (why,) = looks.problems([legacy(1, (6, 2, 200))], 1)
    assert why.startswith("looks: evaluation 1 is look 1 of this change (evaluations 1)") and "before looks were counted" in why
    assert "alpha 0.025" in why and "add cases and evaluate again" in why and "look 2 is allotted 0.0125" in why, why
    # as look 2 (an INCONCLUSIVE before it) 0 flips in 100 pairs still hold at 0.0125; 3 harmful, 3 beneficial do not
    assert looks.problems([legacy(1, (0, 0, 50), "INCONCLUSIVE"), legacy(2, (0, 0, 100))], 2) == []
    (why,) = looks.problems([legacy(1, (0, 0, 50), "INCONCLUSIVE"), legacy(2, (3, 3, 100))], 2)
    assert "look 2 of this change (evaluations 1, 2)" in why and "alpha 0.0125 (0.05 * 2^-2)" in why, why


def test_a_sequential_pass_recorded_before_looks_cannot_be_recomputed_and_is_refused():
    record = row(1, "PASS", {"paired": None, "sequential": {"alpha": 0.2, "decision": "pass"}})
    (why,) = looks.problems([record], 1)
    assert why.startswith("looks: evaluation 1 is look 1") and "cannot be judged again" in why
    assert "evaluate again (gatekeeper evaluate --flag lossy)" in why, why


def test_a_fail_after_a_pass_of_the_same_change_refuses_it_and_one_before_does_not():
    passed = lambda eid: row(eid, "PASS", {"paired": judged(0, 0, 400, 0.0125),  # noqa: E731
                                          "looks": {"index": eid, "alpha": ALPHA, "alpha_spent": looks.allotted(eid, ALPHA),
                                                    "of_change": list(range(1, eid + 1))}})
    failed = lambda eid: row(eid, "FAIL", {"paired": judged(40, 0, 100, looks.allotted(eid, ALPHA)),  # noqa: E731
                                          "looks": {"index": eid, "alpha": ALPHA, "alpha_spent": looks.allotted(eid, ALPHA),
                                                    "of_change": list(range(1, eid + 1))}})
    (why,) = looks.problems([passed(1), failed(2)], 1)
    assert why.startswith("looks: evaluation 2 of the same change FAILed after evaluation 1 passed"), why
    assert looks.problems([failed(1), passed(2)], 2) == []  # a PASS after the FAIL, at its own (smaller) alpha
    # a FAIL of another change (another candidate) says nothing of this one
    other = failed(2)
    other["identity"] = {**other["identity"], "on": {**other["identity"]["on"], "candidate": {"digest": "x"}}}
    assert looks.problems([passed(1), other], 1) == []
    # a FAIL after a byte-equivalence PASS of the same change refuses it too; an exact PASS spends no alpha
    exact = row(1, "PASS", {"paired": None, "looks": None}, gate="byte_equivalence")
    assert looks.problems([exact], 1) == []
    assert looks.problems([exact, row(2, "FAIL", {"paired": None, "looks": None}, gate="byte_equivalence")], 1)


def test_what_counts_as_a_look():
    history = [
        row(1, "aborted", None),  # read nothing
        row(2, "PASS", {"paired": None, "looks": None}, gate="byte_equivalence"),  # exact: no bound
        row(3, "INCONCLUSIVE", {"paired": judged(0, 0, 20, ALPHA)}),  # before looks were recorded: a bound
        row(4, "running", None),  # still running: it will read its bound
        row(5, "running", None),
    ]
    look = looks.take(history, 5, "non_inferiority", MARGIN, ALPHA)
    assert look is not None and (look.index, look.of_change, look.alpha_spent) == (3, [3, 4, 5], 0.00625)
    assert looks.take(history, 5, "byte_equivalence", 0, ALPHA) is None
    assert looks.take(history, 5, "assertion_equivalence", 0, ALPHA) is None  # margin 0: exact
    assert looks.take(history, 5, "assertion_equivalence", 0.1, ALPHA) is not None
    # the battery and the policy are not the change; the engine, a candidate, a declared change are
    key = looks.change_key("lossy", IDENTITY)
    moved = {side: {**part, "battery_digest": "other", "policy_digest": "p2", "decoding": {"wide": {}}}
             for side, part in IDENTITY.items()}
    assert looks.change_key("lossy", moved) == key
    assert looks.change_key("lossy", {**IDENTITY, "on": {**IDENTITY["on"], "change": {"profile": {"dtype": "f16"}}}}) != key
    assert looks.change_key("other", IDENTITY) != key


# --- end to end ------------------------------------------------------------------------------------------------------


def policy(ws, extra: str = "") -> None:
    (ws / "policies" / "lossy.yaml").write_text(
        "flag: lossy\ngate: non_inferiority\nchange: {profile: {adapter: 'fault_engines:Lossy'}}\nmargin: 0.3\n"
        f"alpha: 0.2\nprobes: off\ndistance: false\nreference: false\n{extra}")


def cli(run_cli, ws, *args):
    code, out, _ = run_cli("--workspace", ws, *args, "--json")
    return code, json.loads(out)


def evaluate_cli(run_cli, ws):
    return cli(run_cli, ws, "evaluate", "--flag", "lossy", "--engine", "tiny", "--operator", "ci", "--suite", "wide")


def flip_on(run_cli, ws, eid):
    return cli(run_cli, ws, "flip", "lossy", "on", "--evaluation", str(eid), "--operator", "ops", "--reason", "passed")


def test_a_second_evaluation_is_look_two_and_flip_refuses_a_pass_held_only_at_the_full_alpha(run_cli, tiny_ws):
    """No assertion flips (the change only appends text no assertion reads), so the bound is z^2 / (n + z^2): one case
    cannot rule out a loss of 0.3 (0.415 at the policy's full alpha 0.2, 0.622 at look 1's 0.1); 6 would at 0.1 (0.215)
    and at 0.2 (0.106), but the second evaluation is look 2, allotted 0.05 (0.311): INCONCLUSIVE, where today's rule
    (INCONCLUSIVE, then a PASS at 0.2) let the flip through."""
    policy(tiny_ws)
    wide_suite(tiny_ws, 1)
    code, first = evaluate_cli(run_cli, tiny_ws)
    assert (code, first["verdict"]) == (1, "INCONCLUSIVE"), first["reasons"]
    assert first["looks"]["index"] == 1 and first["looks"]["alpha_spent"] == pytest.approx(0.1)
    assert first["paired"]["alpha"] == pytest.approx(0.1)  # the bound was computed at the look's alpha
    wide_suite(tiny_ws, 6)  # add cases and evaluate again, as an underpowered verdict says
    code, second = evaluate_cli(run_cli, tiny_ws)
    eid = second["evaluation_id"]
    assert second["looks"] == {"index": 2, "of_change": [first["evaluation_id"], eid], "alpha": 0.2,
                               "alpha_spent": pytest.approx(0.05), "change": first["looks"]["change"],
                               "schedule": "alpha * 2^-index"}, second["looks"]
    stats = second["paired"]
    assert (stats["n"], stats["harmful"], stats["beneficial"], stats["alpha"]) == (6, 0, 0, pytest.approx(0.05))
    assert (code, second["verdict"]) == (1, "INCONCLUSIVE") and stats["upper"] > 0.3, second["reasons"]
    assert paired.tango_bounds(0, 0, 6, 0.2)[1] <= 0.3  # at the full alpha (today's rule) these 6 pairs passed
    # the record holds the look: the verdict's summary, ledger show (text and JSON)
    code, shown = cli(run_cli, tiny_ws, "ledger", "show", str(eid))
    assert code == 0 and shown["verdict_record"]["summary"]["looks"] == second["looks"]
    code, text, _ = run_cli("--workspace", tiny_ws, "ledger", "show", str(eid))
    assert f"look 2 of this change (evaluations {first['evaluation_id']}, {eid}): alpha 0.05 of the policy's 0.2" in text, text
    for fmt in ("md", "html"):  # and the exports
        code, page, _ = run_cli("--workspace", tiny_ws, "ledger", "export", str(eid), "--format", fmt)
        assert code == 0 and "Looks: look 2 of this change" in page, page
    code, sized = cli(run_cli, tiny_ws, "battery", "size", "--flag", "lossy")  # the next look is sized at its share
    assert code == 0 and (sized["evaluation_id"], sized["look"], sized["alpha"]) == (eid, 3, pytest.approx(0.025)), sized
    code, flipped = flip_on(run_cli, tiny_ws, eid)
    assert code == 1 and flipped["action"] == "refused" and flipped["reasons"][0].startswith("not_passed:"), flipped

    # A PASS written before looks were counted (judged at the full alpha, no record of its look) on the same change:
    # it is look 3, allotted 0.025, at which its 6 pairs do not hold (0.390). flip refuses it and says how to fix it.
    with ledger(tiny_ws) as lg:
        ev = lg.evaluation(eid)
        old = lg.start_evaluation("lossy", "ci", "non_inferiority", ev["identity"], ev["config"])
        stale_pass = paired.decide([(f"w{i}", True, True) for i in range(6)], 0.3, 0.2)
        lg.finish_evaluation(old, "PASS", [stale_pass.reason()], {"paired": stale_pass.to_dict()})
    code, flipped = flip_on(run_cli, tiny_ws, old)
    assert code == 1 and flipped["action"] == "refused" and flipped["state"] == "off", flipped
    (why,) = [r for r in flipped["reasons"] if r.startswith("looks:")]
    assert f"evaluation {old} is look 3 of this change" in why and "before looks were counted" in why, why
    assert "alpha 0.025 (0.2 * 2^-3)" in why and "evaluate again" in why, why
    with ledger(tiny_ws) as lg:
        assert lg.refusals("lossy")[-1]["reasons"] == flipped["reasons"] and lg.verify().ok


def test_a_fail_after_a_pass_of_the_same_change_refuses_the_flip(run_cli, tiny_ws):
    """A PASS at look 1 (5 clean cases: upper bound 0.247 <= 0.3 at alpha 0.1), then a battery whose 6 cases assert
    what the change breaks FAILs at look 2 (lower bound 0.378 > 0.3 at alpha 0.05): flip of the PASS is refused, with
    the reason naming the FAIL."""
    policy(tiny_ws)
    wide_suite(tiny_ws, 5)
    code, passed = evaluate_cli(run_cli, tiny_ws)
    assert (code, passed["verdict"], passed["looks"]["index"]) == (0, "PASS", 1), passed["reasons"]
    wide_suite(tiny_ws, 6, lambda i: [{"type": "not-contains", "value": "zebra"}])
    code, failed = evaluate_cli(run_cli, tiny_ws)
    assert (code, failed["verdict"], failed["looks"]["index"]) == (1, "FAIL", 2), failed["reasons"]
    assert any(r.startswith("inferior:") for r in failed["reasons"]), failed["reasons"]
    wide_suite(tiny_ws, 5)  # the battery as it was: the PASS is current again, but the FAIL stays in the history
    code, flipped = flip_on(run_cli, tiny_ws, passed["evaluation_id"])
    assert code == 1 and flipped["action"] == "refused", flipped
    assert flipped["reasons"] == [f"looks: evaluation {failed['evaluation_id']} of the same change FAILed after "
                                  f"evaluation {passed['evaluation_id']} passed, so the change's newest verdict is "
                                  "against it; read its reasons, and if the change is fixed, evaluate again (gatekeeper "
                                  "evaluate --flag lossy) and name that evaluation"], flipped
