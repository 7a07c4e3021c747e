"""Table models of the ledger: one typed table per kind of record, plus the chain.

These describe the schema as it stands after the latest migration; the migrations
themselves never import them, so an old database is upgraded by explicit DDL only.
JSON columns hold canonical JSON text, timestamps ISO-8601 UTC text; which columns hold JSON or
booleans, and how rows are encoded and decoded, is in ``records`` (which imports no SQLAlchemy).
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Optional

from sqlalchemy import Boolean, Text
from sqlmodel import Field, SQLModel

from gatekeeper.ledger.records import MIGRATIONS_TABLE


def utc_now() -> str:
    """The ledger's timestamps: ISO-8601 UTC, made here rather than trusted from callers."""
    return datetime.now(timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


class Entry(SQLModel, table=True):
    """One link of the hash chain; ``hash`` covers seq, prev_hash, kind, record_id and payload."""

    __tablename__ = "entry"
    seq: int = Field(primary_key=True, sa_column_kwargs={"autoincrement": False})
    prev_hash: str = Field(sa_type=Text)
    kind: str = Field(sa_type=Text)
    record_id: int
    payload: str = Field(sa_type=Text)
    hash: str = Field(sa_type=Text)


class Evaluation(SQLModel, table=True):
    """The ``started`` record of an evaluation; its status is derived from later records."""

    __tablename__ = "evaluation"
    id: Optional[int] = Field(default=None, primary_key=True)
    flag: str = Field(sa_type=Text)
    operator: str = Field(sa_type=Text)
    started_at: str = Field(sa_type=Text)
    pid: int
    host: str = Field(sa_type=Text)
    gate: str = Field(sa_type=Text)
    identity: str = Field(sa_type=Text)
    config: str = Field(sa_type=Text)


class CaseResult(SQLModel, table=True):
    __tablename__ = "case_result"
    id: Optional[int] = Field(default=None, primary_key=True)
    evaluation_id: int = Field(foreign_key="evaluation.id")
    case_id: str = Field(sa_type=Text)
    config: str = Field(sa_type=Text)
    repeat: int
    result: str = Field(sa_type=Text)
    at: str = Field(sa_type=Text)


class Comparison(SQLModel, table=True):
    __tablename__ = "comparison"
    id: Optional[int] = Field(default=None, primary_key=True)
    evaluation_id: int = Field(foreign_key="evaluation.id")
    case_id: str = Field(sa_type=Text)
    equal: bool = Field(sa_type=Boolean)
    detail: str = Field(sa_type=Text)
    at: str = Field(sa_type=Text)


class Verdict(SQLModel, table=True):
    __tablename__ = "verdict"
    id: Optional[int] = Field(default=None, primary_key=True)
    evaluation_id: int = Field(foreign_key="evaluation.id")
    verdict: str = Field(sa_type=Text)
    reasons: str = Field(sa_type=Text)
    summary: str = Field(sa_type=Text)
    finished_at: str = Field(sa_type=Text)


class Aborted(SQLModel, table=True):
    __tablename__ = "aborted"
    id: Optional[int] = Field(default=None, primary_key=True)
    evaluation_id: int = Field(foreign_key="evaluation.id")
    reason: str = Field(sa_type=Text)
    at: str = Field(sa_type=Text)


class Approval(SQLModel, table=True):
    __tablename__ = "approval"
    id: Optional[int] = Field(default=None, primary_key=True)
    flag: str = Field(sa_type=Text)
    evaluation_id: int = Field(foreign_key="evaluation.id")
    operator: str = Field(sa_type=Text)
    reason: str = Field(sa_type=Text)
    at: str = Field(sa_type=Text)
    # Added by migration 4 (NULL when unsigned): see SEAL_FIELDS.
    signature: Optional[str] = Field(default=None, sa_type=Text)
    signer: Optional[str] = Field(default=None, sa_type=Text)
    signed_at: Optional[str] = Field(default=None, sa_type=Text)
    record_digest: Optional[str] = Field(default=None, sa_type=Text)


class Flip(SQLModel, table=True):
    __tablename__ = "flip"
    id: Optional[int] = Field(default=None, primary_key=True)
    flag: str = Field(sa_type=Text)
    state: str = Field(sa_type=Text)
    evaluation_id: Optional[int] = Field(default=None, foreign_key="evaluation.id")
    operator: str = Field(sa_type=Text)
    reason: str = Field(sa_type=Text)
    at: str = Field(sa_type=Text)
    # Added by migration 2: the approval records a flip to `on` counted. NULL on older rows.
    approval_ids: Optional[str] = Field(default=None, sa_type=Text)
    # Added by migration 4, as on approval: the signature of the act that made this flip.
    signature: Optional[str] = Field(default=None, sa_type=Text)
    signer: Optional[str] = Field(default=None, sa_type=Text)
    signed_at: Optional[str] = Field(default=None, sa_type=Text)
    record_digest: Optional[str] = Field(default=None, sa_type=Text)


class Refusal(SQLModel, table=True):
    __tablename__ = "refusal"
    id: Optional[int] = Field(default=None, primary_key=True)
    flag: str = Field(sa_type=Text)
    evaluation_id: Optional[int] = Field(default=None, foreign_key="evaluation.id")
    operator: str = Field(sa_type=Text)
    reasons: str = Field(sa_type=Text)
    at: str = Field(sa_type=Text)


class Flush(SQLModel, table=True):
    __tablename__ = "flush"
    id: Optional[int] = Field(default=None, primary_key=True)
    trigger: str = Field(sa_type=Text)
    old: str = Field(sa_type=Text)
    new: str = Field(sa_type=Text)
    detail: str = Field(sa_type=Text)
    at: str = Field(sa_type=Text)


class Measurement(SQLModel, table=True):
    __tablename__ = "measurement"
    id: Optional[int] = Field(default=None, primary_key=True)
    operator: str = Field(sa_type=Text)
    config: str = Field(sa_type=Text)
    result: str = Field(sa_type=Text)
    at: str = Field(sa_type=Text)


class Calibration(SQLModel, table=True):
    """Planted faults run against an evaluation's flag-on configuration, and what the gate caught."""

    __tablename__ = "calibration"
    id: Optional[int] = Field(default=None, primary_key=True)
    evaluation_id: Optional[int] = Field(default=None, foreign_key="evaluation.id")
    flag: str = Field(sa_type=Text)
    operator: str = Field(sa_type=Text)
    config: str = Field(sa_type=Text)
    result: str = Field(sa_type=Text)
    at: str = Field(sa_type=Text)


class Shadow(SQLModel, table=True):
    """A batch of live requests the guard sent again to the flag-off side (``traffic/live/guarded.py``): what was
    compared and what was not, per stage, the mismatches (digests only under --no-text) and the guard's tests."""

    __tablename__ = "shadow"
    id: Optional[int] = Field(default=None, primary_key=True)
    flag: str = Field(sa_type=Text)
    flip_id: Optional[int] = Field(default=None, foreign_key="flip.id")  # the flip to on this batch watches
    operator: str = Field(sa_type=Text)
    summary: str = Field(sa_type=Text)
    items: str = Field(sa_type=Text)
    at: str = Field(sa_type=Text)


class Migration(SQLModel, table=True):
    __tablename__ = MIGRATIONS_TABLE
    version: int = Field(primary_key=True, sa_column_kwargs={"autoincrement": False})
    name: str = Field(sa_type=Text)
    applied_at: str = Field(sa_type=Text)


# A signed approval or flip: the armored SSH signature, the allowed_signers principal whose key made it,
# the time inside the signed record, and the SHA-256 of the signed message (attestation.flip_record).
SEAL_FIELDS = ("signature", "signer", "signed_at", "record_digest")

# kind -> model: the kind written into an entry is the typed table's name.
KINDS: dict[str, type[SQLModel]] = {
    m.__tablename__: m
    for m in (Evaluation, CaseResult, Comparison, Verdict, Aborted, Approval, Flip, Refusal, Flush, Measurement,
              Calibration, Shadow)
}

# The column each kind's timestamp goes in, where it is not "at".
STAMPED: dict[str, str] = {"evaluation": "started_at", "verdict": "finished_at"}
