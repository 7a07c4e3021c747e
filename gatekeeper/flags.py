"""Flag states, approvals and flips: enablement as a governed act, derived from the ledger alone.

Turning a flag on needs a PASS evaluation of that flag whose flag-off identity is still the
identity of the pipeline now, evidence younger than the policy allows, and the policy's number
of approvals from distinct operators. Turning a flag off is always allowed. Every approval,
flip and refusal is a ledger record.

An approval or flip may be signed with an SSH key (``signing``): the signature covers the record
of the act (``flip_record``) and is kept on its row; under a policy's ``approvals.signed`` an
unsigned approval is refused, and distinct operators are distinct signing principals.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable

from deepdiff import DeepDiff

from . import signing
from .errors import GatekeeperError
from .identity import canonical_json, digest, sha256_hex
from .signing import SigningKey
from .workspace import HASH_PARTS, MinPower, Workspace

# Given an evaluation record, the flag-off identity its configuration has now.
IdentityNow = Callable[[dict[str, Any]], dict[str, Any]]


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
    diff = DeepDiff(evaluation["identity"]["off"], now_json, ignore_order=True)
    if diff:
        changed = sorted({path for paths in diff.to_dict().values() for path in (paths if isinstance(paths, (list, dict, set)) else [paths])})
        problems.append(f"stale: the configuration changed since evaluation {eid}: {', '.join(map(str, changed))}")
    if policy.min_power is not None:
        problems += power_problems(policy.min_power, flag, eid, evaluation.get("calibrations") or [])
    return problems


# --- signed acts ------------------------------------------------------------------------------

RECORD_TYPE = "gatekeeper.flip"
CLOCK_SKEW_S = 300  # how far in the future a record signed elsewhere may be dated


def flip_record(flag: str, state: str, evaluation_id: int | None, identity_digest: str | None, operator: str,
                reason: str, at: str) -> dict[str, Any]:
    """What an operator signs for one ``flip``: the act, the evidence it rests on, who and when."""
    return {"type": RECORD_TYPE, "flag": flag, "state": state, "evaluation_id": evaluation_id,
            "identity_digest": identity_digest, "operator": operator, "reason": reason, "at": at}


def record_message(record: dict[str, Any]) -> bytes:
    """The signed bytes: the record's canonical JSON and a newline (a text file ssh-keygen can sign)."""
    return canonical_json(record) + b"\n"


def identity_digest(evaluation: dict[str, Any] | None) -> str | None:
    return digest(evaluation["identity"]) if evaluation else None


@dataclass(frozen=True)
class Attestation:
    """How a flip is vouched for: a key to sign with here, or a record and its signature made elsewhere
    (``flip --print-record``, then ``ssh-keygen -Y sign -n gatekeeper``)."""

    key: SigningKey | None = None
    record: bytes | None = None
    signature: str | None = None
    source: str = ""  # where the signature came from, for messages

    def __post_init__(self) -> None:
        if (self.key is None) == (self.record is None or self.signature is None):
            raise ValueError("an attestation is a key, or a record and its signature")


def _iso(stamp: datetime) -> str:
    """The ledger's own timestamp form (tables.utc_now): UTC, microseconds, Z."""
    return stamp.astimezone(timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


def _record_at(attestation: Attestation, now: datetime) -> str:
    """The time inside a record signed elsewhere (which must otherwise be this flip's: checked later)."""
    try:
        record = json.loads(attestation.record.decode("utf-8"))
        at = record["at"] if isinstance(record, dict) and record.get("type") == RECORD_TYPE else None
        stamp = signing.parse_time(at) if isinstance(at, str) else None
    except (UnicodeDecodeError, ValueError):
        stamp = None
    if stamp is None or stamp.tzinfo is None or _iso(stamp) != at:
        raise GatekeeperError(f"{attestation.source}: not a gatekeeper flip record; make one with "
                              "'gatekeeper flip FLAG on --evaluation ID --reason TEXT --print-record > FILE'")
    if (stamp - now).total_seconds() > CLOCK_SKEW_S:
        raise GatekeeperError(f"{attestation.source}: the record is dated {at}, in the future; make a fresh one")
    return at


def _check_record(attestation: Attestation, record: dict[str, Any], message: bytes) -> None:
    if attestation.record == message:
        return
    theirs = json.loads(attestation.record)
    for name in record:
        if theirs.get(name) != record[name]:
            raise GatekeeperError(f"{attestation.source}: the record is not this flip's: its {name} is "
                                  f"{theirs.get(name)!r}, this command's is {record[name]!r}")
    raise GatekeeperError(f"{attestation.source}: the record is not in canonical form; "
                          "use the bytes 'gatekeeper flip ... --print-record' printed, unchanged")


def _seal(ws: Workspace, ledger, flag: str, record: dict[str, Any],
          attestation: Attestation) -> tuple[dict[str, str] | None, list[str]]:
    """The signature columns of this act, or the reasons it cannot count as signed."""
    allowed = ws.allowed_signers
    if allowed is None:
        raise GatekeeperError(f"{ws.allowed_signers_path}: missing; it says who may sign, one line per key in "
                              "git's format: 'principal key-type key' (e.g. the line 'ana ' + the contents of ~/.ssh/id_ed25519.pub)")
    message = record_message(record)
    if attestation.key is not None:
        armored, blob = signing.sign(attestation.key, message), attestation.key.blob
    else:
        try:
            armored, blob = attestation.signature, signing.verify(attestation.signature, message).blob
        except signing.BadSignature as e:
            return None, [f"bad_signature: {attestation.source} does not sign this flip's record: {e}"]
    at = record["at"]
    principal = allowed.principal(blob, signing.parse_time(at))
    if principal is None:
        return None, [f"unknown_signer: key {signing.fingerprint(blob)} ({signing.key_type(blob)}) may not sign "
                      f"for anyone in {allowed.path} at {at}; add a line 'PRINCIPAL {signing.key_type(blob)} KEY' for it"]
    last = max((f["at"] for f in ledger.flips(flag)), default="")
    if at <= last:
        return None, [f"replayed: the signed record is dated {at}, before {flag}'s last flip at {last}; sign a fresh record"]
    return {"signature": armored, "signer": principal, "signed_at": at,
            "record_digest": sha256_hex(message)}, []


def flip(ws: Workspace, ledger, flag: str, state: str, *, evaluation_id: int | None, operator: str, reason: str,
         identity_now: IdentityNow, now: datetime | None = None, attestation: Attestation | None = None) -> FlipResult:
    policy = ws.policy(flag)  # unknown flag: exit 2 before anything is written
    if state not in ("on", "off"):
        raise GatekeeperError(f"state must be 'on' or 'off', not {state!r}")
    if not reason.strip():
        raise GatekeeperError("--reason is empty; say why the flag changes")
    clock = now or datetime.now(timezone.utc)
    evaluation = ledger.evaluation(evaluation_id) if evaluation_id is not None else None
    seal, signature_reasons = None, []
    if attestation is not None:
        at = _record_at(attestation, clock) if attestation.key is None else _iso(clock)
        record = flip_record(flag, state, evaluation_id, identity_digest(evaluation), operator, reason, at)
        if attestation.key is None:
            _check_record(attestation, record, record_message(record))
        seal, signature_reasons = _seal(ws, ledger, flag, record, attestation)
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
        return FlipResult(flag, "off", "flipped", evaluation_id=evaluation_id, signer=signer)

    required = policy.approvals.required
    evidence = evidence_problems(ws, flag, evaluation, identity_now, now)
    if evaluation is None and evaluation_id is not None:
        evidence = [f"{evidence[0]} (asked for {evaluation_id})"]
    reasons = signature_reasons + evidence
    prior = _approvers_since_last_flip(ledger, flag, evaluation_id, signed_only=policy.approvals.signed)
    who = signer or operator  # under signatures, a person is the principal whose key signed, not a typed name
    if not reasons and not policy.approvals.evaluator_may_approve and who == evaluation["operator"]:
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
    return FlipResult(flag, "on", "flipped", approvals=len(approvers), required=required, evaluation_id=evaluation_id,
                      signer=signer)


def print_record(ws: Workspace, ledger, flag: str, state: str, *, evaluation_id: int | None, operator: str,
                 reason: str, now: datetime | None = None) -> bytes:
    """The message a flip with these arguments signs, dated now: for signing elsewhere."""
    ws.policy(flag)
    evaluation = ledger.evaluation(evaluation_id) if ledger is not None and evaluation_id is not None else None
    if evaluation_id is not None and evaluation is None:
        raise GatekeeperError(f"no evaluation {evaluation_id} in the ledger; see 'gatekeeper ledger list'")
    at = _iso(now or datetime.now(timezone.utc))
    return record_message(flip_record(flag, state, evaluation_id, identity_digest(evaluation), operator, reason, at))


def _approvers_since_last_flip(ledger, flag: str, evaluation_id: int | None, signed_only: bool = False) -> dict[str, int]:
    """Approver -> approval id for this evaluation, counting only approvals after the flag's last flip.
    An approver is the signing principal of a signed approval, else the typed operator name."""
    if evaluation_id is None:
        return {}
    flips = ledger.flips(flag)
    after = max((f["at"] for f in flips), default="")
    return {a.get("signer") or a["operator"]: a["id"] for a in ledger.approvals(flag, evaluation_id)
            if a["at"] > after and (a.get("signer") or not signed_only)}


@dataclass
class SignatureAudit:
    checked: int = 0  # signatures rechecked
    problems: list[tuple[int | None, str]] = field(default_factory=list)  # (seq, "seq N: code: ...")


def audit_signatures(ws: Workspace, ledger) -> SignatureAudit:
    """Recheck every signed approval and flip against its row, the evidence and ``allowed_signers``, and,
    for a policy with ``approvals.signed``, that its flag's approvals stayed signed: from the flag's first
    signed record on, every approval and every flip to on must be signed, and a flag that is on must
    have been turned on by a signed flip (so rows forged with correct hashes but no key show up here)."""
    seqs = {(e["kind"], e["record_id"]): e["seq"] for e in ledger.entries()}
    digests = {e["id"]: digest(e["identity"]) for e in ledger.records("evaluation")}
    rows = sorted([("approval", r) for r in ledger.approvals()] + [("flip", r) for r in ledger.flips()],
                  key=lambda kr: seqs.get((kr[0], kr[1]["id"]), 0))
    wants_signed = {flag for flag, p in ws.policies.items() if p.approvals.signed} if (ws.root / "policies").is_dir() else set()
    out, last_flip, signing_began, used = SignatureAudit(), {}, set(), {"approval": set(), "flip": set()}
    for kind, row in rows:
        seq, flag = seqs.get((kind, row["id"])), row["flag"]
        state = row.get("state", "on")

        def bad(msg: str) -> None:
            out.problems.append((seq, f"seq {seq}: {kind} {row['id']} ({flag}): {msg}"))

        if row.get("signature") is None:
            if flag in wants_signed and flag in signing_began and state == "on":
                bad(f"unsigned: {flag}'s policy wants signed approvals, and its earlier ones were signed")
        else:
            out.checked += 1
            _recheck(ws, kind, row, digests, last_flip.get(flag, ""), used[kind], bad)
            signing_began.add(flag)
        if kind == "flip":
            last_flip[flag] = row["at"]
    for flag, last in ledger.flag_states().items():
        if flag in wants_signed and last["state"] == "on" and last.get("signature") is None:
            seq = seqs.get(("flip", last["id"]))
            out.problems.append((seq, f"seq {seq}: flip {last['id']} ({flag}): unsigned: {flag} is on by a flip that "
                                      "is not signed, and its policy wants signed approvals"))
    out.problems.sort(key=lambda p: p[0] or 0)
    return out


def _recheck(ws: Workspace, kind: str, row: dict[str, Any], digests: dict[int, str], last_flip: str,
             used: set[str], bad: Callable[[str], None]) -> None:
    if any(row.get(name) is None for name in ("signer", "signed_at", "record_digest")):
        return bad("bad_signature: the row has a signature but not its signer, time and record digest")
    record = flip_record(row["flag"], row.get("state", "on"), row["evaluation_id"],
                         digests.get(row["evaluation_id"]) if row["evaluation_id"] is not None else None,
                         row["operator"], row["reason"], row["signed_at"])
    message = record_message(record)
    if sha256_hex(message) != row["record_digest"]:
        return bad("bad_signature: the row (or its evaluation) no longer matches the record that was signed")
    try:
        sig = signing.verify(row["signature"], message)
    except signing.BadSignature as e:
        return bad(f"bad_signature: {e}")
    allowed = ws.allowed_signers
    if allowed is None:
        return bad(f"unknown_signer: signed by {row['signer']}, but there is no {ws.allowed_signers_path} to check the key against")
    if not allowed.allows(row["signer"], sig.blob, signing.parse_time(row["signed_at"])):
        return bad(f"unknown_signer: key {sig.fingerprint} may not sign for {row['signer']} at {row['signed_at']} "
                   f"by {allowed.path}")
    if row["signed_at"] <= last_flip:
        return bad(f"replayed: signed at {row['signed_at']}, before the flag's previous flip at {last_flip}")
    if row["record_digest"] in used:
        return bad("replayed: the same signed record already counted")
    used.add(row["record_digest"])


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
