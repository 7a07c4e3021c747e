"""The guard's records as the ledger holds them: a shadow batch (its summary and the partings it kept), the rule, the
tests and the rule segment each batch records, a rollout's signed raise, and the live evidence summed from a watch's
batches.

As in ``summaries``, each is a ``TypedDict``: the plain dict the guard writes as canonical JSON, so typing it changes
no byte; a ``NotRequired`` key is absent from some batches (written only where it applies, or by an earlier release).
Producers: ``gate.guard`` (rule, tests, segments, live evidence), ``traffic.live.guarded`` (batches, raises, the
rollback), ``traffic.live.judge`` (a kept parting's comparisons). Readers: ``ledger live``, ``status``, the review
app's Live page, the OFREP resolver.

Imports: summaries (for typing's record names), the standard library.
"""

from __future__ import annotations

from typing import Union

from .summaries import NotRequired, TypedDict  # typing's, or typing_extensions' before 3.11


class RuleRecord(TypedDict):
    """A guard's rule as each batch records it (its digest names the rule segment)."""

    limit: float
    alpha: float
    min_comparisons: int
    stage_limits: dict[str, float]
    aa_rate: NotRequired[float]
    min_success_rate: NotRequired[float]
    max_latency_s: NotRequired[float]
    latency_share: NotRequired[float]
    assertion_limit: NotRequired[float]
    max_kld: NotRequired[float]
    kld_limit: NotRequired[float]


class TestRecord(TypedDict):
    """One sequential test's state after a batch."""

    scope: str
    limit: float
    alpha: float
    compared: int
    mismatches: int
    log_e: Union[float, str]  # "inf" once a limit of 0 is breached
    log_threshold: float
    breached: bool
    tv_bound: NotRequired[float]  # tests of partings of answers only
    against: NotRequired[str]  # "baseline": p_AB tested against the flag-off side's own rate
    aa_compared: NotRequired[int]
    aa_mismatches: NotRequired[int]
    ab_only: NotRequired[int]
    aa_only: NotRequired[int]


class SegmentMark(TypedDict):
    """What a batch says of its rule segment; ``new_test``: this batch starts it."""

    index: int
    rule_digest: str
    alpha: float
    alpha_left: float
    new_test: bool


class SegmentRecord(TypedDict):
    """A rule segment's batches and tests, as ``ledger live`` shows them."""

    index: int
    rule_digest: str
    rule: RuleRecord
    alpha: float
    alpha_left: float
    batches: list[int]  # the first and the last
    compared: int
    mismatches: int
    aa_compared: NotRequired[int]
    aa_mismatches: NotRequired[int]
    served: NotRequired[dict[str, int]]
    judged: NotRequired[dict[str, int]]
    breached: bool
    tests: list[TestRecord]


# ``from`` is a keyword: the functional form
Raise = TypedDict("Raise", {"step": int, "share": float, "from": float, "compared": int, "batches": list[int],
                            "signer": Union[str, None], "signature": str})
Raise.__doc__ = "A rollout's step raised, signed by the service key: the evidence batches at the step before."


class RolloutMark(TypedDict):
    """The rollout in force after a batch (``rollout:`` and the step)."""

    steps: list[float]
    min_comparisons_per_step: int
    hold_s: float
    step: int
    share: float
    compared_at_step: int


RaiseRow = TypedDict("RaiseRow", {"step": int, "share": float, "from": float, "compared": int,
                                  "signer": Union[str, None], "batch": int, "at": str})
RaiseRow.__doc__ = "A raise as ``ledger live`` lists it: with the batch that recorded it and when."


class RolloutEvidence(RolloutMark):
    """A rollout as a watch's batches record it, each signed raise, and what the next one waits for."""

    raises: list[RaiseRow]
    next: str


class ShadowSummary(TypedDict):
    """A shadow batch's summary: every live request since the last batch, what was compared and what was not."""

    requests: int
    shadowed: int
    stages: dict[str, dict[str, int]]  # stage -> compared, mismatches, unpaired (+ the A/A and failure counts)
    unpaired: dict[str, int]  # reason -> requests
    dropped: dict[str, int]
    shapes: dict[str, int]  # prompt size class -> comparisons
    judged: NotRequired[dict[str, int]]  # read, departed, graded, lost
    proxy: NotRequired[str]
    tests: NotRequired[list[TestRecord]]
    rule: NotRequired[RuleRecord]
    segment: NotRequired[SegmentMark]
    served: NotRequired[dict[str, int]]  # failed, slow: where the rule tests the live side
    raised: NotRequired[Raise]
    rollout: NotRequired[RolloutMark]


class Kept(TypedDict, total=False):
    """A parting a batch keeps: a text mismatch, a failure of the flag-on side, a lost pass or a departure. The prompt
    and answers are texts, or under ``--no-text`` salted digests."""

    stage: str
    reason: str  # "flag_on_failed"
    status: int
    error: str
    parting_char: Union[int, None]  # None: the texts are the same (a lost pass or a departure kept it)
    aa_parting_char: Union[int, None]
    finish: list[Union[str, None]]
    prompt: Union[str, dict[str, object]]
    answers: list[Union[str, None]]
    compared_by: list[str]  # text, assertions, distance
    case: str
    lost_pass: bool
    kld: float
    same_top1: float
    unread: str
    ungraded: str


class ShadowBatch(TypedDict):
    """A shadow batch as the ledger returns it."""

    id: int
    at: str
    flag: str
    flip_id: Union[int, None]
    operator: str
    summary: ShadowSummary
    items: list[Kept]


class Ended(TypedDict):
    """The flip that ended a watch."""

    id: int
    state: str
    operator: str
    signer: Union[str, None]
    reason: str
    at: str


class LiveEvidence(TypedDict):
    """A flag's live evidence: the guard's batches for the newest flip to on it watched, summed (``gate.guard.live``)."""

    flag: str
    flip_id: Union[int, None]
    batches: list[int]
    since: str
    until: str
    requests: int
    shadowed: int
    served: NotRequired[dict[str, int]]
    judged: NotRequired[dict[str, int]]
    proxies: dict[str, int]
    compared: int
    mismatches: int
    flag_on_failed: int
    tv_bound: float
    alpha: float
    aa_compared: NotRequired[int]
    aa_mismatches: NotRequired[int]
    ab_only: NotRequired[int]
    aa_only: NotRequired[int]
    aa_bound: NotRequired[float]
    stages: dict[str, dict[str, int]]
    unpaired: dict[str, int]
    dropped: dict[str, int]
    shapes: dict[str, int]
    tests: list[TestRecord]
    rule: Union[RuleRecord, None]
    segments: list[SegmentRecord]
    mismatched: list[Kept]
    ended_by: Union[Ended, None]
    rolled_back: bool
    rollout: NotRequired[RolloutEvidence]


class Rollback(TypedDict):
    """The rollback a guard made: its flip and the evidence it names."""

    flag: str
    state: str
    action: str
    reason: str
    refused: list[str]
    signer: Union[str, None]
    batches: list[int]
    watched_flip: int
    checkpoint: object  # the checkpoint the flip recorded, where the policy asks for one
