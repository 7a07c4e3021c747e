"""The guard's rule: after a flip, does live evidence still say the flag holds?

Each shadowed request is one Bernoulli trial: the flag-on answer and the flag-off answer to the same request
(greedy, or sampled with a shared seed) differ or not. The guard tests H0 "the mismatch rate is at most
``limit``" sequentially, after every batch, for as long as the flag stays on, so its test must stay valid
however often it looks: the statistic is a mixture likelihood ratio (alternatives uniform on ``[limit, 1]``),
a nonnegative supermartingale under H0, and by Ville's inequality it reaches ``1/alpha`` with chance at most
``alpha`` over the whole life of the flag. A limit of 0 makes one mismatch a breach (a byte-identical flag).

Per-stage limits partition the comparisons: a stage with a limit of its own is tested against it only, and the
test ``ALL`` counts the other stages; with ``m`` tests in all, each runs at ``alpha/m`` (Bonferroni). A watch's rule
is recorded with its batches: batches written under one rule are one segment, tested under that rule only, at its
own share of alpha (half of what earlier segments left), so a rule tuned after the data is a new test and the
chance of any false rollback over the watch stays below ``alpha``. The TV bound reported beside the counts is
``coupling.upper_anytime`` on the same trials: under shared randomness P(answers differ) >= TV(answers).

A baseline (``aa_rate`` > 0): a batched live server and an idle shadow part for reasons that are not the flag (batch
composition, kernels chosen by shape), so a share of the shadowed requests goes to the flag-off side a second time,
and each such request is two trials: A/B (flag-on vs flag-off) parted or not, A/A (flag-off vs flag-off) parted or
not. The rule then tests H0 "p_AB <= p_AA + limit" on those paired requests: with Z = [A/B parted] - [A/A parted]
in {-1, 0, 1}, H0 says E[Z | the past] <= limit, so for every bet lam in [0, 1/(1+limit)] the product of
1 + lam (Z - limit) is a nonnegative supermartingale, and so is any average of such products over lam (``log_evalue_paired``).
With limit 0 the uniform average is the one-sample mixture at 1/2 on the discordant pairs (only A/B parted vs only
A/A parted), the existing ``log_evalue``; with limit > 0 it is a midpoint grid over lam, itself an average of
supermartingales, so valid exactly and not an approximation of one. Both statistics, and the requests a rate
needs to breach them (the power analysis a watch is sized with), are arithmetic in ``stats/evalues.py``.

The live side's own health (``min_success_rate``, ``max_latency_s``): every live request the flag-on side serves,
shadowed or not, is a trial of two more one-sample tests of the same kind, H0 "the failure rate is at most
1 - min_success_rate" and H0 "the share slower than max_latency_s is at most latency_share"; each is one more test
in the segment's Bonferroni split. They judge the flag-on side alone, as a canary analysis does, and need no
flag-off answer.

The evaluation's own comparisons (``assertion_limit``, ``max_kld``; ``traffic/live/judge.py``): a compared request that
is a suite case's, graded on both answers, is a trial of H0 "at most assertion_limit of graded requests lose a pass";
one read teacher-forced on both sides, of H0 "at most kld_limit of read requests depart beyond max_kld". Two more tests
of the same kind in the split.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping, cast

from .. import shadows as records
from ..identity import digest as content_digest
from .stats.evalues import log_evalue, log_evalue_paired

ALL = "*"  # the test over every stage without a limit of its own
KEPT = 20  # mismatched requests a summary shows (the counts hold them all)
AA = ("aa_compared", "aa_mismatches", "ab_only", "aa_only")  # a stage's A/A counts in a batch summary
FAILED = "flag_on_failed"  # a stage's count of live requests the flag-on side failed and the flag-off side answered
SUCCESS, SLOW = "success rate", "latency"  # the scopes of the live side's own tests
DISTANCE, ASSERTIONS = "distance", "assertions"  # the scopes of the evaluation's own comparisons on shadowed requests


@dataclass
class Count:
    compared: int = 0  # A/B: flag-on vs flag-off
    mismatches: int = 0
    paired: int = 0  # requests also compared A/A (flag-off vs flag-off): the baseline's trials
    aa_mismatches: int = 0  # of those, A/A parted
    ab_only: int = 0  # of those, A/B parted and A/A did not
    aa_only: int = 0  # of those, A/A parted and A/B did not

    def add(self, other: "Count") -> None:
        for name in ("compared", "mismatches", "paired", "aa_mismatches", "ab_only", "aa_only"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    @classmethod
    def of(cls, row: Mapping[str, int]) -> "Count":
        """A stage's row of a batch summary (the A/A fields absent where the watch had no baseline)."""
        return cls(row.get("compared", 0), row.get("mismatches", 0), row.get("aa_compared", 0),
                   row.get("aa_mismatches", 0), row.get("ab_only", 0), row.get("aa_only", 0))


@dataclass
class Served:
    """The live requests the flag-on side served: how many, how many it failed, how many took too long."""

    requests: int = 0
    failed: int = 0
    slow: int = 0

    def add(self, other: "Served") -> None:
        self.requests, self.failed, self.slow = self.requests + other.requests, self.failed + other.failed, self.slow + other.slow

    @classmethod
    def of(cls, summary: records.ShadowSummary) -> "Served":
        """A batch summary's (``served`` absent where the rule has no live-side test)."""
        served = summary.get("served", {})
        return cls(summary.get("requests", 0), served.get("failed", 0), served.get("slow", 0))


@dataclass
class Judged:
    """The evaluation's comparisons on compared requests: how many were read teacher-forced and departed (mean KL over
    max_kld), and how many matched a suite case, were graded on both sides and lost a pass on the flag-on side."""

    read: int = 0
    departed: int = 0
    graded: int = 0
    lost: int = 0

    def add(self, other: "Judged") -> None:
        for name in ("read", "departed", "graded", "lost"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    @classmethod
    def of(cls, summary: records.ShadowSummary) -> "Judged":
        """A batch summary's (``judged`` absent where nothing was read or graded)."""
        j = summary.get("judged", {})
        return cls(j.get("read", 0), j.get("departed", 0), j.get("graded", 0), j.get("lost", 0))


@dataclass
class Test:
    """One sequential test's state, for reports and metrics."""

    scope: str  # ALL or a stage
    limit: float
    alpha: float  # this test's share of the guard's alpha
    compared: int
    mismatches: int
    log_e: float
    breached: bool
    baseline: Count | None = None  # the paired counts, where the test is against the flag-off side's own rate

    @property
    def threshold(self) -> float:
        return math.log(1 / self.alpha)

    def to_dict(self) -> records.TestRecord:
        from .stats.coupling import upper_anytime  # here: status and the review read live evidence without the battery

        out: records.TestRecord = {"scope": self.scope, "limit": self.limit, "alpha": self.alpha, "compared": self.compared,
                           "mismatches": self.mismatches,
                           "log_e": round(self.log_e, 6) if math.isfinite(self.log_e) else "inf",
                           "log_threshold": round(self.threshold, 6), "breached": self.breached}
        if self.scope not in (SUCCESS, SLOW, DISTANCE, ASSERTIONS):  # a parting of answers: its TV bound
            out["tv_bound"] = round(upper_anytime(self.mismatches, self.compared, self.alpha), 6)
        if self.baseline is not None:
            b = self.baseline
            out["against"], out["aa_compared"], out["aa_mismatches"] = "baseline", b.paired, b.aa_mismatches
            out["ab_only"], out["aa_only"] = b.ab_only, b.aa_only
        return out


@dataclass
class Rule:
    """A policy's ``guard:`` as a decision: ``stage_limits`` for some stages, ``limit`` for every other stage; with
    ``aa_rate`` > 0 each limit is the mismatch rate tolerated above the flag-off side's own (the A/A baseline)."""

    limit: float
    alpha: float
    min_comparisons: int
    stage_limits: dict[str, float] = field(default_factory=dict)
    aa_rate: float = 0.0  # share of shadowed requests also compared A/A; 0: the one-sample rule against the limit alone
    min_success_rate: float | None = None  # the live side's floor; None: not tested
    max_latency_s: float | None = None  # the live side's ceiling, with the share of requests allowed over it
    latency_share: float = 0.01
    assertion_limit: float | None = None  # the share of graded requests that may lose a pass; None: not tested
    max_kld: float | None = None  # a read request departs above this mean KL; None: the distance is not tested
    kld_limit: float = 0.0  # the share of read requests that may depart

    @classmethod
    def of(cls, guard) -> "Rule":
        return cls(guard.limit, guard.alpha, guard.min_comparisons, dict(guard.stage_limits), guard.aa_rate,
                   guard.min_success_rate, guard.max_latency_s, guard.latency_share, guard.assertion_limit,
                   guard.max_kld, guard.kld_limit)

    @classmethod
    def from_dict(cls, d: records.RuleRecord) -> "Rule":
        return cls(d["limit"], d["alpha"], d["min_comparisons"], dict(d.get("stage_limits") or {}), d.get("aa_rate", 0.0),
                   d.get("min_success_rate"), d.get("max_latency_s"), d.get("latency_share", 0.01),
                   d.get("assertion_limit"), d.get("max_kld"), d.get("kld_limit", 0.0))

    @property
    def baseline(self) -> bool:
        return self.aa_rate > 0

    @property
    def live(self) -> bool:
        """Whether the rule tests the live side's own health (its batches then count failed and slow requests)."""
        return self.min_success_rate is not None or self.max_latency_s is not None

    def to_dict(self) -> records.RuleRecord:
        # floats and ints normalised: the YAML's ``limit: 0`` and the ledger's ``0.0`` are one rule, one digest;
        # aa_rate and the live side's tests left out while off, so a rule written before they existed keeps its digest
        out: records.RuleRecord = {"limit": float(self.limit), "alpha": float(self.alpha),
                           "min_comparisons": int(self.min_comparisons),
                           "stage_limits": {s: float(x) for s, x in sorted(self.stage_limits.items())}}
        if self.aa_rate:
            out["aa_rate"] = float(self.aa_rate)
        if self.min_success_rate is not None:
            out["min_success_rate"] = float(self.min_success_rate)
        if self.max_latency_s is not None:
            out["max_latency_s"], out["latency_share"] = float(self.max_latency_s), float(self.latency_share)
        if self.assertion_limit is not None:
            out["assertion_limit"] = float(self.assertion_limit)
        if self.max_kld is not None:
            out["max_kld"], out["kld_limit"] = float(self.max_kld), float(self.kld_limit)
        return out

    def digest(self) -> str:
        return content_digest(self.to_dict())

    def tests(self, counts: dict[str, Count], alpha: float | None = None, served: Served | None = None,
              judged: Judged | None = None) -> list[Test]:
        """Every test on ``counts`` (stage -> comparisons): one per stage with a limit of its own, and ALL on the other
        stages, so no comparison is tested twice, the live side's own tests on ``served`` and the evaluation's
        comparisons on ``judged`` (lost passes, departed distances); each at ``alpha/m`` (``alpha``: a segment's share,
        else the rule's). With a baseline each comparison test tests p_AB <= p_AA + its limit on the requests compared
        both ways, and ``min_comparisons`` counts those."""
        rest = Count()
        for stage, c in counts.items():
            if stage not in self.stage_limits:
                rest.add(c)
        scopes = [(ALL, self.limit, rest)] + [(s, lim, counts.get(s, Count())) for s, lim in sorted(self.stage_limits.items())]
        served = served or Served()
        health = [(SUCCESS, 1 - self.min_success_rate, served.failed)] if self.min_success_rate is not None else []
        health += [(SLOW, self.latency_share, served.slow)] if self.max_latency_s is not None else []
        judged = judged or Judged()
        trials: list[tuple[str, float, int, int]] = [(s, lim, served.requests, bad) for s, lim, bad in health]
        if self.assertion_limit is not None:
            trials.append((ASSERTIONS, self.assertion_limit, judged.graded, judged.lost))
        if self.max_kld is not None:
            trials.append((DISTANCE, self.kld_limit, judged.read, judged.departed))
        share = (self.alpha if alpha is None else alpha) / (len(scopes) + len(trials))
        out = []
        for scope, limit, c in scopes:
            if self.baseline:
                log_e, n = log_evalue_paired(c.ab_only, c.aa_only, c.paired, limit), c.paired
            else:
                log_e, n = log_evalue(c.mismatches, c.compared, limit), c.compared
            out.append(Test(scope, limit, share, c.compared, c.mismatches, log_e,
                            n >= self.min_comparisons and log_e >= math.log(1 / share), c if self.baseline else None))
        for scope, limit, n, bad in trials:  # one-sample tests of one more Bernoulli trial each
            log_e = log_evalue(bad, n, limit)
            out.append(Test(scope, limit, share, n, bad, log_e, n >= self.min_comparisons and log_e >= math.log(1 / share)))
        return out


@dataclass
class Segment:
    """The batches of a watch written under one rule (wherever they fall in it): a test of their own, at this
    segment's share of the watch's alpha. Segments are numbered in the order their rules first wrote."""

    index: int
    rule: Rule
    alpha: float  # half of what the segments before it left (a later rule's lower alpha lowers it further)
    left: float  # the watch's alpha left when the segment began
    counts: dict[str, Count] = field(default_factory=dict)
    served: Served = field(default_factory=Served)
    judged: Judged = field(default_factory=Judged)
    batches: list[int] = field(default_factory=list)

    def tests(self) -> list[Test]:
        return self.rule.tests(self.counts, self.alpha, self.served, self.judged)

    def record(self) -> records.SegmentMark:
        """What a batch says of its segment; ``new_test``: this batch starts it, no earlier batch is tested under it."""
        return {"index": self.index, "rule_digest": self.rule.digest(), "alpha": self.alpha, "alpha_left": self.left,
                "new_test": not self.batches}

    def to_dict(self) -> records.SegmentRecord:
        tests = self.tests()
        total = Count()
        for c in self.counts.values():
            total.add(c)
        # in the order it has always been written (optional keys among the others): checked at the boundary
        return cast(records.SegmentRecord, {
            "index": self.index, "rule_digest": self.rule.digest(), "rule": self.rule.to_dict(), "alpha": self.alpha,
            "alpha_left": self.left, "batches": self.batches[:1] + self.batches[-1:],
            "compared": total.compared, "mismatches": total.mismatches,
            **({"aa_compared": total.paired, "aa_mismatches": total.aa_mismatches} if self.rule.baseline else {}),
            **({"served": vars(self.served).copy()} if self.rule.live else {}),
            **({"judged": vars(self.judged).copy()} if self.judged != Judged() else {}),
            "breached": any(t.breached for t in tests), "tests": [t.to_dict() for t in tests]})


class Watch:
    """A watch's segments, built batch by batch in the ledger's order, whichever proxy of a fleet wrote each: one
    test for the fleet. The watch's alpha is its first rule's."""

    def __init__(self, batches: Iterable[records.ShadowBatch] = ()):
        self.by_rule: dict[str, Segment] = {}
        self.left: float | None = None
        self.seen = 0  # the last batch id folded in
        self.step = 0  # a rollout's step in force (gate/state/rollout.py): the last raise any batch recorded
        self.at_step: list[int] = []  # the batches since it began
        self.compared_at_step = 0  # their comparisons
        for b in batches:
            self.add(b)

    def segment(self, rule: Rule) -> Segment:
        """The segment of ``rule``, begun (empty) when no batch recorded it yet."""
        key = rule.digest()
        if key not in self.by_rule:
            self.left = rule.alpha if self.left is None else self.left
            share = min(rule.alpha, self.left) / 2  # half, so every later rule still has some alpha; the shares sum below it
            self.by_rule[key] = Segment(len(self.by_rule) + 1, rule, share, self.left)
            self.left -= share
        return self.by_rule[key]

    def add(self, b: records.ShadowBatch) -> None:
        """One batch as the ledger holds it, counted under the rule it recorded."""
        self.seen = max(self.seen, b["id"])
        self.stepped(b["id"], sum(c.compared for c in tally([b]).values()), b["summary"].get("raised"))
        if "rule" not in b["summary"]:  # the guard always records it; a batch written otherwise is under no rule
            return
        seg = self.segment(Rule.from_dict(b["summary"]["rule"]))
        seg.batches.append(b["id"])
        seg.served.add(Served.of(b["summary"]))
        seg.judged.add(Judged.of(b["summary"]))
        for stage, c in tally([b]).items():
            seg.counts.setdefault(stage, Count()).add(c)

    def stepped(self, batch_id: int, compared: int, raised: records.Raise | None) -> None:
        """A batch at the rollout's step in force: its comparisons count there; a raise it records begins the next."""
        if raised and raised.get("step", 0) > self.step:
            self.step, self.at_step, self.compared_at_step = raised["step"], [], 0
        else:
            self.at_step.append(batch_id)
            self.compared_at_step += compared

    @property
    def segments(self) -> list[Segment]:
        return list(self.by_rule.values())


def segments(batches: Iterable[records.ShadowBatch], rule: Rule | None = None) -> list[Segment]:
    """A watch's segments from its batches, oldest first, each batch counted under the rule it recorded; ``rule`` (the
    one in force now) gets an empty segment when no batch recorded it yet."""
    watch = Watch(batches)
    if rule is not None:
        watch.segment(rule)
    return watch.segments


def tally(batches: Iterable[records.ShadowBatch]) -> dict[str, Count]:
    """Stage -> comparisons, summed over shadow batches as the ledger holds them (``summary.stages``)."""
    out: dict[str, Count] = {}
    for batch in batches:
        for stage, c in batch["summary"]["stages"].items():
            out.setdefault(stage, Count()).add(Count.of(c))
    return out


def live(ledger, flag: str) -> records.LiveEvidence | None:
    """A flag's live evidence: the guard's batches for the newest flip to on it watched, summed; None when the
    guard never watched the flag. ``rolled_back``: the flip that ended the watch, when the guard made it."""
    from .stats.coupling import upper_anytime

    batches = ledger.shadows(flag) if ledger is not None else []
    if not batches:
        return None
    flip_id = batches[-1]["flip_id"]
    batches = [b for b in batches if b["flip_id"] == flip_id]
    stages: dict[str, dict[str, int]] = {}
    totals = {"requests": 0, "shadowed": 0}
    unpaired: dict[str, int] = {}
    dropped: dict[str, int] = {}
    shapes: dict[str, int] = {}
    served: dict[str, int] = {}  # the live side's failed and slow requests, where the rule tests them
    judged = Judged()  # the evaluation's comparisons: read teacher-forced, graded by a case's assertions
    proxies: dict[str, int] = {}  # a fleet's proxies: the batches each wrote
    for b in batches:
        s = b["summary"]
        if "proxy" in s:
            proxies[s["proxy"]] = proxies.get(s["proxy"], 0) + 1
        for name in totals:
            totals[name] += s.get(name, 0)
        for name, n in s.get("served", {}).items():
            served[name] = served.get(name, 0) + n
        judged.add(Judged.of(s))
        for stage, row in s["stages"].items():
            mine = stages.setdefault(stage, {"compared": 0, "mismatches": 0, "unpaired": 0})
            for name in dict.fromkeys((*mine, *AA, FAILED)):  # the A/A and failure counts where some batch has them
                if name in mine or name in row:
                    mine[name] = mine.get(name, 0) + row.get(name, 0)
        for into, key in ((unpaired, "unpaired"), (dropped, "dropped"), (shapes, "shapes")):
            for reason, n in s.get(key, {}).items():
                into[reason] = into.get(reason, 0) + n
    compared = sum(r["compared"] for r in stages.values())
    mismatches = sum(r["mismatches"] for r in stages.values())
    failed = sum(r.get(FAILED, 0) for r in stages.values())  # of the mismatches
    last = batches[-1]["summary"]
    alpha = last.get("rule", {}).get("alpha", 0.05)
    after = [f for f in ledger.flips(flag) if f["id"] > flip_id]
    ended = after[0] if after else None
    rollout = _rollout(batches, ended)
    baseline: dict[str, float] = {}
    if any(name in r for r in stages.values() for name in AA):  # the A/A baseline: flag-off vs flag-off
        aa = {name: sum(r.get(name, 0) for r in stages.values()) for name in AA}
        baseline = {**aa, "aa_bound": round(upper_anytime(aa["aa_mismatches"], aa["aa_compared"], alpha), 6)}
    ended_by: records.Ended | None = None if ended is None else {
        "id": ended["id"], "state": ended["state"], "operator": ended["operator"], "signer": ended.get("signer"),
        "reason": ended["reason"], "at": ended["at"]}
    # in the order ``ledger live --json`` has always printed it (optional keys among the others): checked at the boundary
    return cast(records.LiveEvidence, {
        "flag": flag, "flip_id": flip_id, "batches": [batches[0]["id"], batches[-1]["id"]], "since": batches[0]["at"],
        "until": batches[-1]["at"], **totals, **({"served": served} if served else {}),
        **({"judged": vars(judged)} if judged != Judged() else {}), "proxies": proxies, "compared": compared,
        "mismatches": mismatches, FAILED: failed, "tv_bound": round(upper_anytime(mismatches, compared, alpha), 6),
        "alpha": alpha, **baseline, "stages": stages, "unpaired": unpaired, "dropped": dropped, "shapes": shapes,
        "tests": last.get("tests", []), "rule": last.get("rule"), "segments": [seg.to_dict() for seg in segments(batches)],
        "mismatched": [i for b in batches for i in b["items"]][-KEPT:], "ended_by": ended_by,
        "rolled_back": bool(ended and ended["state"] == "off" and ended["reason"].startswith("guard rollback")),
        **({"rollout": rollout} if rollout else {})})


def _rollout(batches: list[records.ShadowBatch], ended: Mapping[str, object] | None) -> records.RolloutEvidence | None:
    """A rollout as the watch's batches record it: the steps, the step in force and its evidence, each signed raise,
    and what the next raise waits for (``gate/state/rollout.py``); None without one."""
    last = next((b["summary"]["rollout"] for b in reversed(batches) if "rollout" in b["summary"]), None)
    if last is None:
        return None
    raises: list[records.RaiseRow] = [{"step": r["step"], "share": r["share"], "from": r["from"], "compared": r["compared"],
                               "signer": r["signer"], "batch": b["id"], "at": b["at"]}
                              for b in batches if (r := b["summary"].get("raised"))]
    steps, step = last["steps"], last["step"]
    more = max(0, last["min_comparisons_per_step"] - last["compared_at_step"])
    following = ("ended" if ended is not None else "complete: every request" if step + 1 == len(steps) else
                 f"to {steps[step + 1]:.0%} after {more} more comparisons and {last['hold_s']:g} s at this step, "
                 "while no test is breached")
    return {**last, "raises": raises, "next": following}


def scope_of(scope: str) -> str:
    """A test's scope as a person reads it (``ledger live``, the review app): its stages, or which of the live side's
    own rates it counts."""
    return {ALL: "all stages", SUCCESS: "the live side's failures", SLOW: "the live side's slow requests",
            ASSERTIONS: "passes lost on graded requests", DISTANCE: "teacher-forced departures"}.get(scope, f"stage {scope}")


def line(evidence: records.LiveEvidence | None) -> str:
    """One line of live evidence for tables: what was compared and what it certifies."""
    if evidence is None:
        return "-"
    ended = " (rolled back)" if evidence["rolled_back"] else ""
    aa = (f"; A/A baseline: {evidence['aa_mismatches']} of {evidence['aa_compared']} flag-off answers parted from "
          "the flag-off side's own" if "aa_compared" in evidence else "")
    failed = f" ({evidence['flag_on_failed']} of them failed on the flag-on side)" if evidence["flag_on_failed"] else ""
    served = evidence.get("served")
    said = {"failed": "failed", "slow": "were slower than the ceiling"}
    health = (f"; of {evidence['requests']} live requests " + " and ".join(f"{n} {said[k]}" for k, n in served.items())
              if served else "")
    j = evidence.get("judged")
    health += (f"; {j['lost']} of {j['graded']} graded requests lost a pass, {j['departed']} of {j['read']} read "
               "teacher-forced departed" if j else "")
    ro = evidence.get("rollout")
    steps = (f"; rollout step {ro['step'] + 1} of {len(ro['steps'])} ({ro['share']:.0%} of requests), next: {ro['next']}"
             if ro else "")
    return (f"{evidence['compared']} compared, {evidence['mismatches']} parted{failed}, TV <= {evidence['tv_bound']:.3g} "
            f"at alpha {evidence['alpha']:g}{aa}{health}{steps}{ended}")
