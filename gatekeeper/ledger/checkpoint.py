"""Checkpoints: the ledger's head written down outside the database, so a rewrite shows.

The hash chain proves the ledger is consistent with itself; it cannot show that the tail was cut
off, or that everything after an edit was re-hashed. A checkpoint (seq, hash, time, entry count,
a digest of where the ledger lives), committed with the workspace or handed to an auditor, can:
the ledger must still hold that very entry at that seq. Signed, it cannot be forged either.

The workspace records its own: ``ledger/checkpoints.jsonl`` holds every checkpoint written after a flip
(or by ``ledger checkpoint --record``), one a line, appended and never rewritten, so the file is committed
with the pipeline (the database beside it is git-ignored) and an edit of an old line shows in its history;
``ledger/checkpoint.json`` is the newest, for readers of one file. ``ledger verify`` checks them all.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import cast

from sqlalchemy.engine import make_url

from gatekeeper import signing
from gatekeeper.errors import GatekeeperError
from gatekeeper.identity import canonical_json, digest
from gatekeeper.ledger.tables import utc_now
from gatekeeper.summaries import CheckpointRecorded

from ..summaries import NotRequired, TypedDict  # typing's, or typing_extensions' before 3.11

FORMAT = "gatekeeper.checkpoint"
BODY = ("type", "ledger", "seq", "hash", "entries", "at")  # what a signature covers


class Checkpoint(TypedDict):
    """A checkpoint as written and read (``parse`` checks the shape): the ledger's head, where it lives (a digest),
    when, and its signature where it was signed."""

    type: str  # FORMAT
    ledger: str  # digest of ``location``
    seq: int
    hash: str
    entries: int
    at: str
    signer: NotRequired[str]  # both or neither
    signature: NotRequired[str]


class Checked(TypedDict):
    """``CheckpointReport.to_dict``: whether the ledger still extends a checkpoint, and each problem if not."""

    file: str
    seq: int
    hash: str
    at: str
    signer: str | None
    ok: bool
    problems: list[str]


def location(url: str, root: Path | None = None) -> str:
    """Where the ledger lives, in words that survive moving the workspace: a SQLite file inside the
    workspace is named relative to it; any other URL is kept without its driver and password."""
    u = make_url(url)
    if u.get_backend_name() == "sqlite" and u.database and u.database != ":memory:":
        path = Path(u.database).expanduser().resolve()
        if root is not None:
            try:
                return "sqlite:workspace/" + path.relative_to(Path(root).resolve()).as_posix()
            except ValueError:
                pass
        return "sqlite:" + path.as_posix()
    # Without the driver: postgresql:// and postgresql+psycopg:// name the same server.
    return u.set(drivername=u.get_backend_name(), password=None).render_as_string(hide_password=False)


def message(checkpoint: Checkpoint) -> bytes:
    """The signed bytes: the checkpoint's body (``BODY``, not its signature) as canonical JSON and a newline."""
    c = checkpoint
    return canonical_json({"type": c["type"], "ledger": c["ledger"], "seq": c["seq"], "hash": c["hash"],
                           "entries": c["entries"], "at": c["at"]}) + b"\n"


def make(ledger, where: str, key: signing.SigningKey | None = None, allowed=None) -> Checkpoint:
    """The ledger's head as a checkpoint, signed when ``key`` is given (its key must be in ``allowed``)."""
    head = ledger.head()
    if head is None:
        raise GatekeeperError(f"the ledger at {ledger.url} is empty; there is nothing to checkpoint yet")
    cp: Checkpoint = {"type": FORMAT, "ledger": digest(where), "seq": head["seq"], "hash": head["hash"],
                      "entries": head["entries"], "at": utc_now()}
    if key is not None:
        if allowed is None:
            raise GatekeeperError("no policies/allowed_signers: it says whose key may sign a checkpoint "
                                  "(git's format: 'principal key-type key')")
        principal = allowed.principal(key.blob, signing.parse_time(cp["at"]))
        if principal is None:
            raise GatekeeperError(f"unknown_signer: key {key.fingerprint} of {key.path} is not in {allowed.path}; "
                                  "add it there to sign checkpoints with it")
        cp["signer"] = principal
        cp["signature"] = signing.sign(key, message(cp))
    return cp


def text(checkpoint: Checkpoint) -> str:
    return json.dumps(checkpoint, indent=2, sort_keys=True) + "\n"


def write(checkpoint: Checkpoint, path: Path) -> None:
    """Write atomically: a reader never sees half a checkpoint."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text(checkpoint), encoding="utf-8")
    os.replace(tmp, path)


def load(path: Path, where: str | None = None) -> Checkpoint:
    """A checkpoint file, checked for shape; GatekeeperError (exit 2) when it is not one."""
    where = where or f"--checkpoint {path}"
    try:
        return parse(path.read_text(encoding="utf-8"), where, "write one with 'gatekeeper ledger checkpoint'")
    except FileNotFoundError:
        raise GatekeeperError(f"{where}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise GatekeeperError(f"{where}: not a JSON checkpoint ({e}); write one with 'gatekeeper ledger checkpoint'") from None


def parse(text: str, where: str, fix: str) -> Checkpoint:
    """One checkpoint's JSON text, checked for shape; errors name ``where`` and say ``fix``."""
    try:
        data = json.loads(text)
    except ValueError as e:
        raise GatekeeperError(f"{where}: not a JSON checkpoint ({e}); {fix}") from None
    except RecursionError:
        raise GatekeeperError(f"{where}: not a JSON checkpoint (nested too deeply); {fix}") from None
    if not isinstance(data, dict) or data.get("type") != FORMAT:
        raise GatekeeperError(f"{where}: not a gatekeeper checkpoint (no \"type\": \"{FORMAT}\")")
    for name, kind in (("ledger", str), ("seq", int), ("hash", str), ("entries", int), ("at", str)):
        if not isinstance(data.get(name), kind) or isinstance(data.get(name), bool):
            raise GatekeeperError(f"{where}: field {name!r} is missing or not a{'n integer' if kind is int else ' string'}")
    if data["seq"] < 1:
        raise GatekeeperError(f"{where}: field 'seq' must be 1 or more")
    if ("signature" in data) != ("signer" in data):
        raise GatekeeperError(f"{where}: a signed checkpoint has both 'signature' and 'signer'")
    for name in ("signature", "signer"):
        if name in data and not isinstance(data[name], str):
            raise GatekeeperError(f"{where}: field {name!r} is not a string")
    try:
        signing.parse_time(data["at"])
    except ValueError:
        raise GatekeeperError(f"{where}: field 'at' is not an ISO-8601 time") from None
    return cast(Checkpoint, data)  # its shape checked above


# --- the workspace's own record ---------------------------------------------------------------

LOG = "checkpoints.jsonl"


def log_path(ws) -> Path:
    """``ledger/checkpoints.jsonl``, beside the newest (``ws.checkpoint_path``)."""
    return ws.checkpoint_path.with_name(LOG)


def record(checkpoint: Checkpoint, ws) -> Path:
    """Append ``checkpoint`` to the workspace's log (one line, synced) and make it the newest; the log's path."""
    path = log_path(ws)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps(checkpoint, sort_keys=True, separators=(",", ":")).encode() + b"\n"
    with open(path, "a+b") as f:
        if _cut_short(f):
            line = b"\n" + line  # a line cut short stays its own (bad) line, never joined to this one
        f.write(line)
        f.flush()
        os.fsync(f.fileno())
    write(checkpoint, ws.checkpoint_path)
    return path


def after_flip(ws, ledger, key: signing.SigningKey | None) -> CheckpointRecorded:
    """The ledger's head, signed with ``key`` when given, recorded in the workspace: {file, seq, signer}."""
    cp = make(ledger, location(ledger.url, ws.root), key, ws.allowed_signers if key is not None else None)
    return {"file": str(record(cp, ws)), "seq": cp["seq"], "signer": cp.get("signer")}


def _cut_short(f) -> bool:
    """Whether the file's last line lacks its newline (a write that was interrupted)."""
    end = f.seek(0, os.SEEK_END)
    if not end:
        return False
    f.seek(end - 1)
    return f.read(1) != b"\n"


def recorded(ws) -> list[tuple[str, Checkpoint]]:
    """Every checkpoint the workspace records, named: each line of the log (``FILE:LINE``), then the newest
    (``ledger/checkpoint.json``) where it is not in the log (a workspace from before the log, or one written
    by hand). A line or file that is no checkpoint is GatekeeperError (exit 2), naming it."""
    out: list[tuple[str, Checkpoint]] = []
    path = log_path(ws)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        lines = []
    except (OSError, UnicodeDecodeError) as e:
        raise GatekeeperError(f"{path}: cannot be read as text ({e}); restore it from the workspace's history") from None
    for n, line in enumerate(lines, 1):
        if line.strip():
            out.append((f"{path}:{n}", parse(line, f"{path} line {n}",
                                             "restore the line from the workspace's history, or remove it")))
    newest = ws.checkpoint_path
    if newest.is_file():
        data = load(newest, str(newest))
        if data not in [c for _, c in out]:
            out.append((str(newest), data))
    return out


@dataclass
class CheckpointReport:
    file: str
    seq: int
    hash: str
    at: str
    signer: str | None
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> Checked:
        return {"file": self.file, "seq": self.seq, "hash": self.hash, "at": self.at, "signer": self.signer,
                "ok": self.ok, "problems": list(self.problems)}


def check(checkpoint: Checkpoint, file: str, ledger, where: str, allowed) -> CheckpointReport:
    """Does the ledger still extend this checkpoint? Each problem names the attack it shows."""
    seq = checkpoint["seq"]
    report = CheckpointReport(file, seq, checkpoint["hash"], checkpoint["at"], checkpoint.get("signer"))
    bad = report.problems.append
    if "signature" in checkpoint:
        try:
            sig = signing.verify(str(checkpoint["signature"]), message(checkpoint))
        except signing.BadSignature as e:
            bad(f"bad_signature: checkpoint {file} is not what its signer signed ({e}): it was altered or forged")
        else:
            try:
                at = signing.parse_time(checkpoint["at"])
            except ValueError:
                at = datetime.now(timezone.utc)
            if allowed is None or not allowed.allows(str(checkpoint["signer"]), sig.blob, at):
                bad(f"unknown_signer: checkpoint {file} is signed with key {sig.fingerprint}, which "
                    f"{allowed.path if allowed else 'policies/allowed_signers (missing)'} does not allow for "
                    f"{checkpoint['signer']}")
    if checkpoint["ledger"] != digest(where):
        bad(f"other_ledger: checkpoint {file} is of another ledger than {ledger.url}")
        return report
    head = ledger.head()
    last = head["seq"] if head else 0
    if last < seq:
        bad(f"truncated: the ledger ends at seq {last}, below checkpoint {file} at seq {seq}: "
            f"entr{'y' if seq - last == 1 else 'ies'} {last + 1 if seq - last == 1 else f'{last + 1}..{seq}'} "
            "were deleted")
        return report
    entry = ledger.entry(seq)
    if entry is None or entry["hash"] != checkpoint["hash"]:
        have = "missing" if entry is None else entry["hash"][:16] + "…"
        bad(f"forked: entry seq {seq} is {have}, checkpoint {file} says {checkpoint['hash'][:16]}…: "
            f"the ledger was rewritten at or before seq {seq}")
    return report


def uncovered_flips(ws, ledger, good: list[CheckpointReport]) -> list[str]:
    """A policy's ``approvals.checkpoint_after_flip``: its flag's last flip must lie at or below a good checkpoint
    (a signed one where the policy also wants signatures). The rule ``ledger verify`` and ``flags serve`` apply."""
    if not (ws.root / "policies").is_dir():
        return []
    wants = {f: p for f, p in ws.policies.items() if p.approvals.checkpoint_after_flip}
    last = {f: row for f, row in ledger.flag_states().items() if f in wants}
    if not last:
        return []
    seqs = ledger.seqs("flip")  # by the (kind, record_id) index: not the whole chain
    out = []
    for flag, row in last.items():
        seq = seqs.get(row["id"], 0)
        covering = [c for c in good if c.seq >= seq]
        if not covering:
            newest = max((c.seq for c in good), default=None)
            out.append(f"no_checkpoint: {flag}'s last flip (seq {seq}) is after "
                       f"{'the newest good checkpoint, at seq ' + str(newest) if newest else 'every checkpoint'}; "
                       f"its policy wants one after every flip (recorded in {log_path(ws)} by 'gatekeeper ledger "
                       "checkpoint --record', or pass --checkpoint FILE)")
        elif wants[flag].approvals.signed and not any(c.signer for c in covering):
            out.append(f"unsigned: no signed checkpoint covers {flag}'s last flip (seq {seq}); its policy wants signatures")
    return out
