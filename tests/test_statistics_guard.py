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
from pathlib import Path

from trust import allowed_line, keys  # noqa: F401

from gatekeeper.gate.guard import ALL, Count, Rule, live
from gatekeeper.ledger import Ledger

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
    from gatekeeper.traffic.guarded import Guarded
    from gatekeeper.workspace import Workspace

    return Guarded(Workspace(ws), f"sqlite:///{ws / 'ledger' / 'evidence.db'}", FLAG, "http://127.0.0.1:9", load_key(keys["ci"]))


def _feed(guard, *batches: tuple[int, int]) -> None:
    """Batches of (compared, mismatches) of the router stage, written as the proxy writes them; then a stop."""
    from gatekeeper.traffic.guarded import Batch

    async def go():
        for compared, mismatches in batches:
            guard.batch = Batch(requests=compared, shadowed=compared,
                                stages={"router": {"compared": compared, "mismatches": mismatches, "unpaired": 0}})
            await guard.flush()
        await guard.close()

    asyncio.run(go())


A = {"rate": 1, "limit": 0.02, "alpha": 0.05, "min_comparisons": 10}
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
