"""The guard's statistics (issue #60): per-stage limits partition the comparisons, so a stage's own limit can relax
it, and the chance of any false rollback over a long watch with a look after every batch stays under alpha; the
rule is recorded with its watch, so a rule changed after the data is a new test on the batches written after the
change, at the alpha left, while a restart under the same rule resumes the statistic over all of that rule's
batches. The ledger is a real SQLite file; the guard is the library object a proxy runs, fed batches directly."""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
from pathlib import Path

import pytest
from trust import allowed_line, keys  # noqa: F401

from gatekeeper.gate.guard import ALL, Count, Rule, line, live
from gatekeeper.gate.stats.evalues import log_evalue, log_evalue_paired, to_detect_paired
from gatekeeper.ledger import Ledger

pytest_plugins = ["postgres"]

FLAG = "prefix_cache"


# --- per-stage limits -----------------------------------------------------------------------------
def test_a_stage_limit_relaxes_its_stage_and_the_other_stages_keep_the_overall_limit():
    """The documented example: ``limit: 0, stage_limits: {writer: 0.01}``."""
    rule = Rule(limit=0, alpha=0.05, min_comparisons=20, stage_limits={"writer": 0.01})
    tests = {t.scope: t for t in rule.tests({"writer": Count(200, 1), "router": Count(200, 0)})}
    assert not any(t.breached for t in tests.values())  # one writer mismatch in 200 is within the writer's 1%
    assert (tests[ALL].compared, tests[ALL].mismatches) == (200, 0)  # the overall test counts the router only
    assert (tests["writer"].compared, tests["writer"].mismatches) == (200, 1)
    assert all(math.isclose(t.alpha, 0.025) for t in tests.values())  # Bonferroni over the two tests
    breached = [t.scope for t in rule.tests({"writer": Count(200, 1), "router": Count(200, 1)}) if t.breached]
    assert breached == [ALL]  # a router mismatch under limit 0 is still a breach, and the writer's is still not


def test_false_rollbacks_with_every_stage_at_its_limit_stay_under_alpha():
    """Every stage parts at exactly its limit (the worst case the null allows), comparisons in batches of 16 with a
    look after each, 4,000 comparisons per watch: the share of watches with any rollback is at most alpha (within
    three standard errors of the simulation). Before the partition, the writer's 5% counted in the 2% overall test."""
    limits = {"writer": 0.05, "router": 0.01}
    rates = {**limits, "search": 0.02, "summary": 0.02}  # the last two have no limit of their own: the overall 2%
    per_batch = {"writer": 6, "router": 4, "search": 3, "summary": 3}
    alpha, runs, batches = 0.1, 200, 250
    rule = Rule(limit=0.02, alpha=alpha, min_comparisons=20, stage_limits=limits)
    rng = random.Random(60)

    def rolled_back() -> bool:
        counts = {stage: Count() for stage in rates}
        for _ in range(batches):
            for stage, n in per_batch.items():
                counts[stage].add(Count(n, sum(rng.random() < rates[stage] for _ in range(n))))
            if any(t.breached for t in rule.tests(counts)):
                return True
        return False

    false = sum(rolled_back() for _ in range(runs))
    assert false / runs <= alpha + 3 * math.sqrt(alpha * (1 - alpha) / runs), false


# --- the rule recorded with its watch ----------------------------------------------------------------
def _ws(workspace: Path, keys, guard: dict) -> Path:  # noqa: F811
    """The init workspace with the policy's ``guard:``, the service key ``ci`` allowed, and the flag on."""
    from gatekeeper.ledger import checkpoint
    from gatekeeper.workspace import Workspace

    _set_guard(workspace, guard)
    (workspace / "policies" / "allowed_signers").write_text(allowed_line("guard", keys["ci"]) + allowed_line("ana", keys["ana"]))
    with _ledger(workspace) as lg:
        lg.add_flip(FLAG, "on", "ana", "passed and approved")
        checkpoint.after_flip(Workspace(workspace), lg, None)
    return workspace


def _set_guard(ws: Path, guard: dict) -> None:
    """Tune the policy's ``guard:`` (outside the policy digest: the flag stays on)."""
    policy = ws / "policies" / f"{FLAG}.yaml"
    kept = [line for line in policy.read_text().splitlines(keepends=True) if not line.startswith("guard:")]
    policy.write_text("".join(kept) + f"guard: {json.dumps(guard)}\n")


def _ledger(ws: Path) -> Ledger:
    return Ledger(f"sqlite:///{ws / 'ledger' / 'evidence.db'}")


def _start(ws: Path, keys):  # noqa: F811
    """The guard a (re)started ``gatekeeper proxy --guard`` runs: it resumes from the ledger."""
    from gatekeeper.signing import load_key
    from gatekeeper.traffic.live.guarded import Guarded
    from gatekeeper.workspace import Workspace

    return Guarded(Workspace(ws), f"sqlite:///{ws / 'ledger' / 'evidence.db'}", FLAG, "http://127.0.0.1:9", load_key(keys["ci"]))


def _feed(guard, *batches: tuple[int, int]) -> None:
    """Batches of (compared, mismatches) of the router stage, written as the proxy writes them; then a stop."""
    from gatekeeper.traffic.live.guarded import Batch

    async def go():
        for compared, mismatches in batches:
            guard.batch = Batch(requests=compared, shadowed=compared,
                                stages={"router": {"compared": compared, "mismatches": mismatches, "unpaired": 0}})
            guard.flush().result()
        await guard.close()

    asyncio.run(go())


A = {"rate": 1, "limit": 0.02, "alpha": 0.05, "min_comparisons": 10, "aa_rate": 0}  # the one-sample rule (no A/A)
B = {**A, "limit": 0.05}  # looser, after seeing A's mismatches


def test_a_rule_changed_mid_watch_is_a_new_test_at_the_alpha_left_and_the_same_rule_resumes(workspace, keys):  # noqa: F811
    ws = _ws(workspace, keys, A)
    _feed(_start(ws, keys), (20, 1), (20, 1), (20, 1))  # 3 in 60: above A's 2%, short of a breach
    assert not any(t["breached"] for b in _ledger(ws).shadows(FLAG) for t in b["summary"]["tests"])

    _set_guard(ws, B)
    guard = _start(ws, keys)
    assert guard.tests[0].compared == 0  # A's batches are not tested again under B
    _feed(guard, (20, 0), (20, 0))
    shadows = _ledger(ws).shadows(FLAG)
    b1, b2 = (b["summary"] for b in shadows[3:])
    assert (b2["tests"][0]["compared"], b2["tests"][0]["mismatches"]) == (40, 0)  # B counts its own batches only
    assert b2["tests"][0]["alpha"] == 0.0125  # half of the 0.025 that A's segment left

    _set_guard(ws, A)  # back to A after a restart: A's statistic resumes over all of A's batches, B's aside
    guard = _start(ws, keys)
    assert (guard.tests[0].compared, guard.tests[0].mismatches, guard.tests[0].alpha) == (60, 3, 0.025)
    _feed(guard, (20, 0))
    last = _ledger(ws).shadows(FLAG)[-1]["summary"]
    assert (last["tests"][0]["compared"], last["tests"][0]["mismatches"]) == (80, 3)
    assert last["segment"]["index"] == 1 and last["segment"]["new_test"] is False

    evidence = live(_ledger(ws), FLAG)  # what ledger live shows: each segment, its rule, alpha and counts
    assert evidence is not None and evidence["compared"] == 120
    seen = [(s["index"], s["alpha"], s["compared"], s["mismatches"], s["breached"]) for s in evidence["segments"]]
    assert seen == [(1, 0.025, 80, 3, False), (2, 0.0125, 40, 0, False)]
    assert _ledger(ws).flag_states()[FLAG]["state"] == "on" and _ledger(ws).verify().ok

    # the record: each segment's first batch holds its rule, the rule's digest, its alpha and that it is a new test
    first = shadows[0]["summary"]
    assert first["rule"] == {"limit": 0.02, "alpha": 0.05, "min_comparisons": 10, "stage_limits": {}}
    assert first["segment"] == {"index": 1, "rule_digest": Rule.from_dict(A).digest(), "alpha": 0.025,
                                "alpha_left": 0.05, "new_test": True}
    assert b1["rule"] == {**first["rule"], "limit": 0.05}
    assert b1["segment"] == {"index": 2, "rule_digest": Rule.from_dict(B).digest(), "alpha": 0.0125,
                             "alpha_left": 0.025, "new_test": True}
    assert b2["segment"]["new_test"] is False and shadows[1]["summary"]["segment"]["new_test"] is False


def test_a_breach_under_the_old_rule_stays_a_breach_under_a_looser_one(workspace, keys):  # noqa: F811
    """A breach written under A whose rollback never came (the proxy killed in between); restarted under a looser
    rule the breach still stands, and the next batch rolls the flag back naming it."""
    strict = {"limit": 0.0, "alpha": 0.05, "min_comparisons": 10, "stage_limits": {}}
    ws = _ws(workspace, keys, {**A, **strict})
    with _ledger(ws) as lg:
        flip_id = lg.flag_states()[FLAG]["id"]
        lg.add_shadow(FLAG, flip_id, "guard", {"requests": 20, "shadowed": 20, "rule": strict,
                                               "stages": {"router": {"compared": 20, "mismatches": 1, "unpaired": 0}}}, [])
    _set_guard(ws, {**A, "limit": 0.2})  # 1 in 40 is well within 20%: alone, B would never roll back
    guard = _start(ws, keys)
    _feed(guard, (20, 0))
    state = _ledger(ws).flag_states()[FLAG]
    assert guard.rollback is not None and state["state"] == "off" and state["signer"] == "guard", state
    assert "all stages: 1 of 20" in state["reason"] and "rate <= 0 rejected" in state["reason"]
    assert _ledger(ws).verify().ok


# --- the A/A baseline (issue #60 item 2) --------------------------------------------------------------
NOISE = 0.03  # both sides part at this rate for reasons that are not the flag (batch composition, kernels by shape)


def _paired(rng: random.Random, flag: float, model: str) -> tuple[bool, bool]:
    """One request compared both ways: (A/B parted, A/A parted). ``independent``: each comparison parts at NOISE on
    its own; ``shared``: each of the three answers (flag-on, flag-off, flag-off again) is disturbed by the batch at
    NOISE/2, and a comparison parts when either of its answers is (the A/B and A/A share the first flag-off answer).
    The flag adds partings of its own to the flag-on answer at ``flag``."""
    if model == "independent":
        return rng.random() < NOISE or rng.random() < flag, rng.random() < NOISE
    live, off, again = (rng.random() < NOISE / 2 for _ in range(3))
    return live or off or rng.random() < flag, off or again


def _watch(rule: Rule, flag: float, rng: random.Random, model: str = "independent", requests: int = 4000,
           batch: int = 16) -> int | None:
    """A long watch with a look after every batch: the request at which the rule first breaches, or None."""
    ab_n = aa_n = ab_only = aa_only = 0
    for n in range(1, requests + 1):
        ab, aa = _paired(rng, flag, model)
        ab_n, aa_n, ab_only, aa_only = ab_n + ab, aa_n + aa, ab_only + (ab and not aa), aa_only + (aa and not ab)
        if n % batch == 0:
            c = Count(n, ab_n, n if rule.aa_rate else 0, aa_n, ab_only, aa_only)
            if rule.tests({"router": c})[0].breached:
                return n
    return None


@pytest.mark.parametrize("model", ["independent", "shared"])
def test_with_a_baseline_batch_noise_on_both_sides_is_no_rollback_and_without_one_it_nearly_always_is(model):
    """The flag changes nothing; flag-on vs flag-off and flag-off vs flag-off both part at 3% (the batch-variance
    problem). Over a watch of 4,000 requests with a look after every batch of 16, the baseline-aware rule rolls back
    in at most alpha of the watches (within three standard errors of the simulation); the rule against zero (the old
    default, ``limit: 0`` without a baseline) rolls back nearly every one."""
    alpha, runs = 0.1, 300
    rng = random.Random(602)
    aware = Rule(limit=0, alpha=alpha, min_comparisons=20, aa_rate=1)
    false = sum(_watch(aware, 0, rng, model) is not None for _ in range(runs))
    assert false / runs <= alpha + 3 * math.sqrt(alpha * (1 - alpha) / runs), false
    zero = Rule(limit=0, alpha=alpha, min_comparisons=20)
    assert sum(_watch(zero, 0, rng, model) is not None for _ in range(50)) >= 48


def test_with_a_baseline_and_a_limit_the_rate_at_the_limit_above_the_baseline_is_no_rollback():
    """H0 at its edge with a limit of 0.02 (the midpoint-grid mixture): flag-on vs flag-off parts at 5%, flag-off vs
    flag-off at 3%; false rollbacks stay under alpha."""
    alpha, runs = 0.1, 200
    rng = random.Random(603)
    rule = Rule(limit=0.02, alpha=alpha, min_comparisons=20, aa_rate=1)
    flag = 1 - (1 - 0.05) / (1 - NOISE)  # so that 1 - (1 - NOISE)(1 - flag) = 0.05
    false = sum(_watch(rule, flag, rng, batch=64) is not None for _ in range(runs))
    assert false / runs <= alpha + 3 * math.sqrt(alpha * (1 - alpha) / runs), false


def test_with_a_baseline_a_flag_that_adds_5_percent_is_found_where_the_power_analysis_says():
    """The flag adds partings at 5% on top of the 3% both sides share: every watch is rolled back, at a median near
    ``to_detect_paired``'s prediction (every request compared both ways: ``aa_rate: 1``; at 0.1, ten times the
    shadowed requests)."""
    alpha = 0.1
    rng = random.Random(604)
    rule = Rule(limit=0, alpha=alpha, min_comparisons=20, aa_rate=1)
    found = [_watch(rule, 0.05, rng) for _ in range(60)]
    assert all(found), found
    predicted = to_detect_paired(1 - (1 - NOISE) * 0.95, NOISE, 0, alpha)
    assert predicted is not None
    median = sorted(found)[len(found) // 2]  # type: ignore[type-var]
    assert predicted / 2 <= median <= predicted * 2, (median, predicted)


def test_the_paired_statistic_at_limit_0_is_the_discordant_mixture_and_the_grid_meets_it():
    assert log_evalue_paired(7, 2, 300, 0) == log_evalue(7, 9, 0.5)
    for b, c, n in [(5, 1, 100), (20, 8, 500), (0, 3, 50)]:
        assert math.isclose(log_evalue_paired(b, c, n, 1e-9), log_evalue_paired(b, c, n, 0), abs_tol=1e-4)
    # concordant requests cost a rule with a limit and nothing without one
    assert log_evalue_paired(5, 1, 1000, 0.02) < log_evalue_paired(5, 1, 100, 0.02)
    assert log_evalue_paired(5, 1, 1000, 0) == log_evalue_paired(5, 1, 100, 0)


def test_the_baseline_enters_the_rule_and_its_digest_and_a_rule_without_it_reads_back_unchanged():
    old = {"limit": 0.0, "alpha": 0.05, "min_comparisons": 20, "stage_limits": {}}
    assert Rule.from_dict(old).to_dict() == old and not Rule.from_dict(old).baseline  # a batch from before the baseline
    with_aa = Rule.from_dict({**old, "aa_rate": 0.1})
    assert with_aa.to_dict() == {**old, "aa_rate": 0.1} and with_aa.digest() != Rule.from_dict(old).digest()


C = {**A, "limit": 0, "aa_rate": 0.5, "min_comparisons": 4, "batch": 4}


def test_a_a_counts_are_recorded_per_stage_and_read_back_by_ledger_live_and_metrics(workspace, keys, capsys):  # noqa: F811
    """Requests compared both ways, through the guard's own comparison (the proxy's path after the two flag-off
    answers): each batch's stage rows count the A/A comparisons and the discordant ones, the test is against the
    baseline, ``guard.live`` sums them, /metrics counts them; a flag that parts only where the flag-off side agrees
    with itself is rolled back, naming both counts."""
    from gatekeeper.traffic.live.guarded import Guarded
    from gatekeeper.traffic.live.shadow import Answer

    ws = _ws(workspace, keys, C)
    guard = _start(ws, keys)
    assert isinstance(guard, Guarded) and guard.rule.aa_rate == 0.5

    def a(text: str) -> Answer:
        return Answer(text, "stop", 3)

    async def go():
        # (A/B parted, A/A parted, stage): the writer stage is clean; in the router the flag-off side parts from
        # itself once; then the router's flag-on answers part where the flag-off side agrees with itself
        for ab, aa, stage in [(0, 0, "writer"), (0, 0, "writer"), (0, 1, "router"), (1, 1, "router"),
                              (0, 0, "router"), (0, 0, "router"), (0, 0, "router"), (0, 0, "router")]:
            guard._compare(stage, {"prompt": "hi"}, a("x" if ab else "o"), a("o"), a("y" if aa else "o"))
        await asyncio.sleep(0)
        for _ in range(40):
            guard._compare("router", {"prompt": "hi"}, a("x"), a("o"), a("o"))
            await asyncio.sleep(0)
        guard._compare("router", {"prompt": "hi"}, a("o"), a("o"))  # A/B only: counted, not in the baseline
        await guard.close()

    asyncio.run(go())
    shadows = _ledger(ws).shadows(FLAG)
    first = shadows[0]["summary"]
    assert first["rule"]["aa_rate"] == 0.5 and first["segment"]["rule_digest"] == Rule.from_dict(C).digest()
    assert first["stages"]["writer"] == {"compared": 2, "mismatches": 0, "unpaired": 0, "aa_compared": 2,
                                         "aa_mismatches": 0, "ab_only": 0, "aa_only": 0}
    assert first["stages"]["router"] == {"compared": 2, "mismatches": 1, "unpaired": 0, "aa_compared": 2,
                                         "aa_mismatches": 2, "ab_only": 0, "aa_only": 1}
    test = first["tests"][0]
    assert test["against"] == "baseline" and (test["aa_compared"], test["ab_only"], test["aa_only"]) == (4, 0, 1)
    assert not test["breached"]  # without a baseline (limit 0) the router's parting would be a breach here

    state = _ledger(ws).flag_states()[FLAG]
    assert guard.rollback is not None and state["state"] == "off", state
    assert "flag-off vs flag-off only" in state["reason"] and "rate <= the flag-off side's own + 0" in state["reason"]

    evidence = live(_ledger(ws), FLAG)
    assert evidence is not None
    router = evidence["stages"]["router"]
    assert (router["compared"], router["aa_compared"], router["aa_mismatches"], router["aa_only"]) == (47, 46, 2, 1)
    assert router["ab_only"] == router["mismatches"] - 1  # one A/B parting came with an A/A one
    assert (evidence["aa_compared"], evidence["aa_mismatches"]) == (48, 2) and 0 < evidence["aa_bound"] < 1
    assert evidence["segments"][0]["aa_compared"] == 48 and evidence["rolled_back"]
    assert "A/A baseline: 2 of 48" in line(evidence)
    from gatekeeper.cli.tables import print_live

    print_live(evidence)  # ledger live's table: the A/A columns beside A/B per stage
    shown = capsys.readouterr().out
    assert "A/A compared" in shown and re.search(r"router\D+47\D+\d+\D+0\D+46\D+2\b", shown), shown

    metrics = guard.metrics()
    assert 'gatekeeper_guard_aa_compared_total{flag="prefix_cache"} 48' in metrics
    assert 'gatekeeper_guard_aa_mismatches_total{flag="prefix_cache"} 2' in metrics
    assert 'gatekeeper_guard_discordant_total{flag="prefix_cache",only="aa"} 1' in metrics


# --- the live side's own health (issue #61) ------------------------------------------------------
def test_a_success_rate_floor_and_a_latency_ceiling_are_one_sample_tests_in_the_rules_split():
    from gatekeeper.gate.guard import SLOW, SUCCESS, Served

    rule = Rule(limit=0, alpha=0.05, min_comparisons=20, min_success_rate=0.9, max_latency_s=2.0, latency_share=0.01)
    tests = {t.scope: t for t in rule.tests({"router": Count(50, 0)}, served=Served(200, 40, 1))}
    assert set(tests) == {ALL, SUCCESS, SLOW} and all(math.isclose(t.alpha, 0.05 / 3) for t in tests.values())
    assert tests[SUCCESS].breached and not tests[SLOW].breached and not tests[ALL].breached  # 20% failed against 10%
    assert (tests[SUCCESS].compared, tests[SUCCESS].mismatches, tests[SUCCESS].limit) == (200, 40, pytest.approx(0.1))
    assert not any(t.breached for t in rule.tests({}, served=Served(200, 10, 1)))  # 5% failed, 0.5% slow: healthy
    assert [t.scope for t in rule.tests({}, served=Served(200, 0, 10)) if t.breached] == [SLOW]  # 5% over the ceiling
    assert not any(t.breached for t in rule.tests({}, served=Served(15, 15, 15)))  # min_comparisons counts requests
    assert "tv_bound" not in tests[SUCCESS].to_dict() and "tv_bound" in tests[ALL].to_dict()  # no answers compared
    plain = Rule(limit=0, alpha=0.05, min_comparisons=20)
    assert "min_success_rate" not in plain.to_dict() and Rule.from_dict(rule.to_dict()) == rule
    assert rule.digest() != plain.digest() and len(plain.tests({}, served=Served(200, 200, 200))) == 1


def test_false_rollbacks_on_the_live_sides_tests_at_their_floor_stay_under_alpha():
    """Failures at exactly the floor's rate and slow requests at exactly the allowed share (the worst case the null
    allows), a look after every batch of 16 requests, 2,000 requests per watch: the share of watches rolled back is
    at most alpha (within three standard errors of the simulation)."""
    from gatekeeper.gate.guard import Served

    alpha, runs = 0.1, 200
    rule = Rule(limit=0, alpha=alpha, min_comparisons=20, min_success_rate=0.95, max_latency_s=1.0, latency_share=0.05)
    rng = random.Random(61)

    def rolled_back() -> bool:
        served = Served()
        for _ in range(125):
            served.add(Served(16, sum(rng.random() < 0.05 for _ in range(16)), sum(rng.random() < 0.05 for _ in range(16))))
            if any(t.breached for t in rule.tests({}, served=served)):
                return True
        return False

    false = sum(rolled_back() for _ in range(runs))
    assert false / runs <= alpha + 3 * math.sqrt(alpha * (1 - alpha) / runs), false


D = {**A, "stages": {"router": 0}, "min_comparisons": 20, "min_success_rate": 0.9, "max_latency_s": 2.0}  # no shadows


@pytest.mark.parametrize("fault", ["none", "500 in 4", "slow in 10"])
def test_every_live_request_counts_toward_the_live_sides_tests_shadowed_or_not(workspace, keys, fault, capsys):  # noqa: F811
    """Through the guard's own entry for a finished live request (what the proxy calls): nothing is shadowed, yet a
    flag-on side that fails one request in four, or answers one in ten past the ceiling, is rolled back, naming the
    test; one that fails only client errors (4xx) and one request in twenty is not."""
    ws = _ws(workspace, keys, D)
    guard = _start(ws, keys)

    async def go():
        for i in range(400):
            status = 500 if fault == "500 in 4" and i % 4 == 0 else 503 if i % 20 == 0 else 404 if i % 7 == 0 else 200
            seconds = 3.0 if fault == "slow in 10" and i % 10 == 0 else 0.2
            guard.offer(None, "/v1/chat/completions", "router", {}, b"{}", status, None, False, seconds=seconds)
            if i % 16 == 15 and (f := guard.flush()) is not None:
                f.result()
        await guard.close()

    asyncio.run(go())
    state = _ledger(ws).flag_states()[FLAG]
    assert guard.totals["shadowed"] == 0
    if fault == "none":
        assert state["state"] == "on" and guard.rollback is None
        evidence = live(_ledger(ws), FLAG)
        assert evidence is not None and evidence["served"] == {"failed": 20, "slow": 0}, evidence
        assert "live requests 20 failed and 0 were slower than the ceiling" in line(evidence)  # (a quiet tail waits)
        assert 'gatekeeper_guard_failed_total{flag="prefix_cache"} 20' in guard.metrics()
        from gatekeeper.cli.tables import print_live

        print_live(evidence)  # ledger live: each of the live side's tests named for what it counts
        shown = capsys.readouterr().out
        assert "test, the live side's failures: rate <= 0.1" in shown and "the live side's slow requests" in shown, shown
        return
    assert state["state"] == "off" and guard.rollback is not None
    named = "success rate" if fault == "500 in 4" else "latency"
    assert f"the live side's {named}:" in state["reason"] and "live requests" in state["reason"], state["reason"]


# --- one test for a fleet (issue #61) -----------------------------------------------------------
def test_a_fleets_false_rollbacks_stay_under_alpha_however_many_proxies_look():
    """Three proxies, each writing batches of 16 comparisons at exactly the limit and looking at the fleet's counts
    after each of its own (interleaved as they land in the ledger): the share of watches with any rollback is at
    most alpha (within three standard errors). The looks are more; the process they look at is one."""
    alpha, runs, limit = 0.1, 200, 0.02
    rule = Rule(limit=limit, alpha=alpha, min_comparisons=20)
    rng = random.Random(613)

    def rolled_back() -> bool:
        fleet = Count()
        for _ in range(3 * 80):  # each of three proxies writes 80 batches, in an order the ledger decides
            fleet.add(Count(16, sum(rng.random() < limit for _ in range(16))))
            if rule.tests({"router": fleet})[0].breached:
                return True
        return False

    false = sum(rolled_back() for _ in range(runs))
    assert false / runs <= alpha + 3 * math.sqrt(alpha * (1 - alpha) / runs), false


F = {**A, "limit": 0.02, "min_comparisons": 10, "batch": 8}


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_three_guards_on_one_ledger_are_one_test_and_every_one_sees_the_rollback(workspace, keys, backend, request):  # noqa: F811
    """A fleet through the guard's own comparison path: three guards (three proxies in front of three replicas), one
    ledger (a SQLite file, or a real PostgreSQL server). The replica behind the first parts from the flag-off side on
    one request in four, the other two never: each guard's tests count every proxy's batches, so the defect is found
    on the fleet's comparisons and rolled back once, and the two others turn to the flag-off side on their next
    request without writing a batch; each batch names its proxy."""
    from gatekeeper.ledger import checkpoint
    from gatekeeper.signing import load_key
    from gatekeeper.traffic.live.guarded import Guarded
    from gatekeeper.traffic.live.shadow import Answer
    from gatekeeper.workspace import Workspace

    url = request.getfixturevalue("pg_url") if backend == "postgresql" else f"sqlite:///{workspace / 'ledger' / 'evidence.db'}"
    _set_guard(workspace, F)
    (workspace / "policies" / "allowed_signers").write_text(allowed_line("guard", keys["ci"]) + allowed_line("ana", keys["ana"]))
    with Ledger(url) as lg:
        lg.add_flip(FLAG, "on", "ana", "passed and approved")
        checkpoint.after_flip(Workspace(workspace), lg, None)
    fleet = [Guarded(Workspace(workspace), url, FLAG, "http://127.0.0.1:9", load_key(keys["ci"]), name=f"proxy-{n}")
             for n in range(3)]

    def a(text: str) -> Answer:
        return Answer(text, "stop", 3)

    said: dict[str, int] = {}

    async def go():
        for i in range(120):
            g = fleet[i % 3]  # round robin: the request after a rollback reaches another proxy
            if not g.current():
                said["stopped"] = i
                break
            g._compare("router", {"prompt": f"p{i}"}, a("x" if g is fleet[0] and i % 4 == 0 else "o"), a("o"))
            await asyncio.get_running_loop().run_in_executor(g.writer, lambda: None)  # its batch written, if one was due
            if any(x.rollback for x in fleet):
                said.setdefault("rolled", i)
        for g in fleet:
            await g.close()

    asyncio.run(go())
    assert said["stopped"] == said["rolled"] + 1, said  # the next request, on another proxy, saw the rollback
    with Ledger(url) as lg:
        flips = lg.flips(FLAG)
        batches = lg.shadows(FLAG)
    assert [f["state"] for f in flips] == ["on", "off"] and flips[1]["reason"].startswith("guard rollback"), flips
    assert sum(g.rollback is not None for g in fleet) == 1 and not any(g.on for g in fleet)
    assert {b["summary"]["proxy"] for b in batches} == {"proxy-0", "proxy-1", "proxy-2"}
    last = batches[-1]["summary"]["tests"][0]
    assert last["compared"] == sum(sum(r["compared"] for r in b["summary"]["stages"].values()) for b in batches), last
    own = sum(r["compared"] for b in batches if b["summary"]["proxy"] == batches[-1]["summary"]["proxy"]
              for r in b["summary"]["stages"].values())
    assert last["compared"] > own  # the test that breached counted the other proxies' comparisons too
    with Ledger(url) as lg:
        evidence = live(lg, FLAG)
    assert evidence is not None and set(evidence["proxies"]) == {"proxy-0", "proxy-1", "proxy-2"}
    from review_ledger import get, review

    with review(workspace, ledger=url) as u:  # the review app's Live page names the fleet's proxies
        page = get(u + "/live")[2]
    assert "ROLLED BACK" in page and all(f"proxy-{n}" in page for n in range(3)), page


def test_a_rollback_of_a_flip_another_proxy_already_ended_writes_nothing(workspace, keys):  # noqa: F811
    """Two proxies of a fleet breach at once: the flip off is made only while the watched flip is the flag's last
    (checked under the append's lock), so the second finds the first's rollback and writes nothing."""
    from gatekeeper.errors import Superseded

    ws = _ws(workspace, keys, A)
    with _ledger(ws) as lg:
        watched = lg.flag_states()[FLAG]["id"]
        lg.add_flip(FLAG, "off", "guard", "guard rollback: by the first proxy", after=watched)
        before = lg.entries()
        with pytest.raises(Superseded, match="flipped it since"):
            lg.add_flip(FLAG, "off", "guard", "guard rollback: by the second proxy", after=watched)
        assert lg.entries() == before
