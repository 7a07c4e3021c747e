"""Approvals and flips: enablement as a governed act, derived from the ledger alone.

Turning a flag on needs a PASS evaluation of that flag whose flag-off identity is still the
identity of the pipeline now, evidence younger than the policy allows, and the policy's number
of approvals from distinct operators. Turning a flag off is always allowed. Every approval,
flip and refusal is a ledger record.

An approval or flip may be signed with an SSH key (``signing``): the signature covers the record
of the act (``attestation.flip_record``) and is kept on its row; under a policy's ``approvals.signed`` an
unsigned approval is refused, and distinct operators are distinct signing principals.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Callable, TypedDict, final

from ...errors import GatekeeperError
from ...workspace import Workspace
from ..state.flags import states
from .current import evidence_problems

if TYPE_CHECKING:  # imported only where a flip is signed
    from ...signing import SigningKey
    from ...summaries import CheckpointRecorded
    from .attestation import Attestation

# Given the flip's signing key (or None), records the ledger's head in the workspace: {file, seq, signer}.
RecordCheckpoint = Callable[["SigningKey | None"], "CheckpointRecorded"]


@final
class CheckpointFailed(TypedDict):
    """A flip's checkpoint that could not be recorded: why, and the command that records it."""

    error: str


@dataclass
class FlipResult:
    flag: str
    state: str  # the flag's state after this command
    action: str  # flipped | approved | refused
    reasons: list[str] = field(default_factory=list)
    approvals: int = 0
    required: int = 1
    evaluation_id: int | None = None
    signer: str | None = None  # the allowed_signers principal whose key signed this act
    # under the policy's checkpoint_after_flip: {file, seq, signer} recorded after the flip, or {error}
    checkpoint: CheckpointRecorded | CheckpointFailed | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def flip(ws: Workspace, ledger, flag: str, state: str, *, evaluation_id: int | None, operator: str, reason: str,
         now: datetime | None = None, attestation: Attestation | None = None,
         record_checkpoint: RecordCheckpoint | None = None, after: int | None = None) -> FlipResult:
    from ... import signing
    from . import attestation as attestation_

    policy = ws.policy(flag)  # unknown flag: exit 2 before anything is written
    if state not in ("on", "off"):
        raise GatekeeperError(f"state must be 'on' or 'off', not {state!r}")
    if not reason.strip():
        raise GatekeeperError("--reason is empty; say why the flag changes")
    clock = now or datetime.now(timezone.utc)
    evaluation = ledger.evaluation(evaluation_id) if evaluation_id is not None else None
    seal: dict[str, str] | None = None
    signature_reasons: list[str] = []
    if attestation is not None:
        at = attestation_.record_at(attestation, clock) if attestation.key is None else attestation_.iso(clock)
        record = attestation_.flip_record(flag, state, evaluation_id, attestation_.identity_digest(evaluation), operator, reason, at)
        if attestation.key is None:
            attestation_.check_record(attestation, record, attestation_.record_message(record))
        seal, signature_reasons = attestation_.seal(ws, ledger, flag, record, attestation)
    elif policy.approvals.signed and state == "on":
        signature_reasons = [f"unsigned: the policy of {flag} wants every approval signed: pass --sign KEY (an SSH "
                             f"private key whose public key is in {ws.allowed_signers_path}) or set ${signing.SIGNING_KEY_ENV}"]
    signer = seal["signer"] if seal else None
    current = states(ws, ledger)[flag]["state"]
    if state == "off":  # always allowed; but a signature given must be good
        if signature_reasons:
            ledger.add_refusal(flag, operator, signature_reasons, evaluation_id=evaluation["id"] if evaluation else None)
            return FlipResult(flag, current, "refused", signature_reasons, evaluation_id=evaluation_id)
        ledger.add_flip(flag, "off", operator, reason, evaluation_id=evaluation_id, seal=seal, after=after)
        return _checkpointed(ws, FlipResult(flag, "off", "flipped", evaluation_id=evaluation_id, signer=signer),
                             attestation, record_checkpoint)

    required = policy.approvals.required
    evidence = evidence_problems(ws, ledger, flag, evaluation, now)
    if evaluation is None and evaluation_id is not None:
        evidence = [f"{evidence[0]} (asked for {evaluation_id})"]
    reasons = signature_reasons + evidence
    prior = approvers_since_last_flip(ledger, flag, evaluation_id, signed_only=policy.approvals.signed)
    who = signer or operator  # under signatures, a person is the principal whose key signed, not a typed name
    # evaluation is None only with a no_evaluation reason
    if not reasons and evaluation is not None and not policy.approvals.evaluator_may_approve and who == evaluation["operator"]:
        reasons.append(f"self_approval: {who} ran evaluation {evaluation_id}; the policy wants someone else to approve it")
    if not reasons and who in prior:
        signs_as = f" ({operator} signs as {who})" if signer and signer != operator else ""
        reasons.append(f"duplicate_approval: {who} already approved evaluation {evaluation_id}{signs_as}; "
                       f"{required} distinct operators are needed")
    if reasons:
        ledger.add_refusal(flag, operator, reasons, evaluation_id=evaluation["id"] if evaluation else None)
        return FlipResult(flag, current, "refused", reasons, len(prior), required, evaluation_id, signer)

    approval_id = ledger.add_approval(flag, evaluation_id, operator, reason, seal=seal)
    approvers = {**prior, who: approval_id}
    if len(approvers) < required:
        return FlipResult(flag, current, "approved", [f"approval {len(approvers)} of {required} recorded"],
                          len(approvers), required, evaluation_id, signer)
    ledger.add_flip(flag, "on", operator, reason, evaluation_id=evaluation_id, approval_ids=sorted(approvers.values()),
                    seal=seal)
    return _checkpointed(ws, FlipResult(flag, "on", "flipped", approvals=len(approvers), required=required,
                                        evaluation_id=evaluation_id, signer=signer), attestation, record_checkpoint)


def _checkpointed(ws: Workspace, result: FlipResult, attestation: Attestation | None,
                  record: RecordCheckpoint | None) -> FlipResult:
    """A committed flip under ``approvals.checkpoint_after_flip``: ``record(key)`` writes the ledger's head into
    the workspace, signed with the flip's key. The flip stands whatever happens here, so a checkpoint that
    cannot be made or written is the result's ``checkpoint.error``, never an exception that hides the flip."""
    if not ws.policy(result.flag).approvals.checkpoint_after_flip:
        return result
    key = attestation.key if attestation else None
    try:
        if record is None:
            raise GatekeeperError("nothing was given to record it")
        result.checkpoint = record(key)
    except Exception as e:  # noqa: BLE001 - the flip is committed: say what failed, do not lose it
        result.checkpoint = {"error": (
            f"checkpoint_failed: {result.flag} is {result.state} (the ledger holds the flip), but its checkpoint could "
            f"not be recorded ({type(e).__name__}: {e}); record it with "
            f"'gatekeeper ledger checkpoint --record{' --sign KEY' if key else ''}'")}
    return result


def approvers_since_last_flip(ledger, flag: str, evaluation_id: int | None, signed_only: bool = False) -> dict[str, int]:
    """Approver -> approval id for this evaluation, counting only approvals after the flag's last flip.
    An approver is the signing principal of a signed approval, else the typed operator name."""
    if evaluation_id is None:
        return {}
    flips = ledger.flips(flag)
    after = max((f["at"] for f in flips), default="")
    return {a.get("signer") or a["operator"]: a["id"] for a in ledger.approvals(flag, evaluation_id)
            if a["at"] > after and (a.get("signer") or not signed_only)}


