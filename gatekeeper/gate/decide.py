"""The decision: an evaluation's comparisons, heard by an ordered list of judges.

``evaluator`` runs the plan, compares every case (writing each comparison to the ledger) and hands the result here
as one ``Compared``; nothing here writes anything. Each judge reads it and the verdict so far and gives a ``Ruling``
(``evidence.py``): the verdict it forces, over which verdicts so far, its reasons and its notes. ``decide`` hears
them in ``JUDGES``' order, so the precedence of verdicts is this list and each ruling's ``over``, in one place
(docs/verdicts.md has it as a table):

- the first five decide whether there is a comparison and what the gate kind makes of it: the first that rules
  wins (each overrules only "no verdict yet");
- then the bounds on the kind's verdict, heard only where the comparison stands (no crash, a stable cold baseline);
- then what the draws and the reference arms show, which may overrule any verdict (a sampler that breaks, a base
  that is broken) or only a PASS (a bound still short);
- last the notes, which force nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..battery import suites as battery
from ..engines.base import Engine
from ..evidence import UNDECIDED, Ruling
from ..summaries import SuiteCensus
from ..workspace import MinedOn
from . import kinds
from .arms import controls as controls_
from .arms import independent
from .arms import probes as probes_
from .arms import reference as reference_
from .run import production
from .run.plans import Plan
from .stats import coupling, distance, pit, sequential, unpaired


@dataclass
class Compared:
    """An evaluation's comparisons, computed once: what every judge reads."""

    p: Plan
    models: dict[str, Engine]
    evidence: kinds.Evidence
    crashed: tuple[str, list[str]] | None  # the verdict and reasons crashes force (arms/crashes.py)
    variant: list[str]  # under a load: cases that part from themselves run alone (batching, or a seed it breaks)
    unstable: dict[str, str]  # case id -> why its flag-off runs parted
    probed: probes_.Judged | None  # the cache probes, judged
    baseline_cached: int | None  # prompt tokens the flag-off side served from a cache (0: cold; None: not said)
    rule: sequential.Sequential | None  # evaluate --max-cases/--max-seconds: the rule decides
    moved: distance.Compared | str | None  # the teacher-forced distance, or why it cannot be read
    read: reference_.Read | str | None  # the reference arm, or why it cannot be read
    coupled: coupling.Coupled | None  # sampled: the coupled steps
    ignored: Callable[[], list[str]]  # sampled: cases whose draws ignore their keys (read where the coupling judges)
    declared: dict[str, pit.Side] | None  # sampled: each side's draws against the declared decoding
    checked: controls_.Controls | None  # sampled: the control draws
    unkeyed: unpaired.Unpaired | None  # sampled: draws that do not follow their keys, compared by distribution
    tokens_compared: bool  # some answer was compared token by token
    strength: kinds.Strength | None
    census: dict[str, SuiteCensus]
    failed: list[str]  # steps after the cases that raised

    @property
    def stands(self) -> bool:
        """The comparison stands: nothing crashed and the baseline is stable and cold, so the kind decided."""
        return not (self.crashed or self.variant or self.unstable or (self.probed and self.probed.unstable)
                    or self.baseline_cached)


# --- whether there is a comparison, and the kind's verdict (the first that rules wins) ---------------------------
def crash(c: Compared, verdict: str | None) -> Ruling:
    """A crash on the flag-on side is a FAIL; on the flag-off side, no baseline (INCONCLUSIVE)."""
    return Ruling(*c.crashed, over=UNDECIDED) if c.crashed else Ruling()


def batch_variant(c: Compared, verdict: str | None) -> Ruling:
    """Under a load, a flag-off answer that parts from itself is batching's doing, not the flag's."""
    if not (c.variant or (c.unstable and c.p.load)):
        return Ruling()
    assert c.p.load is not None  # variant is found only under a load
    return Ruling("INCONCLUSIVE", c.variant + [
        f"batch_variant: {cid} gave different outputs on repeated flag-off runs under load (concurrency "
        f"{c.p.load.concurrency}); {production.fix(c.models['off'].dialect_name)}"
        for cid in c.unstable if not any(r.startswith((f"batch_variant: {cid} ", f"seed_batched: {cid} "))
                                         for r in c.variant)], over=UNDECIDED)


def baseline_unstable(c: Compared, verdict: str | None) -> Ruling:
    """Flag-off runs that part from each other (a probe's included) leave nothing to blame on the flag."""
    probed = c.probed.unstable if c.probed else []
    if not (c.unstable or probed):
        return Ruling()
    stale = [r for r in probed if r.startswith("stale_state:")]  # the cause, first
    return Ruling("INCONCLUSIVE", stale + list(c.unstable.values()) + [r for r in probed if r not in stale],
                  over=UNDECIDED)


def baseline_cached(c: Compared, verdict: str | None) -> Ruling:
    """A flag-off side served from a cache is no cold baseline."""
    if not c.baseline_cached:
        return Ruling()
    return Ruling("INCONCLUSIVE", [
        f"baseline_cached: the flag-off side ({c.p.configs['off'].profile.where}) reports {c.baseline_cached} prompt "
        "tokens served from a cache, so it is no cold baseline; point 'url' at a deployment with its prefix cache off "
        "(vLLM --no-enable-prefix-caching, mlx_lm.server --prompt-cache-size 0) or set 'cache_switch'"], over=UNDECIDED)


def kind(c: Compared, verdict: str | None) -> Ruling:
    """The gate kind's rule on the cases (its paired bound where it is judged from one); sequential: the rule."""
    if not c.stands:
        return Ruling()
    decided, reasons = c.p.kind.decide(c.evidence) if c.rule is None else c.p.kind.sequential(c.evidence, c.rule)
    if c.coupled and c.unkeyed and not c.crashed and not c.tokens_compared:
        reasons = [_uncompared(r) if r.startswith("equal:") else r for r in reasons]  # no answer compared by token
    return Ruling(decided, reasons, over=UNDECIDED)


# --- bounds on the kind's verdict, where the comparison stands -----------------------------------------------------
def probes_differ(c: Compared, verdict: str | None) -> Ruling:
    """A cache path the battery never takes answered differently with the flag on."""
    return Ruling("FAIL", c.probed.differs) if c.stands and c.probed and c.probed.differs else Ruling()


def bounded_distance(c: Compared, verdict: str | None) -> Ruling:
    """The distance as a reason; a PASS whose distance exceeds the policy's max_kld or min_same_top1 (net of the A/A
    floor) is a FAIL, and one whose distance cannot be read under such a bound is INCONCLUSIVE. An INCONCLUSIVE whose
    distance exceeds a bound beyond doubt (``Compared.beyond``, at the policy's alpha) is a FAIL: a change that moved
    the model that far is refused on a battery too small to count its flips."""
    moved, policy = c.moved, c.p.policy
    if not c.stands or moved is None:
        return Ruling()
    bound = distance.Bound(max_kld=policy.max_kld, min_same_top1=policy.min_same_top1)
    bounded = bound.max_kld is not None or bound.min_same_top1 is not None
    if isinstance(moved, str):  # unbounded, the record alone says so (every served evaluation would repeat it)
        if bounded and verdict == "PASS":
            return Ruling("INCONCLUSIVE", [f"not_observable: distance: {moved}, so the policy's bound on it cannot be "
                                           "checked"])
        return Ruling()
    if bounded and verdict == "PASS" and not (check := moved.within_floor(bound)).met:
        return Ruling("FAIL", [f"distance: {line}" for line in check.lines], [moved.reason()])
    if bounded and verdict == "INCONCLUSIVE" and (far := moved.beyond(bound, policy.alpha)):
        return Ruling("FAIL", [f"distance: {line}" for line in far], [moved.reason()])
    return Ruling(notes=[moved.reason()])


# --- what the draws and the reference arms show ---------------------------------------------------------------------
def sampling(c: Compared, verdict: str | None) -> Ruling:
    """Sampled: the coupled steps (draws that ignore their keys, a sampler reading other state, the TV bound), or
    where the draws cannot be paired, the two sides' distributions."""
    if not c.coupled or c.crashed:
        return Ruling()
    if c.unkeyed:  # no coupled steps and no control a shared key can make: the distributions decide
        return c.unkeyed.judge(c.p.kind.numeric, c.moved, c.declared is not None, c.p.policy.max_kld)
    return c.coupled.judge(verdict, c.ignored(), c.p.policy.max_tv)


def sampler_conformance(c: Compared, verdict: str | None) -> Ruling:
    """Sampled: each side's draws against the decoding it declares (the PIT checks)."""
    return pit.judge(c.declared, c.p.policy.alpha) if c.coupled and c.declared and not c.crashed else Ruling()


def controls(c: Compared, verdict: str | None) -> Ruling:
    """Sampled: the two control draws (a change the pairing must see)."""
    return c.checked.judge() if c.coupled and c.checked and not c.crashed and not c.unkeyed else Ruling()


def reference(c: Compared, verdict: str | None) -> Ruling:
    """The reference arm: each side's answers against a cache-free read of them."""
    return reference_.judge(c.read, _shared(c.p, c.models["off"]), c.models["off"].detokenize, c.p.kind.numeric)


def second_reference(c: Compared, verdict: str | None) -> Ruling:
    """A second, independent reference (transformers' read of the weights) against the engine's own."""
    read = c.read if isinstance(c.read, reference_.Read) else None
    return independent.judge(read.second if read else None, c.models["off"].detokenize)


def probe_base(c: Compared, verdict: str | None) -> Ruling:
    """A probe both sides fail: the base is broken, the flag's verdict void."""
    return Ruling("INCONCLUSIVE", c.probed.base) if c.probed and c.probed.base else Ruling()


# --- notes, which force nothing ----------------------------------------------------------------------------------
def notes(c: Compared, verdict: str | None) -> Ruling:
    """What the record should say beside the verdict: the probes, what could not be observed, blind telemetry,
    skipped cases, a battery blind to drift, suites mined elsewhere, steps that failed."""
    p, models = c.p, c.models
    out = c.probed.notes if c.probed else []
    why_no_probes = probes_.why_not(p) if p.policy.probes.kinds else None  # probes: off says so in the policy
    out += [c.probed.line()] if c.probed else [f"probes: none ran ({why_no_probes})"] if why_no_probes else []
    if p.exercises_cache and c.baseline_cached is None:
        out.append(f"not_observable: the flag-off side ({p.configs['off'].profile.where}) reports no cached-token "
                   "figure, so that it ran cold cannot be shown")
    out += list(dict.fromkeys(n for m in models.values() for n in m.notices))  # telemetry_suspect:, not_observable:
    out += _blind(p, models) + battery.skipped(p.items)
    # advice, not a failure: a battery far from every tie is blind to numeric drift in its outputs; not where the
    # top-2 logits matched exactly at every step (bit_exact): there was no drift for an output to show
    if p.kind.numeric and (c.strength is None or c.strength.grade != "bit_exact"):
        out += kinds.insensitive(c.census)
    out += _mined_elsewhere(p, models["off"])
    out += [f"step_failed: {f}; the verdict stands on the cases (a bug in gatekeeper where the error is in its code: "
            "please report it)" for f in c.failed]
    return Ruling(notes=out)


Judge = Callable[[Compared, "str | None"], Ruling]
JUDGES: list[Judge] = [crash, batch_variant, baseline_unstable, baseline_cached, kind,
                       probes_differ, bounded_distance,
                       sampling, sampler_conformance, controls, reference, second_reference, probe_base,
                       notes]


def decide(c: Compared, judges: list[Judge] = JUDGES) -> tuple[str, list[str]]:
    """Every judge's ruling, heard in order: the verdict and its reasons."""
    verdict: str | None = None
    reasons: list[str] = []
    for judge in judges:
        verdict, reasons = judge(c, verdict).on(verdict, reasons)
    assert verdict is not None  # the kind always rules where nothing before it did
    return verdict, reasons


def _uncompared(line: str) -> str:
    """The comparison's ``equal:`` line where no answer was compared token by token (unpaired draws): what it says of
    the cache stays."""
    return "; ".join(["equal: no answer compared token by token (the draws are unpaired)",
                      *(part for part in line.split("; ") if part.startswith("cache served"))])


def _shared(p: Plan, model: Engine) -> str:
    """The cache path a base defect is in: the flag-off side's engine, and its cache class where the profile names one."""
    impl = p.configs["off"].profile.options.get("cache_implementation")
    return f"the {model.name} engine of {p.configs['off'].profile.where}" + (f" (cache_implementation: {impl})" if impl else "")


def _mined_elsewhere(p: Plan, model: Engine) -> list[str]:
    """Advice for each mined suite scored on another engine than this one: its power was measured there."""
    here = MinedOn.of(model.identity())
    mined = {i.suite.suite: i.suite.mined_on for i in p.items if i.suite.mined_on is not None}
    return [f"mined_elsewhere: suite {name} was mined on {m.engine} (identity {m.identity[:12]}), "
            f"this evaluation runs {p.engine_name} (identity {here[:12]}): the sensitivity mining measured may not "
            f"carry over; re-mine here with gatekeeper battery mine --engine {p.engine_name}"
            for name, m in mined.items() if m.identity != here]


def _blind(p: Plan, models: dict[str, Engine]) -> list[str]:
    """An engine that does not report prompt or cached tokens hides the very cost caching refunds."""
    out = []
    for config, model in models.items():
        missing = [f for f in ("prompt_tokens", "cached_tokens") if f not in model.observes]
        if missing:
            out.append(f"telemetry_blind: the flag-{config} engine ({model.name}, {p.configs[config].profile.where}) "
                       f"reports no {' or '.join(m.replace('_', '-') for m in missing)} figures: a meter that reads "
                       "zero hides the prefill tax the cache refunds")
    return out
