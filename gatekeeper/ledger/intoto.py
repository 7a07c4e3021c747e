"""in-toto attestations of evaluations: an in-toto Statement v1 about one evaluation, in a DSSE envelope
signed with an operator's SSH key, and the check that an envelope is genuine and still matches the ledger.

The statement's subjects are the digests the evaluation vouches for (model, adapter, battery, policy); its
predicate (type ``PREDICATE_TYPE``) carries the verdict, reasons, identity, strength, calibrations, the
approvals and flips that rest on it, and a checkpoint of the ledger's head. docs/attestations.md has the layout.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, cast

from gatekeeper import signing
from gatekeeper.errors import GatekeeperError
from gatekeeper.evidence import EvaluationRecord
from gatekeeper.identity import canonical_json, digest
from gatekeeper.ledger import checkpoint as cp
from gatekeeper.ledger import dsse
from gatekeeper.signing import AllowedSigners, BadSignature, SigningKey
from gatekeeper.summaries import (
    ApprovalRow,
    CalibrationRow,
    DistanceSummary,
    FlipRow,
    LookSummary,
    NotObservable,
    ReferenceSummary,
    SamplingSummary,
    SequentialSummary,
    Statistics,
    StrengthSummary,
)

from ..summaries import NotRequired, TypedDict  # typing's, or typing_extensions' before 3.11

STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PAYLOAD_TYPE = "application/vnd.in-toto+json"
PREDICATE_TYPE = "https://gatekeeper.dev/evaluation/v1"
_SHA256 = re.compile(r"[0-9a-f]{64}")


class Annotations(TypedDict, total=False):
    """Where a subject's digest comes from: the predicate's path it was recorded at, or the one it was derived from."""

    recorded: str
    derived: str


class Subject(TypedDict):
    """One of a statement's subjects: what the evaluation vouches for, by SHA-256."""

    name: str  # model, adapter, baseline-model, baseline-adapter, battery, policy
    digest: dict[str, str]  # {"sha256": hex}
    annotations: Annotations


class AttestedEvaluation(TypedDict):
    """The predicate's ``evaluation``: the started record, how it ended and the cases it ran."""

    id: int
    flag: str
    gate: str
    operator: str
    started_at: str
    finished_at: str | None
    status: str
    config: dict[str, Any]  # as EvaluationRecord.config
    cases: list[str]


class AttestedSummary(TypedDict, total=False):
    """The predicate's ``summary``: the verdict summary's counts (older summaries lack some)."""

    cases: int
    assertions: int
    differing_cases: list[str]
    equal: dict[str, int]
    exercised_share: float


class Signer(TypedDict):
    """Who signed a statement (``predicate.signer``): the principal allowed_signers names, the key and when."""

    principal: str
    keyid: str
    key: str  # the OpenSSH public key
    scheme: str
    at: str


class Predicate(TypedDict):
    """A gatekeeper evaluation statement's predicate (``PREDICATE_TYPE``): docs/attestations.md."""

    evaluation: AttestedEvaluation
    verdict: str | None
    reasons: list[str]
    identity: dict[str, Any]  # as EvaluationRecord.identity
    identity_digest: str  # what a signed flip record names
    strength: StrengthSummary | None
    paired: NotRequired[Statistics]  # these where the evaluation has them (older ones read as they did)
    sequential: NotRequired[SequentialSummary]
    looks: NotRequired[LookSummary]
    distance: NotRequired[DistanceSummary | NotObservable]
    reference: NotRequired[ReferenceSummary | NotObservable]
    sampling: NotRequired[SamplingSummary]
    summary: AttestedSummary
    calibrations: list[CalibrationRow]
    approvals: list[ApprovalRow]
    flips: list[FlipRow]
    ledger: cp.Checkpoint
    signer: Signer


Statement = TypedDict("Statement", {"_type": str, "subject": list[Subject], "predicateType": str,
                                    "predicate": Predicate})


class VerifiedSigner(TypedDict):
    """The key of the first good signature (``Verification.signer``): whose, its keyid and type."""

    principal: str
    keyid: str
    key_type: str


class Stated(TypedDict):
    """What a readable statement says (``Verification.statement``)."""

    evaluation: int
    flag: str
    verdict: str | None
    predicate_type: str
    subjects: list[Subject]
    at: str


class LedgerChecked(TypedDict):
    """Whether the statement was checked against the ledger, and the checkpoint's check where it was."""

    checked: bool
    checkpoint: NotRequired[cp.Checked]
    why: NotRequired[str]  # not checked: there is no ledger at hand


class VerificationRecord(TypedDict):
    """What ``ledger verify-attestation --json`` prints (``Verification.to_dict``)."""

    ok: bool
    file: str
    problem: str  # the first problem; "" when ok
    problems: list[str]
    signer: VerifiedSigner | None
    statement: Stated | None
    ledger: LedgerChecked


# --- the statement -------------------------------------------------------------------------------


def _at(predicate: Mapping[str, object], path: str) -> object:
    value: object = predicate
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def _subject(name: str, predicate: Mapping[str, object], recorded: str, fallback: str) -> Subject:
    """A subject whose digest is the one recorded at ``recorded``; where none (or no SHA-256) was recorded,
    the SHA-256 of the canonical JSON of what was, at ``fallback`` (or the recorded value itself)."""
    value = _at(predicate, recorded)
    if isinstance(value, str) and _SHA256.fullmatch(value):
        return {"name": name, "digest": {"sha256": value}, "annotations": {"recorded": recorded}}
    source = recorded if value is not None else fallback
    return {"name": name, "digest": {"sha256": digest(_at(predicate, source))}, "annotations": {"derived": source}}


def subjects(predicate: Predicate) -> list[Subject]:
    """What the evaluation vouches for, all read from the predicate: the flag-on side's model and adapter (what
    a flip switches on), the flag-off side's where they differ, the battery and the policy."""
    identity = predicate["identity"]
    out: list[Subject] = []
    for part in ("model", "adapter"):
        picked: dict[str, dict[str, str]] = {}
        for side, name in (("on", part), ("off", f"baseline-{part}")):
            if not isinstance(identity.get(side), dict):
                continue
            engine = f"identity.{side}.engine" if isinstance(identity[side].get("engine"), dict) else f"identity.{side}"
            recorded = f"{engine}.{part}_digest"
            if part == "adapter" and _at(predicate, recorded) is None:
                continue  # no adapter on this side
            s = _subject(name, predicate, recorded, engine)
            if s["digest"] not in picked.values():
                picked[name] = s["digest"]
                out.append(s)
    side = "on" if isinstance(identity.get("on"), dict) else "off"
    out.append(_subject("battery", predicate, f"identity.{side}.battery_digest", "evaluation.cases"))
    out.append(_subject("policy", predicate, f"identity.{side}.policy_digest", "evaluation.gate"))
    return out


def predicate(ledger, evaluation: EvaluationRecord, checkpoint: cp.Checkpoint, signer: Signer) -> Predicate:
    verdict = evaluation["verdict_record"]
    summary: Mapping[str, Any] = (verdict.get("summary") if verdict else None) or {}
    # built as one literal in the order the statement has always had: the optional parts sit in the middle
    return cast(Predicate, {
        "evaluation": {
            "id": evaluation["id"], "flag": evaluation["flag"], "gate": evaluation["gate"],
            "operator": evaluation["operator"], "started_at": evaluation["started_at"],
            "finished_at": verdict.get("finished_at") if verdict else None, "status": evaluation["status"], "config": evaluation["config"],
            "cases": sorted({r["case_id"] for r in evaluation["case_results"]}),
        },
        "verdict": evaluation["verdict"],
        "reasons": evaluation["reasons"],
        "identity": evaluation["identity"],
        "identity_digest": digest(evaluation["identity"]),  # what a signed flip record names
        "strength": summary.get("strength"),
        # paired verdicts, the sequential rule, the teacher-forced distance, the reference arm and sampled decoding's
        # coupling, where the evaluation has them (older ones read as they did)
        **{k: summary[k] for k in ("paired", "sequential", "looks", "distance", "reference", "sampling") if summary.get(k) is not None},
        "summary": {k: summary[k] for k in ("cases", "assertions", "differing_cases", "equal", "exercised_share")
                    if k in summary},
        "calibrations": evaluation["calibrations"],
        "approvals": evaluation["approvals"],
        "flips": [f for f in ledger.flips(evaluation["flag"]) if f["evaluation_id"] == evaluation["id"]],
        "ledger": checkpoint,
        "signer": signer,
    })


def _ssh_public(blob: bytes) -> str:
    return f"{signing.key_type(blob)} {base64.b64encode(blob).decode()}"


def attest(ledger, evaluation_id: int, key: SigningKey, allowed: AllowedSigners | None,
           where: str) -> tuple[dsse.Envelope, Statement]:
    """The signed envelope and its statement for one finished evaluation of a ledger that verifies; ``key`` must
    sign for a principal in ``allowed``. ``where``: the ledger's location (checkpoint.location)."""
    evaluation = ledger.evaluation(evaluation_id)
    if evaluation is None:
        raise GatekeeperError(f"no evaluation {evaluation_id} in the ledger; see 'gatekeeper ledger list'")
    if evaluation["verdict"] is None:
        raise GatekeeperError(f"evaluation {evaluation_id} has no verdict (it is {evaluation['status']}); "
                              "attest a finished evaluation")
    report = ledger.verify()
    if not report.ok:  # a statement signed over a tampered ledger would vouch for the tampering
        raise GatekeeperError(f"the ledger does not verify ({report.problem}); nothing was attested: "
                              "see 'gatekeeper ledger verify'")
    if allowed is None:
        raise GatekeeperError("no policies/allowed_signers: it says whose key may sign an attestation "
                              "(git's format: 'principal key-type key')")
    checkpoint = cp.make(ledger, where)
    principal = allowed.principal(key.blob, signing.parse_time(checkpoint["at"]))
    if principal is None:
        raise GatekeeperError(f"unknown_signer: key {key.fingerprint} of {key.path} is not in {allowed.path}; "
                              "add it there to sign attestations with it")
    signer: Signer = {"principal": principal, "keyid": dsse.keyid(key.blob), "key": _ssh_public(key.blob),
                      "scheme": dsse.scheme(key.private.public_key()), "at": checkpoint["at"]}
    pred = predicate(ledger, evaluation, checkpoint, signer)
    statement: Statement = {"_type": STATEMENT_TYPE, "subject": subjects(pred), "predicateType": PREDICATE_TYPE, "predicate": pred}
    return dsse.sign(key, PAYLOAD_TYPE, canonical_json(statement)), statement


def text(envelope: dsse.Envelope) -> str:
    return json.dumps(envelope.to_dict(), indent=2) + "\n"


def write(envelope: dsse.Envelope, path: Path) -> None:
    """Write atomically: a reader never sees half an envelope."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text(envelope), encoding="utf-8")
    os.replace(tmp, path)


def load(path: Path) -> dsse.Envelope:
    """An envelope file; GatekeeperError (exit 2) naming the file when it cannot be read as one."""
    try:
        content = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise GatekeeperError(f"{path}: no such file; pass the file 'gatekeeper ledger attest ID --sign KEY --out FILE' wrote") from None
    except UnicodeDecodeError:
        raise GatekeeperError(f"{path}: not UTF-8 text, so no DSSE envelope; pass the file 'gatekeeper ledger attest' wrote") from None
    except OSError as e:
        raise GatekeeperError(f"{path}: cannot be read ({e.strerror or e})") from None
    return dsse.parse(content, str(path))


# --- verification --------------------------------------------------------------------------------


@dataclass
class Verification:
    file: str
    problems: list[str] = field(default_factory=list)
    signer: VerifiedSigner | None = None  # set once the signature is good
    statement: Stated | None = None  # set once it is readable
    ledger: LedgerChecked = field(default_factory=lambda: LedgerChecked(checked=False))

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> VerificationRecord:
        return {"ok": self.ok, "file": self.file, "problem": self.problems[0] if self.problems else "",
                "problems": list(self.problems), "signer": self.signer, "statement": self.statement, "ledger": self.ledger}


_FIELDS = {"evaluation": dict, "verdict": str, "reasons": list, "identity": dict, "identity_digest": str,
           "calibrations": list, "approvals": list, "flips": list, "ledger": dict, "signer": dict}
_CHECKPOINT = {"type": str, "ledger": str, "seq": int, "hash": str, "entries": int, "at": str}
_SIGNER = {"principal": str, "keyid": str, "key": str, "at": str}
_KINDS = {dict: "an object", str: "a string", list: "a list", int: "an integer"}


def _shape(statement: Any) -> str | None:
    """What keeps ``statement`` from being a gatekeeper evaluation statement, or None."""
    if not isinstance(statement, dict) or statement.get("_type") != STATEMENT_TYPE:
        return f"the payload is not an in-toto Statement v1 (no \"_type\": \"{STATEMENT_TYPE}\")"
    if statement.get("predicateType") != PREDICATE_TYPE:
        return f"predicateType is {statement.get('predicateType')!r}, not gatekeeper's {PREDICATE_TYPE}"
    subject = statement.get("subject")
    if not isinstance(subject, list) or not subject or not all(
            isinstance(s, dict) and isinstance(s.get("digest"), dict) and s["digest"] for s in subject):
        return "field 'subject' is not a list of subjects, each with a digest"
    pred = statement.get("predicate")
    inner = pred if isinstance(pred, dict) else {}
    for where, fields, value in (("predicate", _FIELDS, pred), ("predicate.ledger", _CHECKPOINT, inner.get("ledger")),
                                 ("predicate.signer", _SIGNER, inner.get("signer"))):
        if not isinstance(value, dict):
            return f"field {where!r} is missing or not an object"
        for name, kind in fields.items():
            if not isinstance(value.get(name), kind) or isinstance(value.get(name), bool):
                return f"field '{where}.{name}' is missing or not {_KINDS[kind]}"
    assert isinstance(pred, dict)  # checked in the loop above
    if not isinstance(pred["evaluation"].get("id"), int) or not isinstance(pred["evaluation"].get("flag"), str):
        return "field 'predicate.evaluation' lacks its id or flag"
    if not all(isinstance(r, dict) and isinstance(r.get("id"), int) for r in pred["approvals"] + pred["flips"]):
        return "fields 'predicate.approvals' and 'predicate.flips' must list records with ids"
    return None


def _embedded_key(payload: bytes) -> bytes | None:
    """The public key the statement says signed it (unverified): only to name an unknown signer."""
    try:
        key = json.loads(payload)["predicate"]["signer"]["key"]
        return base64.b64decode(key.split()[1], validate=True)
    except (ValueError, KeyError, TypeError, IndexError, AttributeError, binascii.Error):
        return None


def verify(envelope: dsse.Envelope, file: str, allowed: AllowedSigners, ledger=None, where: str | None = None) -> Verification:
    """Is ``envelope`` a gatekeeper statement signed by a key ``allowed`` lists and, given the ledger (and its
    location ``where``), does the ledger still hold what it says? Each problem starts with its code."""
    out = Verification(file)
    blob = _signature(envelope, file, allowed, out)
    if blob is None:
        return out  # an unverified payload says nothing worth checking further
    if envelope.payload_type != PAYLOAD_TYPE:
        out.problems.append(f"wrong_type: {file}: payloadType is {envelope.payload_type!r}, not {PAYLOAD_TYPE}")
        return out
    try:
        statement = json.loads(envelope.payload)
    except (ValueError, RecursionError):
        statement = None
    why = _shape(statement)
    if why is not None:
        out.problems.append(f"wrong_type: {file}: {why}")
        return out
    pred = statement["predicate"]
    out.statement = {"evaluation": pred["evaluation"]["id"], "flag": pred["evaluation"]["flag"], "verdict": pred["verdict"],
                     "predicate_type": statement["predicateType"], "subjects": statement["subject"], "at": pred["signer"]["at"]}
    claimed = pred["signer"]
    try:
        at = signing.parse_time(claimed["at"])
    except ValueError:
        at = None
    if at is None or at.tzinfo is None or not allowed.allows(claimed["principal"], blob, at):
        out.problems.append(f"unknown_signer: {file}: key {dsse.keyid(blob)} may not sign for {claimed['principal']} at "
                            f"{claimed['at']} by {allowed.path}")
    else:
        assert out.signer is not None  # _signature sets it with the good signature
        out.signer["principal"] = claimed["principal"]
    if claimed["keyid"] != dsse.keyid(blob) or _embedded_key(envelope.payload) != blob:
        out.problems.append(f"mismatch: {file}: predicate.signer names another key than the one that signed")
    if statement["subject"] != subjects(pred):
        out.problems.append(f"mismatch: {file}: the subjects do not follow from the predicate's identity")
    if ledger is not None:
        _against_ledger(pred, file, ledger, where or "", out)
    return out


def _signature(envelope: dsse.Envelope, file: str, allowed: AllowedSigners, out: Verification) -> bytes | None:
    """The public key of the first good signature by a key ``allowed`` lists; else None, with the problem noted."""
    listed = {dsse.keyid(s.blob): s for s in allowed.signers}
    for kid, sig in envelope.signatures:
        signer = listed.get(kid)
        if signer is None:
            continue
        try:
            dsse.verify(signer.blob, sig, envelope.payload_type, envelope.payload)
        except BadSignature as e:
            out.problems.append(f"bad_signature: {file}: the envelope is not what key {kid} ({', '.join(signer.principals)}) "
                                f"signed: the statement was edited after signing, or the signature damaged ({e})")
            return None
        except (ValueError, TypeError) as e:  # a key allowed_signers holds that cannot verify: report, not crash
            out.problems.append(f"bad_signature: {file}: key {kid} cannot check this signature ({e})")
            return None
        out.signer = {"principal": signer.principals[0], "keyid": kid, "key_type": signing.key_type(signer.blob)}
        return signer.blob
    kids = [k for k, _ in envelope.signatures]
    embedded = _embedded_key(envelope.payload)
    if embedded is not None and dsse.keyid(embedded) in kids:
        try:
            dsse.verify(embedded, dict(envelope.signatures)[dsse.keyid(embedded)], envelope.payload_type, envelope.payload)
        except (BadSignature, ValueError, TypeError):
            out.problems.append(f"bad_signature: {file}: the envelope is not what key {dsse.keyid(embedded)} signed "
                                "(and that key is not in allowed_signers either)")
            return None
        out.problems.append(f"unknown_signer: {file}: signed by key {dsse.keyid(embedded)} ({signing.key_type(embedded)}), "
                            f"which {allowed.path} does not list; add a line 'PRINCIPAL {_ssh_public(embedded)}' "
                            "if it may sign")
        return None
    out.problems.append(f"unknown_signer: {file}: no signature is by a key {allowed.path} lists (keyids: {', '.join(kids)})")
    return None


def _against_ledger(pred: Predicate, file: str, ledger, where: str, out: Verification) -> None:
    """The ledger still extends the checkpoint, and still holds the evaluation, approvals and flips as stated."""
    report = cp.check(pred["ledger"], file, ledger, where, None)
    out.ledger = {"checked": True, "checkpoint": report.to_dict()}
    out.problems += report.problems
    if any(p.startswith("other_ledger:") for p in report.problems):
        return  # another ledger's records say nothing about this one's
    eid = pred["evaluation"]["id"]
    evaluation = ledger.evaluation(eid)
    if evaluation is None:
        out.problems.append(f"mismatch: {file}: the ledger holds no evaluation {eid}")
        return
    for name, now, then in (("flag", evaluation["flag"], pred["evaluation"]["flag"]),
                            ("verdict", evaluation["verdict"], pred["verdict"]),
                            ("reasons", evaluation["reasons"], pred["reasons"]),
                            ("identity", digest(evaluation["identity"]), pred["identity_digest"]),
                            ("identity", digest(evaluation["identity"]), digest(pred["identity"]))):
        if now != then:
            out.problems.append(f"mismatch: {file}: evaluation {eid}'s {name} in the ledger is not the one the statement "
                                f"gives ({_short(now)} vs {_short(then)})")
            return
    rows = {("approval", r["id"]): r for r in ledger.approvals(evaluation_id=eid)}
    rows |= {("flip", r["id"]): r for r in ledger.flips() if r["evaluation_id"] == eid}
    for kind, records in (("approval", pred["approvals"]), ("flip", pred["flips"])):
        for r in records:
            if canonical_json(rows.get((kind, r["id"]))) != canonical_json(r):
                out.problems.append(f"mismatch: {file}: {kind} {r['id']} of evaluation {eid} is "
                                    f"{'gone from' if (kind, r['id']) not in rows else 'not as stated in'} the ledger")
                return


def _short(value: object) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."
