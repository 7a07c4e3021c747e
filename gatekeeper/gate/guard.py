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
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable

from ..identity import digest as content_digest

ALL = "*"  # the test over every stage without a limit of its own
KEPT = 20  # mismatched requests a summary shows (the counts hold them all)


def log_evalue(k: int, n: int, limit: float) -> float:
    """log of the mixture statistic after ``k`` mismatches in ``n`` comparisons, against H0: rate <= ``limit``.

    E = (1/(1-p0)) * integral over p in [p0, 1] of (p/p0)^k ((1-p)/(1-p0))^(n-k) dp, and the integral of
    p^k (1-p)^(n-k) over [p0, 1] is B(k+1, n-k+1) P(Binomial(n+1, p0) <= k)."""
    if n == 0:
        return 0.0
    if limit <= 0:
        return math.inf if k else -math.log(n + 1)  # H0 is "never": one mismatch refutes it
    log_beta = math.lgamma(k + 1) + math.lgamma(n - k + 1) - math.lgamma(n + 2)
    lp, lq = math.log(limit), math.log1p(-limit)
    terms = [math.lgamma(n + 2) - math.lgamma(i + 1) - math.lgamma(n + 2 - i) + i * lp + (n + 1 - i) * lq
             for i in range(k + 1)]
    top = max(terms)
    log_tail = top + math.log(sum(math.exp(t - top) for t in terms))
    return log_beta + log_tail - lq - k * lp - (n - k) * lq


def to_detect(rate: float, limit: float, alpha: float, cap: int = 1_000_000) -> int | None:
    """Comparisons the test needs to breach when mismatches come at exactly ``rate`` (k = rate * n): the power
    analysis a test or an operator sizes a watch with. None where it never breaches within ``cap``."""
    if rate <= limit:
        return None
    threshold = math.log(1 / alpha)
    n = 1
    while n <= cap:
        if log_evalue(math.floor(rate * n), n, limit) >= threshold:
            # bisect back down between n/2 and n: the statistic grows with n at a fixed rate
            lo, hi = n // 2, n
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if log_evalue(math.floor(rate * mid), mid, limit) >= threshold else (mid, hi)
            return hi
        n *= 2
    return None


@dataclass
class Count:
    compared: int = 0
    mismatches: int = 0

    def add(self, other: "Count") -> None:
        self.compared += other.compared
        self.mismatches += other.mismatches


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

    @property
    def threshold(self) -> float:
        return math.log(1 / self.alpha)

    def to_dict(self) -> dict[str, Any]:
        from .coupling import upper_anytime  # here: status and the review read live evidence without the battery

        return {"scope": self.scope, "limit": self.limit, "alpha": self.alpha, "compared": self.compared,
                "mismatches": self.mismatches, "log_e": round(self.log_e, 6) if math.isfinite(self.log_e) else "inf",
                "log_threshold": round(self.threshold, 6), "breached": self.breached,
                "tv_bound": round(upper_anytime(self.mismatches, self.compared, self.alpha), 6)}


@dataclass
class Rule:
    """A policy's ``guard:`` as a decision: ``stage_limits`` for some stages, ``limit`` for every other stage."""

    limit: float
    alpha: float
    min_comparisons: int
    stage_limits: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, guard) -> "Rule":
        return cls(guard.limit, guard.alpha, guard.min_comparisons, dict(guard.stage_limits))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Rule":
        return cls(d["limit"], d["alpha"], d["min_comparisons"], dict(d.get("stage_limits") or {}))

    def to_dict(self) -> dict[str, Any]:
        # floats and ints normalised: the YAML's ``limit: 0`` and the ledger's ``0.0`` are one rule, one digest
        return {"limit": float(self.limit), "alpha": float(self.alpha), "min_comparisons": int(self.min_comparisons),
                "stage_limits": {s: float(x) for s, x in sorted(self.stage_limits.items())}}

    def digest(self) -> str:
        return content_digest(self.to_dict())

    def tests(self, counts: dict[str, Count], alpha: float | None = None) -> list[Test]:
        """Every test on ``counts`` (stage -> comparisons): one per stage with a limit of its own, and ALL on the other
        stages, so no comparison is tested twice; each at ``alpha/m`` (``alpha``: a segment's share, else the rule's)."""
        rest = Count()
        for stage, c in counts.items():
            if stage not in self.stage_limits:
                rest.add(c)
        scopes = [(ALL, self.limit, rest)] + [(s, lim, counts.get(s, Count())) for s, lim in sorted(self.stage_limits.items())]
        share = (self.alpha if alpha is None else alpha) / len(scopes)
        out = []
        for scope, limit, c in scopes:
            log_e = log_evalue(c.mismatches, c.compared, limit)
            out.append(Test(scope, limit, share, c.compared, c.mismatches, log_e,
                            c.compared >= self.min_comparisons and log_e >= math.log(1 / share)))
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
    batches: list[int] = field(default_factory=list)

    def tests(self) -> list[Test]:
        return self.rule.tests(self.counts, self.alpha)

    def record(self) -> dict[str, Any]:
        """What a batch says of its segment; ``new_test``: this batch starts it, no earlier batch is tested under it."""
        return {"index": self.index, "rule_digest": self.rule.digest(), "alpha": self.alpha, "alpha_left": self.left,
                "new_test": not self.batches}

    def to_dict(self) -> dict[str, Any]:
        tests = self.tests()
        return {"index": self.index, "rule_digest": self.rule.digest(), "rule": self.rule.to_dict(), "alpha": self.alpha,
                "alpha_left": self.left, "batches": self.batches[:1] + self.batches[-1:],
                "compared": sum(c.compared for c in self.counts.values()),
                "mismatches": sum(c.mismatches for c in self.counts.values()),
                "breached": any(t.breached for t in tests), "tests": [t.to_dict() for t in tests]}


def segments(batches: Iterable[dict[str, Any]], rule: Rule | None = None) -> list[Segment]:
    """A watch's segments from its batches, oldest first, each batch counted under the rule it recorded; ``rule`` (the
    one in force now) gets an empty segment when no batch recorded it yet. The watch's alpha is its first rule's."""
    out: dict[str, Segment] = {}
    left: float | None = None

    def of(r: Rule) -> Segment:
        nonlocal left
        key = r.digest()
        if key not in out:
            left = r.alpha if left is None else left
            share = min(r.alpha, left) / 2  # half, so every later rule still has some alpha; the shares sum below it
            out[key] = Segment(len(out) + 1, r, share, left)
            left -= share
        return out[key]

    for b in batches:
        if "rule" not in b["summary"]:  # the guard always records it; a batch written otherwise is under no rule
            continue
        seg = of(Rule.from_dict(b["summary"]["rule"]))
        seg.batches.append(b["id"])
        for stage, c in tally([b]).items():
            seg.counts.setdefault(stage, Count()).add(c)
    if rule is not None:
        of(rule)
    return list(out.values())


def tally(batches: Iterable[dict[str, Any]]) -> dict[str, Count]:
    """Stage -> comparisons, summed over shadow batches as the ledger holds them (``summary.stages``)."""
    out: dict[str, Count] = {}
    for batch in batches:
        for stage, c in batch["summary"]["stages"].items():
            out.setdefault(stage, Count()).add(Count(c.get("compared", 0), c.get("mismatches", 0)))
    return out


def live(ledger, flag: str) -> dict[str, Any] | None:
    """A flag's live evidence: the guard's batches for the newest flip to on it watched, summed; None when the
    guard never watched the flag. ``rolled_back``: the flip that ended the watch, when the guard made it."""
    from .coupling import upper_anytime

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
    for b in batches:
        s = b["summary"]
        for name in totals:
            totals[name] += s.get(name, 0)
        for stage, row in s["stages"].items():
            mine = stages.setdefault(stage, {"compared": 0, "mismatches": 0, "unpaired": 0})
            for name in mine:
                mine[name] += row.get(name, 0)
        for into, key in ((unpaired, "unpaired"), (dropped, "dropped"), (shapes, "shapes")):
            for reason, n in s.get(key, {}).items():
                into[reason] = into.get(reason, 0) + n
    compared = sum(r["compared"] for r in stages.values())
    mismatches = sum(r["mismatches"] for r in stages.values())
    last = batches[-1]["summary"]
    alpha = last.get("rule", {}).get("alpha", 0.05)
    after = [f for f in ledger.flips(flag) if f["id"] > flip_id]
    ended = after[0] if after else None
    return {"flag": flag, "flip_id": flip_id, "batches": [batches[0]["id"], batches[-1]["id"]], "since": batches[0]["at"],
            "until": batches[-1]["at"], **totals, "compared": compared, "mismatches": mismatches,
            "tv_bound": round(upper_anytime(mismatches, compared, alpha), 6), "alpha": alpha, "stages": stages,
            "unpaired": unpaired, "dropped": dropped, "shapes": shapes, "tests": last.get("tests", []),
            "rule": last.get("rule"), "segments": [seg.to_dict() for seg in segments(batches)], "mismatched": [i for b in batches for i in b["items"]][-KEPT:],
            "ended_by": None if ended is None else {k: ended.get(k) for k in ("id", "state", "operator", "signer", "reason", "at")},
            "rolled_back": bool(ended and ended["state"] == "off" and ended["reason"].startswith("guard rollback"))}


def line(evidence: dict[str, Any] | None) -> str:
    """One line of live evidence for tables: what was compared and what it certifies."""
    if evidence is None:
        return "-"
    ended = " (rolled back)" if evidence["rolled_back"] else ""
    return (f"{evidence['compared']} compared, {evidence['mismatches']} parted, TV <= {evidence['tv_bound']:.3g} "
            f"at alpha {evidence['alpha']:g}{ended}")
