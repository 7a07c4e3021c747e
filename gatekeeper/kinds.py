"""Gate kinds: what must hold between the flag-off and flag-on runs, and the verdict it gives.

``byte_equivalence``: token ids, text and assertion outcomes identical (and, for the cache flag,
the cache exercised); ``assertion_equivalence``: assertion outcomes identical; ``non_inferiority``:
no passing assertion lost beyond the policy's margin. Each kind is one object, looked up by the
policy's ``gate``; the gate runs the configurations, asks the kind to compare each case, then to decide.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

from deepdiff import DeepDiff

from .workspace import Policy

NEAR_TIE = 0.1  # a top-2 logit margin at or below this is a near-tie: a few ULPs can flip it

Decision = tuple[str, list[str]]


@dataclass
class Evidence:
    """What a kind decides on: the cases that differ and the figures of both sides."""

    cases: int
    differing: list[tuple[str, dict[str, Any]]]  # case id, its comparison
    passes: dict[str, int]  # assertions passed, flag off (first run) and on
    cached: int  # prompt tokens the flag-on side served from cache
    bound: int  # the stable-prefix bound of the flag-on side's prompts
    exercises_cache: bool  # the flag turns the prefix cache on: it must be shown to serve
    baseline_repeats: int

    @property
    def exercised(self) -> float:
        return min(1.0, self.cached / self.bound) if self.bound else 0.0


def _margin(step: list[list[float]] | None) -> float | None:
    return None if not step else float(step[0][1] - step[1][1])


def token_diff(a: dict[str, Any], b: dict[str, Any], detok: Callable[[list[int]], str]) -> dict[str, Any] | None:
    """None when token ids, text bytes and outcomes are identical; else where and how they part."""
    for n, (ta, tb) in enumerate(zip(a["turns"], b["turns"])):
        if ta["tokens"] == tb["tokens"] and ta["text"] == tb["text"]:
            continue
        pos = next((i for i, (x, y) in enumerate(zip(ta["tokens"], tb["tokens"])) if x != y),
                   min(len(ta["tokens"]), len(tb["tokens"])))
        side = {}
        for name, t in (("a", ta), ("b", tb)):
            token = t["tokens"][pos] if pos < len(t["tokens"]) else None
            top2 = t.get("top2") or []
            side[name] = {"token": token, "piece": detok([token]) if token is not None else None,
                          "margin": _margin(top2[pos] if pos < len(top2) else None)}
        margins = [s["margin"] for s in side.values() if s["margin"] is not None]
        return {
            "turn": n + 1,
            "first_divergent_position": pos,
            "a": side["a"], "b": side["b"],
            "near_tie": bool(margins) and min(margins) <= NEAR_TIE,
            "text_a": ta["text"], "text_b": tb["text"],
            "outcomes_diff": DeepDiff(a["outcomes"], b["outcomes"]).to_dict() if a["outcomes"] != b["outcomes"] else {},
        }
    if a["outcomes"] != b["outcomes"]:
        return {"turn": None, "outcomes_diff": DeepDiff(a["outcomes"], b["outcomes"]).to_dict()}
    return None


def outcome_diff(off: dict[str, Any], on: dict[str, Any]) -> dict[str, Any] | None:
    """None when every assertion has the same outcome; else which changed, and both texts."""
    changed = [{"assertion": a.get("name") or f"#{n + 1} {a['type']}", "off": a["pass"], "on": b["pass"]}
               for n, (a, b) in enumerate(zip(off["outcomes"], on["outcomes"])) if a["pass"] != b["pass"]]
    if not changed:
        return None
    return {"changed": changed, "text_a": off["text"], "text_b": on["text"],
            "outcomes_diff": DeepDiff(off["outcomes"], on["outcomes"]).to_dict()}


class GateKind:
    """How the flag-on run is compared with the flag-off one, and what verdict that gives."""

    name: ClassVar[str]

    def __init__(self, policy: Policy, sides: tuple[str, str] = ("flag off", "flag on")):
        self.policy = policy
        self.sides = sides  # how the reasons name the two configurations

    def compare(self, off: dict[str, Any], on: dict[str, Any], detok: Callable[[list[int]], str]) -> dict[str, Any] | None:
        return outcome_diff(off, on)

    def decide(self, e: Evidence) -> Decision:
        raise NotImplementedError


class ByteEquivalence(GateKind):
    name = "byte_equivalence"

    def compare(self, off, on, detok):
        return token_diff(off, on, detok)

    def decide(self, e: Evidence) -> Decision:
        floor = self.policy.exercise_floor.min_cached_share
        if e.differing:
            reasons = []
            for cid, d in e.differing:
                if d.get("turn") is None:
                    reasons.append(f"differs: {cid} assertion outcomes differ")
                else:
                    reasons.append(f"differs: {cid} turn {d['turn']} first divergent token at position {d['first_divergent_position']} "
                                   f"({d['a']['token']} vs {d['b']['token']}, margin {d['a']['margin']!s} vs {d['b']['margin']!s}"
                                   f"{', near-tie' if d['near_tie'] else ''})")
            return "FAIL", reasons
        same = (f"equal: all {e.cases} cases identical in token ids, text and assertion outcomes; "
                f"baseline stable over {e.baseline_repeats} runs")
        if not e.exercises_cache:
            return "PASS", [same]
        if e.cached == 0:
            return "INCONCLUSIVE", [f"not_exercised: the cache served 0 tokens of a {e.bound}-token stable-prefix bound"]
        if e.exercised < floor:
            return "INCONCLUSIVE", [f"not_exercised: the cache served {e.cached} of a {e.bound}-token stable-prefix bound "
                                    f"({e.exercised:.2f} < floor {floor})"]
        return "PASS", [f"{same}; cache served {e.exercised:.0%} of the stable-prefix bound"]


class AssertionEquivalence(GateKind):
    name = "assertion_equivalence"

    def decide(self, e: Evidence) -> Decision:
        off, on = self.sides
        if e.differing:
            return "FAIL", [f"differs: {cid} assertion {c['assertion']!r} {'passed' if c['off'] else 'failed'} {off}, "
                            f"{'passes' if c['on'] else 'fails'} {on}" for cid, d in e.differing for c in d["changed"]]
        return "PASS", [f"equal: all {e.cases} cases have the same assertion outcomes {off} and {on} "
                        f"({e.passes['off']} passed); baseline stable over {e.baseline_repeats} runs"]


class NonInferiority(GateKind):
    name = "non_inferiority"

    def decide(self, e: Evidence) -> Decision:
        # On-side passes = off passes - regressions + improvements, so bounding the regressions
        # by the margin also keeps the pass count from dropping by more than the margin allows.
        off, on = self.sides
        margin = self.policy.margin
        regressions = [(cid, c["assertion"]) for cid, d in e.differing for c in d["changed"] if c["off"]]
        allowed = math.floor(margin * e.passes["off"] + 1e-9)  # regressions the margin tolerates
        summary = (f"{len(regressions)} regressions (margin {margin:g} allows {allowed}); "
                   f"passes {e.passes['off']} {off}, {e.passes['on']} {on}")
        reasons = [f"regressed: {cid} assertion {name!r} passes {off}, fails {on}" for cid, name in regressions]
        if len(regressions) > allowed:
            return "FAIL", reasons + [f"inferior: {summary}"]
        return "PASS", reasons + [f"non_inferior: {summary}"]


KINDS: dict[str, type[GateKind]] = {k.name: k for k in (ByteEquivalence, AssertionEquivalence, NonInferiority)}
