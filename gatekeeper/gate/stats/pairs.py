"""Paired outcomes read from two runs: each assertion's outcome flag off and on, in the cluster its case falls in
(the policy's independence unit), per suite: what the paired bounds (``paired.py``) and the sequential rule judge.
"""

from __future__ import annotations

from ...battery import suites as battery
from ...evidence import Run
from . import paired


def pairs_of(items: list[battery.Item], off: Run, on: Run, cluster: str) -> dict[str, list[paired.Pair]]:
    """Per suite, each assertion's outcome flag off and on with its cluster (``cluster``: the policy's independence
    unit); a case missing from either run, or crashed there, has no outcomes to pair."""
    out: dict[str, list[paired.Pair]] = {}
    for item in items:
        a, b = off.get(item.case_id), on.get(item.case_id)
        if a is None or b is None or "crash" in a or "crash" in b:
            continue
        key = cluster_of(cluster, item)
        out.setdefault(item.suite.suite, []).extend(
            (key, x["pass"], y["pass"]) for x, y in zip(a["outcomes"], b["outcomes"]))
    return out


def cluster_of(key: str, item: battery.Item) -> str:
    """The cluster a case belongs to: itself, its suite, or the value of one of its vars (a case without that
    var is a cluster of its own)."""
    if key == "suite":
        return item.suite.suite
    if key.startswith("var:") and (name := key[4:]) in item.case.vars:
        return f"{name}={item.case.vars[name]}"
    return item.case_key
