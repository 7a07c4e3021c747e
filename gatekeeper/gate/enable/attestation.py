"""Signed flip records: what an operator signs for an approval or flip, how a signature made here or
with ``ssh-keygen`` is checked against ``policies/allowed_signers``, and the audit ``ledger verify``
runs over every signed row."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable

from ... import signing
from ...errors import GatekeeperError
from ...identity import canonical_json, digest, sha256_hex
from ...signing import SigningKey
from ...workspace import Workspace

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


def iso(stamp: datetime) -> str:
    """The ledger's own timestamp form (tables.utc_now): UTC, microseconds, Z."""
    return stamp.astimezone(timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


def record_at(attestation: Attestation, now: datetime) -> str:
    """The time inside a record signed elsewhere (which must otherwise be this flip's: checked later)."""
    assert attestation.record is not None  # an attestation without a key holds a record (__post_init__)
    try:
        record = json.loads(attestation.record.decode("utf-8"))
        at = record["at"] if isinstance(record, dict) and record.get("type") == RECORD_TYPE else None
        stamp = signing.parse_time(at) if isinstance(at, str) else None
    except (UnicodeDecodeError, ValueError):
        stamp = None
    if stamp is None or stamp.tzinfo is None or iso(stamp) != at:
        raise GatekeeperError(f"{attestation.source}: not a gatekeeper flip record; make one with "
                              "'gatekeeper flip FLAG on --evaluation ID --reason TEXT --print-record > FILE'")
    if (stamp - now).total_seconds() > CLOCK_SKEW_S:
        raise GatekeeperError(f"{attestation.source}: the record is dated {at}, in the future; make a fresh one")
    return at


def check_record(attestation: Attestation, record: dict[str, Any], message: bytes) -> None:
    if attestation.record == message:
        return
    assert attestation.record is not None  # an attestation without a key holds a record (__post_init__)
    theirs = json.loads(attestation.record)
    for name in record:
        if theirs.get(name) != record[name]:
            raise GatekeeperError(f"{attestation.source}: the record is not this flip's: its {name} is "
                                  f"{theirs.get(name)!r}, this command's is {record[name]!r}")
    raise GatekeeperError(f"{attestation.source}: the record is not in canonical form; "
                          "use the bytes 'gatekeeper flip ... --print-record' printed, unchanged")


def seal(ws: Workspace, ledger, flag: str, record: dict[str, Any],
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
        assert attestation.signature is not None  # an attestation without a key holds a signature (__post_init__)
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


def print_record(ws: Workspace, ledger, flag: str, state: str, *, evaluation_id: int | None, operator: str,
                 reason: str, now: datetime | None = None) -> bytes:
    """The message a flip with these arguments signs, dated now: for signing elsewhere."""
    ws.policy(flag)
    evaluation = ledger.evaluation(evaluation_id) if ledger is not None and evaluation_id is not None else None
    if evaluation_id is not None and evaluation is None:
        raise GatekeeperError(f"no evaluation {evaluation_id} in the ledger; see 'gatekeeper ledger list'")
    at = iso(now or datetime.now(timezone.utc))
    return record_message(flip_record(flag, state, evaluation_id, identity_digest(evaluation), operator, reason, at))


@dataclass
class SignatureAudit:
    checked: int = 0  # signatures rechecked
    problems: list[tuple[int | None, str]] = field(default_factory=list)  # (seq, "seq N: code: ...")


def audit_signatures(ws: Workspace, ledger) -> SignatureAudit:
    """Recheck every signed approval and flip against its row, the evidence and ``allowed_signers``, and,
    for a policy with ``approvals.signed``, that its flag's approvals stayed signed: from the flag's first
    signed record on, every approval and every flip to on must be signed, and a flag that is on must
    have been turned on by a signed flip (so rows forged with correct hashes but no key show up here)."""
    # the two kinds' seqs by the entry index: decoding the whole chain for them took most of a verify at 10^6 entries
    seqs = {(kind, rid): seq for kind in ("approval", "flip") for rid, seq in ledger.seqs(kind).items()}
    digests = {e["id"]: digest(e["identity"]) for e in ledger.records("evaluation")}
    rows = sorted([("approval", r) for r in ledger.approvals()] + [("flip", r) for r in ledger.flips()],
                  key=lambda kr: seqs.get((kr[0], kr[1]["id"]), 0))
    wants_signed = {flag for flag, p in ws.policies.items() if p.approvals.signed} if (ws.root / "policies").is_dir() else set()
    out = SignatureAudit()
    last_flip: dict[str, str] = {}
    signing_began: set[str] = set()
    used: dict[str, set[str]] = {"approval": set(), "flip": set()}
    for kind, row in rows:
        seq, flag = seqs.get((kind, row["id"])), row["flag"]
        state = row.get("state", "on")

        def bad(msg: str, seq=seq, kind=kind, row=row, flag=flag) -> None:  # bound now: called in this iteration
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
