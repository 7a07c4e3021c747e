"""Shared by the signing and checkpoint tests: real SSH keys, a workspace whose evaluations need no
model (its ledger on SQLite, or on either backend), and the tools of someone who can write the ledger's
database: its SQLite file, or a PostgreSQL database as its superuser."""

from __future__ import annotations

import json
import shutil
import sqlite3
import subprocess
from pathlib import Path

import pytest
from postgres import Raw, is_postgres

from gatekeeper.identity import canonical_json

SSH_KEYGEN = shutil.which("ssh-keygen")
# principal -> ssh-keygen -t; "mallory" is never in allowed_signers
KEYS = {"ana": "ed25519", "bob": "ed25519", "cy": "rsa", "dee": "ecdsa", "ci": "ed25519", "mallory": "ed25519"}


@pytest.fixture(scope="session")
def keys(tmp_path_factory) -> dict[str, Path]:
    """Private key files made by the real ssh-keygen (public key beside each, as NAME.pub)."""
    if SSH_KEYGEN is None:  # make test installs it: a missing one fails, never skips
        pytest.fail("ssh-keygen (OpenSSH) is not installed: 'make test' installs it (apt-get install openssh-client)")
    folder = tmp_path_factory.mktemp("keys")
    out = {}
    for name, kind in KEYS.items():
        path = folder / name
        extra = ["-b", "3072"] if kind == "rsa" else []
        subprocess.run([SSH_KEYGEN, "-q", "-t", kind, *extra, "-N", "", "-C", name, "-f", str(path)], check=True)
        out[name] = path
    return out


def allowed_line(principal: str, key: Path, options: str = "") -> str:
    kind, b64 = key.with_name(key.name + ".pub").read_text().split()[:2]
    return f"{principal} {options + ' ' if options else ''}{kind} {b64}\n"


# workspace -> the URL of its ledger, where that is not the workspace's own SQLite file (backend_ws); cli()
# passes it as --ledger
LEDGERS: dict[Path, str] = {}


def ledger_of(ws: Path) -> str:
    """The URL of the workspace's ledger: a PostgreSQL database for backend_ws[postgresql], else its SQLite file."""
    return LEDGERS.get(ws, f"sqlite:///{db_of(ws)}")


@pytest.fixture
def trust_ws(workspace, keys, monkeypatch) -> Path:
    """A workspace whose allowed_signers lists everyone but mallory, with one PASS evaluation (id 1, run
    by "ci") whose flag-off identity is taken as the pipeline's now, so no model has to load."""
    return _trusting(workspace, keys, monkeypatch)


@pytest.fixture
def backend_ws(backend, request, workspace, keys, monkeypatch):
    """trust_ws with its ledger on each backend (``backend`` and ``pg_url`` come from the postgres plugin): the
    workspace's SQLite file, or a fresh PostgreSQL database that cli(), ledger_of() and unlocked() use."""
    if backend == "postgresql":
        LEDGERS[workspace] = request.getfixturevalue("pg_url")
    try:
        yield _trusting(workspace, keys, monkeypatch)
        if backend == "postgresql":
            assert not db_of(workspace).exists(), "a command wrote the workspace's SQLite file, not --ledger"
    finally:
        LEDGERS.pop(workspace, None)


def _trusting(workspace: Path, keys, monkeypatch) -> Path:
    from gatekeeper.gate.enable import current

    monkeypatch.setattr(current, "identity_now", lambda ws, evaluation, ledger: evaluation["identity"]["off"])
    monkeypatch.delenv("GATEKEEPER_SIGNING_KEY", raising=False)
    (workspace / "policies" / "allowed_signers").write_text(
        "# who may sign gatekeeper approvals\n" + "".join(allowed_line(n, keys[n]) for n in KEYS if n != "mallory"))
    add_passing_evaluation(workspace)
    return workspace


def add_passing_evaluation(ws: Path, operator: str = "ci") -> int:
    from gatekeeper.ledger import Ledger

    with Ledger(ledger_of(ws)) as lg:
        identity = {"off": {"model_digest": "m1", "flags": {"prefix_cache": "off"}},
                    "on": {"model_digest": "m1", "flags": {"prefix_cache": "on"}}}
        eid = lg.start_evaluation("prefix_cache", operator, "byte_equivalence", identity, {"engine": "tiny"})
        lg.finish_evaluation(eid, "PASS", [], {"cases": 1})
    return eid


def set_approvals(ws: Path, **settings) -> None:
    """Rewrite the prefix_cache policy's ``approvals`` mapping."""
    path = ws / "policies" / "prefix_cache.yaml"
    base = {"required": 1, "evaluator_may_approve": False, "max_age_hours": 720, **settings}
    text = "".join(line for line in path.read_text().splitlines(keepends=True) if not line.startswith("approvals:"))
    path.write_text(text + f"approvals: {json.dumps(base)}\n")


def cli(run_cli, ws: Path, *args):
    """Run a command with --json (and --ledger, for a workspace whose ledger is elsewhere); returns (exit code,
    parsed JSON)."""
    ledger = ("--ledger", LEDGERS[ws]) if ws in LEDGERS and "--ledger" not in args else ()
    code, out, err = run_cli("--workspace", ws, *ledger, *args, "--json")
    return code, (json.loads(out) if out.strip() else {"stderr": err})


def flip(run_cli, ws: Path, state: str = "on", *extra, operator: str = "ana", evaluation: int | None = 1):
    args = ["flip", "prefix_cache", state, "--operator", operator, "--reason", "reviewed", *extra]
    if evaluation is not None and "--evaluation" not in extra:
        args += ["--evaluation", str(evaluation)]
    return cli(run_cli, ws, *args)


def ssh_sign(key: Path, message_file: Path) -> Path:
    subprocess.run([SSH_KEYGEN, "-Y", "sign", "-n", "gatekeeper", "-f", str(key), str(message_file)],
                   check=True, capture_output=True)
    return message_file.with_name(message_file.name + ".sig")


def ssh_verify(allowed: Path, principal: str, sig: Path, message: bytes) -> subprocess.CompletedProcess:
    return subprocess.run([SSH_KEYGEN, "-Y", "verify", "-f", str(allowed), "-I", principal, "-n", "gatekeeper",
                           "-s", str(sig)], input=message, capture_output=True)


def db_of(ws: Path) -> Path:
    return ws / "ledger" / "evidence.db"


# --- the attacker: write access to the database (the file, or PostgreSQL's superuser), no signing key ---


class _Relocking(sqlite3.Connection):
    """Puts the dropped triggers back, exactly as they were, on close: ``ledger verify`` names a missing one."""

    dropped: list[str] = []

    def close(self) -> None:
        for sql in self.dropped:
            self.execute(sql)
        self.dropped = []
        super().close()


class _RelockingPostgres(Raw):
    """The same on PostgreSQL: every trigger dropped on opening, recreated from its own definition on close."""

    def __init__(self, url: str):
        super().__init__(url)
        self.dropped = [sql for (sql,) in self.execute(
            "SELECT pg_get_triggerdef(oid) FROM pg_trigger WHERE NOT tgisinternal").fetchall()]
        self.drop_triggers()

    def close(self) -> None:
        for sql in self.dropped:
            self.execute(sql)
        self.dropped = []
        super().close()


def unlocked(db: Path | str):
    """The database (a SQLite file, or any ledger URL) with its append-only triggers dropped, as anyone with the
    file or the database's superuser can; closing it recreates them, so the edit leaves no trace but what the
    chain, signatures and checkpoints can see. Its ``execute`` takes ``?`` placeholders on both backends."""
    if isinstance(db, str) and is_postgres(db):
        return _RelockingPostgres(db)
    path = db[len("sqlite:///"):] if isinstance(db, str) else db
    conn = sqlite3.connect(path, isolation_level=None, factory=_Relocking)
    triggers = conn.execute("SELECT name, sql FROM sqlite_master WHERE type = 'trigger'").fetchall()
    for name, _ in triggers:
        conn.execute(f"DROP TRIGGER {name}")
    conn.dropped = [sql for _, sql in triggers]
    return conn


def rehash(conn) -> None:
    """Recompute every entry's prev_hash and hash in order, so the chain verifies again after an edit."""
    from gatekeeper.ledger.chain import GENESIS, entry_hash

    prev = GENESIS
    for seq, kind, record_id, payload in conn.execute(
            "SELECT seq, kind, record_id, payload FROM entry ORDER BY seq").fetchall():
        h = entry_hash(seq, prev, kind, record_id, json.loads(payload))
        conn.execute("UPDATE entry SET prev_hash = ?, hash = ? WHERE seq = ?", (prev, h, seq))
        prev = h


def rewrite_row(conn, kind: str, record_id: int, **values) -> None:
    """Change a typed row and its entry's payload to match, then re-hash the whole chain."""
    sets = ", ".join(f"{k} = ?" for k in values)
    conn.execute(f"UPDATE {kind} SET {sets} WHERE id = ?", (*values.values(), record_id))
    (payload,) = conn.execute("SELECT payload FROM entry WHERE kind = ? AND record_id = ?", (kind, record_id)).fetchone()
    payload = {**json.loads(payload), **values}
    conn.execute("UPDATE entry SET payload = ? WHERE kind = ? AND record_id = ?",
                 (canonical_json(payload).decode(), kind, record_id))
    rehash(conn)
