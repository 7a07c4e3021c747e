"""The evidence records: what a turn, a case result, a side's run and a comparison hold.

Open this module to learn what the ledger's evidence is. Each record is a ``TypedDict``: at run time it
is the plain dict the ledger stores as canonical JSON, so a typed record reads exactly as before and an
old ledger's rows are these records too. A key marked ``NotRequired`` is absent from some rows (written
only when it applies, or before it existed): read it with ``.get``.

Producers: ``engines`` (a turn's generation), ``gate.run.runs.run_case`` (a case result),
``gate.kinds`` (comparisons), ``gate.evaluator`` (the outcome's figures). Readers: the gate's kinds,
calibration and mining, the reports, the CLI's tables.

Imports: summaries (the verdict's summary and the rows beside it; the standard library only).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from .summaries import (  # typing's, or typing_extensions' before 3.11
    ApprovalRow,
    CalibrationRow,
    NotRequired,
    OutcomeSummary,
    TypedDict,
)

# One generated step's top-2 logits (served engines: log-probabilities): [[best_id, best], [second_id, second]].
Top2 = list[list[float]]


class Generated(TypedDict):
    """One greedy call as the engine reports it (``engines.base.Generation.to_dict``)."""

    tokens: list[int]  # the generated token ids
    text: str  # their text, as the engine returned it
    prompt_tokens: int
    cached_tokens: int | None  # prompt tokens served from the prefix cache; None: the engine did not say
    prefill_s: float
    decode_s: float
    ttft_s: float
    top2: list[Top2] | None  # per generated step; None where the engine gives none
    replica: NotRequired[str]  # served sides with several servers: the one that answered
    draws: NotRequired[list[list[float]]]  # sampled decoding: per step, what the draw weighed (``sampler.Sampler.pick``)


class Turn(Generated):
    """One call to the engine within a case: what came out, what it cost, and what was sent."""

    static_tokens: int  # prompt tokens before the first dynamic byte (a probe's: 0)
    prompt_digest: str  # sha256 of the rendered prompt's text


# One assertion's outcome on a case's final text: {"type", "name", "pass", ...}, plus a family's own figures
# (a score, a grader's reason). A TypedDict by call, as ``pass`` is a Python keyword.
AssertionOutcome = TypedDict(
    "AssertionOutcome",
    {"type": str, "name": "str | None", "pass": bool, "score": NotRequired[float], "reason": NotRequired[str]},
)


class CrashRecord(TypedDict):
    """An engine that took a request and failed it (``errors.EngineCrash.record``)."""

    url: str
    said: str  # what the server answered, or how the connection ended
    request: dict[str, Any]  # size, digest, max_tokens, cache switch
    message: str


class Crash(CrashRecord):
    """A crash where it happened in a case."""

    turn: int  # from 1


class CaseResult(TypedDict):
    """One case run on one side: every turn, the final text, its assertions' outcomes."""

    turns: list[Turn]
    text: str  # the last turn's text (what assertions see)
    outcomes: list[AssertionOutcome]
    crash: NotRequired[Crash]  # the engine crashed: the turns before it, no outcomes


# A side's run: case id -> its result (probes under ``probe:NAME``), one per configuration and repeat.
Run = dict[str, CaseResult]


class DivergentSide(TypedDict):
    """One side at the first divergent position: its token, that token's text, its top-2 margin."""

    token: int | None  # None: this side's answer ended there
    piece: str | None
    margin: float | None  # None: no top-2 logits at that step


class Change(TypedDict):
    """One assertion whose outcome changed between the sides."""

    assertion: str  # its name, or "#N type"
    off: bool
    on: bool


class Comparison(TypedDict, total=False):
    """How two results of one case part (a comparison row's ``detail``, beside its ``pair``).

    Token comparisons (``kinds.token_diff``) fill ``turn`` to ``outcomes_diff``; outcome comparisons
    (``kinds.outcome_diff``) fill ``changed``, the texts and ``outcomes_diff``; an equal pair holds only
    ``pair``; a crashed case holds ``crash``."""

    pair: str  # which runs: "off#0~on#0", "off#0~off#1", "alone#0~off#0"
    turn: int | None  # the first turn that parts; None: only assertion outcomes differ
    first_divergent_position: int
    a: DivergentSide
    b: DivergentSide
    near_tie: bool  # both margins at or below kinds.NEAR_TIE: a few ULPs can flip it
    collapse: Literal["a", "b"] | None  # only this side's margin collapsed (absent in rows written before it)
    text_a: str
    text_b: str
    outcomes_diff: dict[str, Any]  # DeepDiff of the two outcome lists ({} when equal)
    changed: list[Change]
    crash: list[Crash]


class CaseResultRow(TypedDict):
    """A ``case_result`` row as the ledger reads it back."""

    id: int
    evaluation_id: int
    case_id: str
    config: str  # off | on | alone
    repeat: int
    result: CaseResult


class ComparisonRow(TypedDict):
    """A ``comparison`` row as the ledger reads it back."""

    id: int
    evaluation_id: int
    case_id: str
    equal: bool
    detail: Comparison


class VerdictRow(TypedDict):
    """A ``verdict`` row: how an evaluation ended, and its outcome's figures (``summary``: the outcome as
    ``evaluate --json`` prints it)."""

    id: int
    evaluation_id: int
    verdict: str  # PASS | FAIL | INCONCLUSIVE
    reasons: list[str]
    summary: OutcomeSummary
    finished_at: str


class AbortedRow(TypedDict):
    """An ``aborted`` row: why an evaluation ended without a verdict."""

    id: int
    evaluation_id: int
    reason: str
    at: str


class EvaluationRecord(TypedDict):
    """One evaluation as the ledger reads it back (``Ledger.evaluation``): its ``started`` record (what ran
    where: identity per side, config), its evidence, and how it ended."""

    id: int
    flag: str
    operator: str
    started_at: str
    pid: int
    host: str
    gate: str  # the policy's gate kind
    identity: dict[str, Any]  # per side ("off", "on"): what makes its outputs what they are
    config: dict[str, Any]  # engine, suites, limit, render, candidate, change, load, repeats, concurrency
    status: str  # the verdict, aborted, or running (ledger.status.derive_status)
    verdict: str | None
    reasons: list[str]
    verdict_record: VerdictRow | None
    aborted_record: AbortedRow | None
    case_results: list[CaseResultRow]
    comparisons: list[ComparisonRow]
    approvals: list[ApprovalRow]
    calibrations: list[CalibrationRow]


class HistoryRow(TypedDict):
    """One evaluation of a flag without its case evidence (``Ledger.history``): what the looks at one change are judged
    on (``gate/stats/looks.py``). ``summary`` and ``finished_at`` are None while it runs or once it aborted."""

    id: int
    flag: str
    operator: str
    gate: str
    started_at: str
    identity: dict[str, Any]
    config: dict[str, Any]
    status: str
    verdict: str | None
    reasons: list[str]
    summary: OutcomeSummary | None
    finished_at: str | None


UNDECIDED = (None,)  # no verdict yet: what the judges that decide whether there is a comparison at all overrule
ANY: tuple[str | None, ...] = (None, "PASS", "FAIL", "INCONCLUSIVE")
NOT_FAIL: tuple[str | None, ...] = (None, "PASS", "INCONCLUSIVE")  # a FAIL already said: its reasons lead


@dataclass
class Ruling:
    """One judge's word on an evaluation (``gate/decide.py`` folds the judges' rulings in order): the verdict it
    forces, if any, over which verdicts so far (``over``; None: none yet), the reasons that explain it, which lead the
    reasons so far where it forces its verdict and follow them where it does not, and ``notes`` after them either way."""

    verdict: str | None = None  # PASS | FAIL | INCONCLUSIVE
    reasons: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    over: tuple[str | None, ...] = ANY

    def on(self, verdict: str | None, reasons: list[str]) -> tuple[str | None, list[str]]:
        """The verdict and reasons once this ruling is heard after ``verdict`` and ``reasons``."""
        if self.verdict is not None and verdict in self.over:
            return self.verdict, [*self.reasons, *reasons, *self.notes]
        return verdict, [*reasons, *self.reasons, *self.notes]
