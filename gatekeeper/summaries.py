"""The summaries the gate hands to the reports: what a verdict's ``summary`` holds, and the calibration, approval and
flip rows beside it.

Open this module to learn what a report may read. Each summary is a ``TypedDict``: at run time the plain dict the
gate's ``to_dict`` methods return and the ledger stores as canonical JSON, so a typed summary is written and read
exactly as before. A key marked ``NotRequired`` is absent from some rows (written only where it applies, or absent
from rows an earlier release wrote): read it with ``.get``. ``evidence`` holds the records these summarise (turns,
case results, comparisons).

Producers: ``gate.evaluator`` (``Outcome.to_dict``), ``gate.kinds`` (strength), ``gate.stats`` (paired,
sequential, looks, distance, coupling, pit, unpaired), ``gate.arms`` (reference, controls), ``gate.power``
(calibration). Readers: the reports, the review app, the CLI's tables, ``gate.stats.looks``.

Imports: the standard library only.
"""

from __future__ import annotations

import sys
from typing import Literal, Union, final

# the one place that picks them, for every module of records (re-exported)
if sys.version_info >= (3, 11):
    from typing import NotRequired as NotRequired
    from typing import TypedDict as TypedDict
else:  # importing typing_extensions costs every CLI start 20 ms: only where typing lacks these
    from typing_extensions import NotRequired as NotRequired
    from typing_extensions import TypedDict as TypedDict


# --- the outcome's figures ------------------------------------------------------------------------------------


class Step(TypedDict):
    """A generated step: the case, the turn (from 1) and the step (from 0)."""

    case: str
    turn: int
    step: int


class SuiteCensus(TypedDict):
    """Per suite, the flag-off baseline's decode steps and how near a tie they came."""

    steps: int  # steps with a known top-2 margin
    near_ties: int  # of those, margins at or below kinds.NEAR_TIE
    min_margin: float | None
    unknown: int  # steps without top-2 logits


class StageTelemetry(TypedDict):
    """Per stage, what one side's calls cost, as its engine reports it."""

    calls: int
    prompt_tokens: int
    cached_tokens: int | None  # None once a call did not report it
    prefill_s: float
    decode_s: float
    prefill_share: NotRequired[float | None]  # prefill over model seconds; None when there were none


class Tokens(TypedDict):
    """An outcome's prompt-token figures: the tax with the flag off, what the flag-on side computed and reused."""

    prompt_off: int
    computed_on: int | None  # None where the flag-on engine reports no cached tokens
    cached_on: int | None
    stable_prefix_bound: int


class NotObservable(TypedDict):
    """A summary the engine could not give: why (``not_observable:``)."""

    not_observable: str


# --- strength (gate/kinds.py) ---------------------------------------------------------------------------------


class Flips(TypedDict):
    """The assertion outcome pairs and their flips (``paired.flip_counts``)."""

    pairs: int
    harmful: int
    beneficial: int


class StrengthSummary(TypedDict):
    """``kinds.Strength``: how close equal outputs came to parting."""

    grade: str | None  # bit_exact | equal_outputs; None when the outputs differ
    max_drift: float | None
    where: Step | None
    steps_at_risk: int
    steps: int
    unknown: int
    unknown_where: Step | None
    flips: NotRequired[Flips | None]  # absent from rows written before flips were counted


# --- paired and sequential verdicts (gate/stats/paired.py, sequential.py, looks.py) -----------------------------


@final
class PairedSummary(TypedDict):
    """``paired.Paired``: the loss in pass rate with the flag on, its bounds, and what they decide."""

    test: str  # non_inferiority | equivalence | exact
    n: int
    clusters: int
    harmful: int
    beneficial: int
    loss: float
    lower: float
    upper: float
    deff: float
    method: str
    margin: float
    alpha: float
    power: float
    verdict: str  # pass | fail | underpowered
    needed: int | None  # None: no finite number of pairs
    supported_margin: float
    unit: str
    reason: str


@final
class SuitesSummary(TypedDict):
    """``paired.Suites``: per-suite verdicts under a Bonferroni correction."""

    verdict: str
    alpha: float
    corrected_alpha: float
    suites: dict[str, PairedSummary]
    unjudged: list[str]


Statistics = Union[PairedSummary, SuitesSummary]  # what a kind judged on paired outcomes records


@final
class SequentialSummary(TypedDict):
    """``sequential.Sequential``: an anytime-valid rule where it stopped."""

    rule: str
    test: str
    method: str
    alpha: float
    margin: float
    cap: float
    prior_variance: float
    seed: int | None
    max_cases: int | None
    max_seconds: float | None
    battery_cases: int | None
    cases: int
    clusters: int
    unit: str
    pairs: int
    harmful: int
    beneficial: int
    loss: float
    lower: float
    upper: float
    decision: str
    stopped: str | None
    seconds: float | None
    reason: str


class LookSummary(TypedDict):
    """``looks.Look``: which look at its change an evaluation is, and the alpha it spends."""

    index: int
    of_change: list[int]
    alpha: float
    alpha_spent: float
    change: str
    schedule: str


# --- teacher-forced distance (gate/stats/distance.py) ---------------------------------------------------------


class Quantiles(TypedDict):
    """``distance.Summary``: one per-position statistic's mean ± standard error and quantiles."""

    mean: float
    se: float
    min: float
    p1: float
    p10: float
    median: float
    p90: float
    p95: float
    p99: float
    p999: float
    max: float


class DistanceFigures(TypedDict):
    """``distance.Distance``: A against B over teacher-forced positions."""

    positions: int
    kld: Quantiles
    same_top1: float
    same_top1_se: float
    delta_p: Quantiles
    delta_p_rms: float
    delta_p_rms_se: float
    ln_ppl_ratio: float
    ln_ppl_ratio_se: float
    approximation: str | None
    worst: list[list[float]]
    tv_max: NotRequired[float | None]


class Compared(TypedDict):
    """``distance.Compared``: A against B, and A against a repeat of A (the floor)."""

    distance: DistanceFigures
    floor: DistanceFigures | None
    seconds: NotRequired[float]
    caveat: NotRequired[str]


class DistanceSummary(Compared):
    """The distance as the outcome records it: with its reason."""

    reason: str


# --- the reference arm (gate/arms/reference.py, independent.py) -------------------------------------------------


class DepartureRecord(TypedDict):
    """``reference.Departure``: one generated position where an arm parts from the reference."""

    case: str
    turn: int
    position: int
    emitted: int
    reference: int
    margin: float
    gap: float


class ArmSummary(TypedDict):
    """``reference.Arm``: what the reference says of one arm's answers."""

    positions: int
    controls: int
    flips: int
    departures: list[DepartureRecord]
    departed: int
    flipped: int
    max_gap: float
    unread: list[str]
    probed: NotRequired[int]
    judged: NotRequired[int]
    exceeded: NotRequired[int]
    needed: NotRequired[int | None]
    p: NotRequired[float]


class DisagreementRecord(TypedDict):
    """``independent.Disagreement``: where the engine's cold read and transformers' pick different tokens."""

    case: str
    turn: int
    position: int
    engine: int
    transformers: int
    margin: float


class SecondSummary(TypedDict):
    """``independent.Second``: what transformers' read of the reference weights says of the engine's cold read."""

    weights: str
    dtype: str
    positions: int
    disagreed: int
    where: list[DisagreementRecord]


class ReferenceCalibration(TypedDict):
    """``reference.calibrate``: where the reference's floor came from: which reads, of how many answers, and the
    order statistic taken of how many positions' gap differences."""

    source: str
    reads: int
    of: int
    positions: NotRequired[int]  # set with the floor it gave
    order: NotRequired[int]
    floor: NotRequired[float]
    alpha: NotRequired[float]


class ReferenceSummary(TypedDict):
    """``reference.Read``: the reference's reading of both arms and the floors it was judged against."""

    dtype: str
    arms: dict[str, ArmSummary]
    floor: dict[str, float]  # reference_batch, repeat, calibration
    tolerance: dict[str, float]  # flip_margin, gap
    seconds: float
    reads: int
    second: SecondSummary | None
    calibration: ReferenceCalibration
    departs: dict[str, bool]


# --- sampled decoding (gate/stats/coupling.py, pit.py, unpaired.py, gate/arms/controls.py) ----------------------


# One position class (or stage) of coupled steps and the bound they give; by call, as "class" is a keyword.
TVClass = TypedDict("TVClass", {"class": str, "steps": int, "mismatches": int, "answers": int,
                                             "bound": float})


class SamplerChain(TypedDict):
    """An engine's sampler as the identity records it (``sampler.chain``, or a server's)."""

    sampler: str
    chain: NotRequired[list[str]]
    window: NotRequired[dict[str, str]]
    draw: NotRequired[str]


class Coupling(TypedDict):
    """``coupling.Coupled``: the coupled steps of one evaluation's sampled cases."""

    decoding: dict[str, str]
    answers: int
    chain: SamplerChain | None
    steps: int
    mismatches: int
    alpha: float
    tv_bound: float
    sampler_state: int
    where: list[str]
    bound: str
    tv_mean_bound: NotRequired[float]
    edges: NotRequired[list[int]]
    classes: NotRequired[list[TVClass]]  # absent from rows written before the per-class bounds


class PitSide(TypedDict):
    """``pit.Side``: one side's draws under the declared decoding."""

    steps: int
    statistic: float
    p: float
    impossible: int
    where: list[str]
    reread: int
    undecided: int
    pairs: int
    serial: float
    serial_p: float


class ControlsSummary(TypedDict):
    """``controls.Controls``: the two control draws and what they showed."""

    case: str
    unpaired: str  # seen | missed | undecided
    planted: str
    chance: float


class UnpairedSummary(TypedDict):
    """``unpaired.Unpaired``: sampled cases whose keyed draws parted, and what compared the sides instead."""

    parted: int
    repeated: int
    first: str
    positions: int
    kld_max: float | None
    tv_max: float | None
    tv_from: str | None


class SamplingSummary(Coupling):
    """The sampled decoding as the outcome records it: the coupling, each side's draws against the declared
    decoding, the controls and the unpaired comparison."""

    declared: NotRequired[dict[str, PitSide] | None]
    controls: NotRequired[ControlsSummary | None]
    unpaired: NotRequired[UnpairedSummary | None]


# --- the outcome ----------------------------------------------------------------------------------------------


class OutcomeSummary(TypedDict):
    """``evaluator.Outcome``: what ``evaluate --json`` prints and a verdict row's ``summary`` holds. Rows written
    before a summary was recorded lack it (``NotRequired``)."""

    evaluation_id: int
    flag: str
    verdict: str
    reasons: list[str]
    cases: int
    assertions: int
    differing_cases: list[str]
    equal: dict[str, int]  # baseline, off_on
    tokens: Tokens
    seconds: dict[str, float]  # off, on
    cacheable_share: dict[str, float]  # as_written, partitioned
    exercised_share: float
    passes: dict[str, int]  # off, on
    model_seconds: float
    overhead_seconds: float
    telemetry: dict[str, dict[str, StageTelemetry]]  # per side, per stage
    strength: StrengthSummary | None
    near_ties: dict[str, SuiteCensus]
    probes: dict[str, str]
    probe_seconds: float
    reached: dict[str, list[str]]
    paired: NotRequired[Statistics | None]
    distance: NotRequired[DistanceSummary | NotObservable | None]
    reference: NotRequired[ReferenceSummary | NotObservable | None]
    sampling: NotRequired[SamplingSummary | None]
    sequential: NotRequired[SequentialSummary | None]
    looks: NotRequired[LookSummary | None]


# --- calibration (gate/power/calibrate.py) --------------------------------------------------------------------


class FaultSpec(TypedDict):
    """``faults.Fault``: one planted fault."""

    kind: str
    size: float
    seed: int
    spec: str


class FaultRow(FaultSpec):
    """One planted fault's calibration: the cases it flagged, by outputs and by drift, and what it cost. A fault the
    engine cannot plant holds only its spec and ``supported: false``."""

    supported: bool
    flagged: NotRequired[int]
    cases: NotRequired[int]
    share: NotRequired[float]
    flagged_cases: NotRequired[list[str]]
    by_outputs: NotRequired[int]
    share_outputs: NotRequired[float]
    by_drift: NotRequired[int]
    share_drift: NotRequired[float]
    stopped_early: NotRequired[int]
    cached_tokens: NotRequired[int]
    seconds: NotRequired[float]


class DriftRuleRecord(TypedDict):
    """``calibrate.DriftRule``: when a fault counts as flagged by drift."""

    kind: str
    value: float | None
    rule: str


class TwinRecord(TypedDict):
    """``twin.check``: the twin's weights against the served deployment's."""

    engine: str
    weights: str
    digests: list[str]
    served: list[dict[str, str]]  # path, digest


class CalibrationSummary(TypedDict):
    """``calibrate.Calibration``: a calibration row's ``result``."""

    calibration_id: int | None
    flag: str
    evaluation_id: int | None
    engine: str
    cases: int
    faults: list[FaultRow]
    seconds: dict[str, float]  # reference, faults, per_flag_on_run
    drift_rule: NotRequired[DriftRuleRecord]  # absent from rows written before drift was counted
    mode: NotRequired[str]  # early | full; absent from rows written before early stopping
    twin: NotRequired[TwinRecord | None]


# --- the ledger's rows beside the evidence ------------------------------------------------------------------------


class Calibrated(TypedDict):
    """What a calibration's power is read from: its result (``gate.state.flags.detected``)."""

    result: CalibrationSummary


class CalibrationRow(Calibrated):
    """A ``calibration`` row as the ledger reads it back."""

    id: int
    evaluation_id: int | None
    flag: str
    operator: str
    config: dict[str, object]
    at: str


class Signed(TypedDict):
    """What a signed row adds (``--sign KEY``): None where it was not signed."""

    signature: str | None
    signer: str | None
    signed_at: str | None
    record_digest: str | None


class ApprovalRow(Signed):
    """An ``approval`` row as the ledger reads it back."""

    id: int
    flag: str
    evaluation_id: int
    operator: str
    reason: str
    at: str


class FlipRow(Signed):
    """A ``flip`` row as the ledger reads it back."""

    id: int
    flag: str
    state: Literal["on", "off"]
    evaluation_id: int | None
    operator: str
    reason: str
    at: str
    approval_ids: list[int] | None


@final
class CheckpointRecorded(TypedDict):
    """A checkpoint of the ledger's head recorded in the workspace after a flip (``ledger.checkpoint.after_flip``):
    the log it went to, its seq and signer."""

    file: str
    seq: int
    signer: str | None


# --- what engines, the ledger and traffic hand on ------------------------------------------------------------------


class CallTelemetry(TypedDict):
    """What one served call cost as the server reported it (``engines.served.telemetry``); None: not reported. A
    capture line carries the figures that are not None."""

    prompt_tokens: int | None
    cached_tokens: int | None
    prefill_s: float | None
    decode_s: float | None


class Starter(TypedDict):
    """Who started an evaluation (what ``ledger.status.derive_status`` reads of its started record)."""

    pid: int
    host: str


class Decided(TypedDict):
    """What ``ledger.status.derive_status`` reads of a verdict record."""

    verdict: str  # PASS | FAIL | INCONCLUSIVE


class StartedRow(Starter):
    """An ``evaluation`` row: the started record of an evaluation (its status is derived from later records)."""

    id: int
    flag: str
    operator: str
    started_at: str
    gate: str
    identity: dict[str, object]  # per side (off, on): what makes its outputs what they are
    config: dict[str, object]


class RefusalRow(TypedDict):
    """A ``refusal`` row: a flip the gate refused, and why."""

    id: int
    flag: str
    evaluation_id: int | None
    operator: str
    reasons: list[str]
    at: str


class Digests(TypedDict):
    """The model and adapter a response cache was keyed on (a ``flush`` row's old and new)."""

    model_digest: str | None
    adapter_digest: str | None


class FlushRow(TypedDict):
    """A ``flush`` row: a change of model or adapter that flushed the prefix cache and its persisted results."""

    id: int
    trigger: str
    old: Digests
    new: Digests
    detail: dict[str, object]
    at: str


class StoredEntry(TypedDict):
    """One link of the ledger's hash chain as stored: its payload as the canonical JSON text the hash covers."""

    seq: int
    prev_hash: str
    kind: str
    record_id: int
    payload: str
    hash: str


class ChainEntry(TypedDict):
    """One link of the hash chain with its payload decoded (what an export carries): the record's columns."""

    seq: int
    prev_hash: str
    kind: str
    record_id: int
    payload: dict[str, object]
    hash: str
