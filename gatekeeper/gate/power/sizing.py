"""The cases a margin needs (``gatekeeper battery size``): from the discordance of the flag's last evaluation (or
one named), else assuming none, the assertion pairs and cases the policy's margin needs at its power and at the alpha
the next look at the change will spend (``stats/looks.py``: alpha/2 for a first evaluation, alpha/4 after one look, ...),
and the smallest margin the battery supports now. Before a run it sizes the battery; after one it says what the
evidence could have detected."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from ...errors import GatekeeperError
from ...evidence import EvaluationRecord
from ...workspace import Workspace
from .. import planning
from ..stats import looks, paired
from ..stats.pairs import cluster_of


@dataclass
class Sizing:
    flag: str
    margin: float
    alpha: float  # what the next look spends: the policy's alpha at its share (``looks.allotted``)
    power: float
    evaluation_id: int | None  # whose discordance was used; None: none yet, no discordance assumed
    pairs: int  # assertion pairs it had (or the battery has, without an evaluation)
    cases: int
    discordance: float  # (harmful + beneficial) / pairs
    deff: float  # the design effect of its clusters
    needed_pairs: int | None  # None: no number of cases can show this margin (margin at or below the loss)
    needed_cases: int | None
    supported_margin: float  # the smallest margin these pairs support at this discordance
    look: int = 1  # the look at the change it sizes for (1: its first evaluation)
    policy_alpha: float = 0.0  # what all looks at the change spend together

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def line(self) -> str:
        source = (f"evaluation {self.evaluation_id}'s discordance {self.discordance:.3f}" if self.evaluation_id is not None
                  else "no evaluation yet: no discordance assumed (the fewest cases any margin needs)")
        needs = ("no finite number of cases (the observed loss reaches the margin)" if self.needed_cases is None
                 else f"{self.needed_pairs} assertion pairs, about {self.needed_cases} cases")
        look = (f"alpha {self.alpha:.4g} (look {self.look} at this change, of the policy's {self.policy_alpha:g})"
                if self.alpha != self.policy_alpha else f"alpha {self.alpha:g}")
        return (f"{self.flag}: margin {self.margin:g} at {look}, power {self.power:g} needs {needs} "
                f"(from {source}); the {self.cases} cases here ({self.pairs} pairs) support a margin of "
                f"{self.supported_margin:.3f}")


def size(ws: Workspace, flag: str, margin: float | None = None, evaluation: EvaluationRecord | None = None,
         look: int = 1) -> Sizing:
    """``evaluation``: the flag's evaluation whose outcomes give the discordance; None sizes the battery as it is.
    ``look``: the look at the change to size for (``looks.following``); it spends its share of the policy's alpha."""
    policy = ws.policy(flag)
    if policy.gate == "byte_equivalence":
        raise GatekeeperError(f"{flag} is gated by byte_equivalence: no difference is allowed, so there is no margin to "
                              "size; battery size is for non_inferiority and assertion_equivalence policies")
    m = policy.margin if margin is None else margin
    if not 0 <= m <= 1:
        raise GatekeeperError(f"--margin {m}: a margin is a share of assertions, from 0 to 1")
    if evaluation is not None:
        if evaluation["flag"] != flag:
            raise GatekeeperError(f"evaluation {evaluation['id']} is for {evaluation['flag']!r}, not {flag!r}")
        config = evaluation["config"]
        items = planning.read_battery(ws, config.get("suites"), config.get("limit"), True)[0]
        clusters = {i.case_id: cluster_of(policy.cluster, i) for i in items}
        pairs = [(clusters.get(cid, cid), off, on) for cid, off, on in _pairs(evaluation)]
    else:
        items = planning.read_battery(ws, None, None, True)[0]
        pairs = [(cluster_of(policy.cluster, i), True, True) for i in items for _ in i.case.assert_]
    if not pairs:
        raise GatekeeperError(f"no assertions to size: the battery{' of evaluation ' + str(evaluation['id']) if evaluation else ''} "
                              "has none; add assertions to the cases in assertions/")
    alpha = looks.allotted(look, policy.alpha) if looks.judged_by_bound(policy.gate, m) else policy.alpha
    verdict = paired.decide(pairs, m, alpha, policy.power)
    cases = len({c for c, _, _ in pairs})  # clusters: cases, unless the policy's cluster is coarser
    needed = None if math.isinf(verdict.needed) else int(verdict.needed)
    return Sizing(flag, m, alpha, policy.power, evaluation["id"] if evaluation else None, len(pairs), cases,
                  round((verdict.harmful + verdict.beneficial) / len(pairs), 6), round(verdict.deff, 4), needed,
                  None if needed is None else math.ceil(needed * cases / len(pairs)), round(verdict.supported_margin, 6),
                  look, policy.alpha)


@dataclass
class Coupled:
    """The samples a total-variation bound needs in every position class and stage (sampled suites,
    ``gate/stats/coupling.py``): each class's bound at alpha/m, so the class that needs the most samples sizes them."""

    flag: str
    max_tv: float
    alpha: float
    evaluation_id: int | None  # whose coupled steps were used; None: the battery's max_tokens, no mismatch assumed
    cases: int
    steps_per_answer: float  # all classes pooled
    mismatch_rate: float  # all classes pooled
    needed_steps: int | None  # in the binding class; None: at its mismatch rate no number of samples brings it under
    samples_per_case: int | None
    classes: int = 1  # m: the classes bounded, each at alpha/m
    binding: str | None = None  # the class that needs the most samples (or can never get under max_tv)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def line(self) -> str:
        source = (f"evaluation {self.evaluation_id}: {self.steps_per_answer:.1f} coupled steps per answer, "
                  f"mismatch rate {self.mismatch_rate:.3g}" if self.evaluation_id is not None
                  else f"no sampled evaluation yet: {self.steps_per_answer:.0f} steps per answer, no mismatch assumed")
        if self.needed_steps is None:
            return (f"{self.flag}: no number of samples bounds the mean per-step total variation in {self.binding} at "
                    f"{self.max_tv:g} (from {source}: the sides part more often than that there)")
        return (f"{self.flag}: a mean per-step total variation of at most {self.max_tv:g} in every position class and stage "
                f"at alpha {self.alpha:g} ({self.classes} classes, each at alpha/{self.classes}) needs "
                f"{self.needed_steps} coupled steps in {self.binding}: {self.samples_per_case} samples per case over "
                f"the {self.cases} sampled cases (from {source})")


def coupled(ws: Workspace, flag: str, max_tv: float | None, evaluation: EvaluationRecord | None = None) -> Coupled:
    """The samples per case the policy's (or ``max_tv``) bound needs in every class: at each class's coupled steps
    per answer and mismatch rate in ``evaluation``, else with answers of the suites' ``max_tokens`` and no mismatch
    (each position class a third of them)."""
    from ..stats.coupling import THIRDS, steps_needed

    policy = ws.policy(flag)
    limit = max_tv if max_tv is not None else policy.max_tv
    if limit is None or not 0 < limit < 1:
        raise GatekeeperError(f"--max-tv {limit}: give the total-variation bound to size for, above 0 and "
                              "below 1 (or set max_tv in the policy)")
    items = [i for i in planning.read_battery(ws, None, None, True)[0] if i.suite.decoding.sampled and i.sample == 0]
    if not items:
        raise GatekeeperError("no suite samples: a total-variation bound is for suites whose decoding sets a temperature "
                              "above 0 (see docs/sampling.md)")
    stages: dict[str, list[Any]] = {}
    for i in items:
        stages.setdefault(i.suite.stage, []).append(i)
    verdict: Any = evaluation.get("verdict_record") if evaluation else None
    s = ((verdict or {}).get("summary") or {}).get("sampling") or {}
    # each class: (name, coupled steps per answer, mismatch rate, the battery's cases it draws from)
    rows: list[tuple[str, float, float, int]]
    if s.get("steps") and s.get("answers"):
        per, rate, source = s["steps"] / s["answers"], s["mismatches"] / s["steps"], evaluation
        rows = [(c["class"], c["steps"] / c["answers"] if c["answers"] else 0.0,
                 c["mismatches"] / c["steps"] if c["steps"] else 1.0,
                 len(stages.get(c["class"][len("stage "):], [])) if c["class"].startswith("stage ") else len(items))
                for c in s.get("classes") or []]
        if not rows:  # recorded before the classes: its pooled rate in each third
            rows = [(f"position third {k + 1}", per / THIRDS, rate, len(items)) for k in range(THIRDS)]
    else:
        per, rate, source = sum(i.suite.decoding.max_tokens for i in items) / len(items), 0.0, None
        rows = [(f"position third {k + 1}", per / THIRDS, 0.0, len(items)) for k in range(THIRDS)]
        if len(stages) > 1:
            rows += [(f"stage {st}", sum(i.suite.decoding.max_tokens for i in its) / len(its), 0.0, len(its))
                     for st, its in stages.items()]
    m = len(rows)
    binding, needed_steps, samples_per_case = rows[0][0], None, 0
    for name, steps, r, cases in rows:
        needed = steps_needed(r, limit, policy.alpha / m) if steps and cases else None
        if needed is None:  # this class never gets under the limit: nothing sizes the rest
            binding, needed_steps, samples_per_case = name, None, 0
            break
        samples = max(1, math.ceil(needed / steps / cases))
        if samples > samples_per_case:
            binding, needed_steps, samples_per_case = name, needed, samples
    return Coupled(flag, limit, policy.alpha, source["id"] if source else None, len(items), round(per, 3),
                   round(rate, 6), needed_steps, samples_per_case if needed_steps is not None else None, m, binding)


def _pairs(evaluation: EvaluationRecord) -> list[paired.Pair]:
    """Each assertion's outcome in the evaluation's first flag-off and flag-on runs, by case id."""
    runs = {(r["config"], r["case_id"]): r["result"] for r in evaluation["case_results"] if r["repeat"] == 0}
    out = []
    for (config, cid), off in runs.items():
        on = runs.get(("on", cid))
        if config != "off" or on is None or cid.startswith("probe:") or "crash" in off or "crash" in on:
            continue
        out += [(cid, a["pass"], b["pass"]) for a, b in zip(off["outcomes"], on["outcomes"])]
    return out
