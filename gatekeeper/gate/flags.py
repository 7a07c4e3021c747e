"""Flag states, approvals and flips: enablement as a governed act, derived from the ledger alone.

Turning a flag on needs a PASS evaluation of that flag whose flag-off identity is still the
identity of the pipeline now, evidence younger than the policy allows, and the policy's number
of approvals from distinct operators. Turning a flag off is always allowed. Every approval,
flip and refusal is a ledger record.

An approval or flip may be signed with an SSH key (``signing``): the signature covers the record
of the act (``attestation.flip_record``) and is kept on its row; under a policy's ``approvals.signed`` an
unsigned approval is refused, and distinct operators are distinct signing principals.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Callable

from ..errors import GatekeeperError
from ..identity import canonical_json
from ..workspace import HASH_PARTS, MinPower, Workspace

if TYPE_CHECKING:  # imported where a flip is signed: status and hash, which only read states, never need them
    from .attestation import Attestation

# Given an evaluation record, the flag-off identity its configuration has now.
IdentityNow = Callable[[dict[str, Any]], dict[str, Any]]
# Given the flip's signing key (or None), records the ledger's head in the workspace: {file, seq, signer}.
RecordCheckpoint = Callable[[Any], dict[str, Any]]


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
    checkpoint: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def states(ws: Workspace, ledger) -> dict[str, dict[str, Any]]:
    """Every policy's flag with its state: the latest flip, else the policy's default (off)."""
    flips = ledger.flag_states() if ledger else {}
    out = {}
    for flag in ws.policies:
        last = flips.get(flag)
        out[flag] = {"state": last["state"], "evaluation_id": last.get("evaluation_id"), "operator": last["operator"],
                     "since": last["at"]} if last else {"state": "off", "evaluation_id": None, "operator": None, "since": None}
    return out


def hash_parts(ws: Workspace) -> list[str]:
    """The union of every policy's ``hash_parts``, in canonical order."""
    wanted = {p for policy in ws.policies.values() for p in policy.hash_parts}
    return [p for p in HASH_PARTS if p in wanted]


def _age_hours(iso: str, now: datetime) -> float:
    stamp = datetime.fromisoformat(iso.replace("Z", "+00:00"))
    return (now - stamp).total_seconds() / 3600


def evidence_problems(ws: Workspace, flag: str, evaluation: dict[str, Any] | None, identity_now: IdentityNow,
                      now: datetime | None = None) -> list[str]:
    """Why this evaluation cannot (or can no longer) justify turning ``flag`` on; empty when it can."""
    if evaluation is None:
        return ["no_evaluation: no such evaluation; name a passing one with --evaluation ID (see 'gatekeeper ledger list')"]
    eid = evaluation["id"]
    if evaluation["flag"] != flag:
        return [f"wrong_flag: evaluation {eid} is for {evaluation['flag']!r}, not {flag!r}"]
    if evaluation["status"] != "PASS":
        return [f"not_passed: evaluation {eid} is {evaluation['status']}; only PASS enables a flip"]
    problems = []
    policy = ws.policy(flag)
    age = _age_hours(evaluation["verdict_record"]["finished_at"], now or datetime.now(timezone.utc))
    if age > policy.approvals.max_age_hours:
        problems.append(f"expired: evaluation {eid} is {age:.1f} h old; the policy accepts {policy.approvals.max_age_hours:g} h")
    now_json = json.loads(canonical_json(identity_now(evaluation)))  # compare as stored: plain JSON types
    if evaluation["identity"]["off"] != now_json and (diff := _diff(evaluation["identity"]["off"], now_json)):
        # each kind of change holds its paths (a dict, a list or an ordered set: keys added or removed) or one path
        changed = sorted({path for paths in diff.to_dict().values() for path in ([paths] if isinstance(paths, str) else paths)})
        problems.append(f"stale: the configuration changed since evaluation {eid}: {', '.join(map(str, changed))}")
    if policy.min_power is not None:
        problems += power_problems(policy.min_power, flag, eid, evaluation.get("calibrations") or [])
    return problems


def _diff(a: Any, b: Any):
    from deepdiff import DeepDiff  # only when something changed: the import costs status and flip 0.15 s

    return DeepDiff(a, b, ignore_order=True)


# --- signed acts ------------------------------------------------------------------------------

def flip(ws: Workspace, ledger, flag: str, state: str, *, evaluation_id: int | None, operator: str, reason: str,
         identity_now: IdentityNow, now: datetime | None = None, attestation: Attestation | None = None,
         record_checkpoint: RecordCheckpoint | None = None) -> FlipResult:
    from .. import signing
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
        ledger.add_flip(flag, "off", operator, reason, evaluation_id=evaluation_id, seal=seal)
        return _checkpointed(ws, FlipResult(flag, "off", "flipped", evaluation_id=evaluation_id, signer=signer),
                             attestation, record_checkpoint)

    required = policy.approvals.required
    evidence = evidence_problems(ws, flag, evaluation, identity_now, now)
    if evaluation is None and evaluation_id is not None:
        evidence = [f"{evidence[0]} (asked for {evaluation_id})"]
    reasons = signature_reasons + evidence
    prior = _approvers_since_last_flip(ledger, flag, evaluation_id, signed_only=policy.approvals.signed)
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


def _approvers_since_last_flip(ledger, flag: str, evaluation_id: int | None, signed_only: bool = False) -> dict[str, int]:
    """Approver -> approval id for this evaluation, counting only approvals after the flag's last flip.
    An approver is the signing principal of a signed approval, else the typed operator name."""
    if evaluation_id is None:
        return {}
    flips = ledger.flips(flag)
    after = max((f["at"] for f in flips), default="")
    return {a.get("signer") or a["operator"]: a["id"] for a in ledger.approvals(flag, evaluation_id)
            if a["at"] > after and (a.get("signer") or not signed_only)}


def power_problems(min_power: MinPower, flag: str, evaluation_id: int, calibrations: list[dict[str, Any]]) -> list[str]:
    """Why no calibration of this evaluation shows the power the policy wants; empty when one does."""
    if not calibrations:
        return [f"underpowered: evaluation {evaluation_id} has no calibration; the policy wants planted noise of "
                f"{min_power.noise:g} flagged in {min_power.share:.0%} of cases: run gatekeeper calibrate "
                f"--flag {flag} --evaluation {evaluation_id}"]
    best = max(detected(c["result"], min_power.noise) for c in calibrations)
    if best < min_power.share:
        return [f"underpowered: the calibrations of evaluation {evaluation_id} flag planted noise of "
                f"{min_power.noise:g} in at most {best:.0%} of cases; the policy wants {min_power.share:.0%}"]
    return []


def detected(result: dict[str, Any], noise: float) -> float:
    """The share flagged at the largest planted noise no bigger than ``noise`` (0 if none was planted)."""
    rows = [r for r in result["faults"] if r["kind"] == "noise" and r.get("supported") and 0 < r["size"] <= noise * (1 + 1e-9)]
    return max(rows, key=lambda r: r["size"])["share"] if rows else 0.0
