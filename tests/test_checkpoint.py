"""Checkpoints: the ledger's head kept outside the database shows what the hash chain alone cannot:
a cut-off tail, a rewrite re-hashed to the end, rows forged with correct hashes. The attacks run on SQLite
and PostgreSQL both (backend_ws); what the chain does not hash, the triggers and ``migrations``, verify
finds by itself. The shipped policy records a checkpoint in the workspace after every flip, and a plain
``ledger verify`` checks every one recorded."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from postgres import Raw
from trust import (  # noqa: F401
    backend_ws,
    cli,
    db_of,
    flip,
    keys,
    ledger_of,
    rehash,
    rewrite_row,
    set_approvals,
    ssh_sign,
    ssh_verify,
    trust_ws,
    unlocked,
)

from gatekeeper.ledger import Ledger
from gatekeeper.ledger import checkpoint as cp
from gatekeeper.ledger.chain import append
from gatekeeper.ledger.database import make_engine, write
from gatekeeper.ledger.tables import KINDS

pytest_plugins = ["postgres"]


def lg(ws: Path) -> Ledger:
    return Ledger(ledger_of(ws))


def checkpoint(run_cli, ws: Path, out: Path, *extra) -> dict:
    code, data = cli(run_cli, ws, "ledger", "checkpoint", "--output", out, *extra)
    assert code == 0, data
    return data


def verify(run_cli, ws: Path, *checkpoints: Path):
    return cli(run_cli, ws, "ledger", "verify", *(a for c in checkpoints for a in ("--checkpoint", c)))


def on_then_off(run_cli, ws: Path, keys) -> None:
    """evaluation 1 (seq 1, verdict seq 2), signed approval (3) and flip on (4), flip off (5)."""
    assert flip(run_cli, ws, "on", "--sign", keys["ana"], operator="ana")[0] == 0
    assert flip(run_cli, ws, "off", "--sign", keys["ana"], operator="ana", evaluation=None)[0] == 0


def state(ws: Path) -> str:
    with lg(ws) as ledger:
        return ledger.flag_states()["prefix_cache"]["state"]


def test_a_checkpoint_holds_the_head_and_verifies(run_cli, trust_ws, keys, tmp_path):
    on_then_off(run_cli, trust_ws, keys)
    data = checkpoint(run_cli, trust_ws, tmp_path / "cp.json", "--sign", keys["bob"])
    with lg(trust_ws) as ledger:
        last = ledger.entries()[-1]
    assert (data["seq"], data["hash"], data["entries"], data["signer"]) == (5, last["hash"], 5, "bob")
    on_disk = json.loads((tmp_path / "cp.json").read_text())
    assert set(on_disk) == {"type", "ledger", "seq", "hash", "entries", "at", "signer", "signature"}
    # the signature is SSHSIG over the body: ssh-keygen checks it as well
    (tmp_path / "body").write_bytes(cp.message(on_disk))
    (tmp_path / "body.sig").write_text(on_disk["signature"])
    assert ssh_verify(trust_ws / "policies" / "allowed_signers", "bob", tmp_path / "body.sig", cp.message(on_disk)).returncode == 0

    assert flip(run_cli, trust_ws, "on", "--sign", keys["ana"], operator="ana")[0] == 0  # appending is extending
    code, report = verify(run_cli, trust_ws, tmp_path / "cp.json")
    assert code == 0 and report["ok"] and report["checkpoints"][0]["ok"], report

    code, text, _ = run_cli("--workspace", trust_ws, "ledger", "checkpoint")  # no --output: printed
    assert code == 0 and json.loads(text)["seq"] == 7 and "signature" not in json.loads(text)


def test_a_checkpoint_survives_moving_the_workspace_but_not_another_ledger(run_cli, trust_ws, keys, tmp_path):
    on_then_off(run_cli, trust_ws, keys)
    checkpoint(run_cli, trust_ws, tmp_path / "cp.json")
    moved = tmp_path / "moved"
    shutil.copytree(trust_ws, moved)
    assert verify(run_cli, moved, tmp_path / "cp.json")[0] == 0
    other = tmp_path / "other.db"
    shutil.copy(db_of(trust_ws), other)
    code, out, _ = run_cli("--workspace", trust_ws, "--ledger", f"sqlite:///{other}", "ledger", "verify",
                           "--checkpoint", tmp_path / "cp.json", "--json")
    report = json.loads(out)
    assert code == 1 and report["problem"].startswith("other_ledger:"), report


# --- the workspace's own checkpoints (the shipped policy's checkpoint_after_flip) ------------------


def log(ws: Path) -> list[dict]:
    return [json.loads(line) for line in (ws / "ledger" / "checkpoints.jsonl").read_text().splitlines()]


def test_the_shipped_policy_records_a_checkpoint_after_every_flip(run_cli, backend_ws, keys):
    from gatekeeper.workspace import Workspace

    assert Workspace(backend_ws).policy("prefix_cache").approvals.checkpoint_after_flip  # as `init` lays it out
    code, result = flip(run_cli, backend_ws, "on", "--sign", keys["ana"], operator="ana")
    assert code == 0 and result["action"] == "flipped", result
    first = (backend_ws / "ledger" / "checkpoints.jsonl").read_text()
    with lg(backend_ws) as ledger:
        head = ledger.entries()[-1]
    assert head["kind"] == "flip"  # written after the flip was committed: its head is the flip itself
    [cp1] = log(backend_ws)
    assert (cp1["seq"], cp1["hash"], cp1["signer"]) == (head["seq"], head["hash"], "ana")  # signed with the flip's key
    assert result["checkpoint"] == {"file": str(backend_ws / "ledger" / "checkpoints.jsonl"), "seq": head["seq"],
                                    "signer": "ana"}

    assert flip(run_cli, backend_ws, "off", operator="bob", evaluation=None)[0] == 0  # unsigned flip, unsigned checkpoint
    assert (backend_ws / "ledger" / "checkpoints.jsonl").read_text().startswith(first)  # the file extends
    cp1_again, cp2 = log(backend_ws)
    assert cp1_again == cp1 and cp2["seq"] == head["seq"] + 1 and "signature" not in cp2
    assert json.loads((backend_ws / "ledger" / "checkpoint.json").read_text()) == cp2  # the newest, for one-file readers

    code, report = verify(run_cli, backend_ws)
    assert code == 0 and report["checkpoint_sources"] == {"workspace": 2, "given": 0}, report
    assert [c["ok"] for c in report["checkpoints"]] == [True, True]


def test_plain_verify_finds_a_cut_tail_by_the_workspace_checkpoints(run_cli, backend_ws, keys):
    on_then_off(run_cli, backend_ws, keys)
    conn = unlocked(ledger_of(backend_ws))  # delete the flip that turned the flag back off, entry and row
    conn.execute("DELETE FROM entry WHERE seq = 5")
    conn.execute("DELETE FROM flip WHERE id = 2")
    conn.close()
    with lg(backend_ws) as ledger:
        assert ledger.verify().ok  # the chain alone cannot tell
    code, report = verify(run_cli, backend_ws)  # no options
    named = f"{backend_ws / 'ledger' / 'checkpoints.jsonl'}:2"
    assert code == 1 and report["problem"].startswith(f"truncated: the ledger ends at seq 4, below checkpoint {named} "), report


def test_plain_verify_finds_a_forged_tail(run_cli, backend_ws, keys):
    on_then_off(run_cli, backend_ws, keys)
    forge_on(backend_ws)  # an approval and a flip appended with correct hashes, no checkpoint recorded for them
    with lg(backend_ws) as ledger:
        assert ledger.verify().ok
    code, report = verify(run_cli, backend_ws)
    assert code == 1 and report["problem"].startswith(
        "no_checkpoint: prefix_cache's last flip (seq 7) is after the newest good checkpoint, at seq 5"), report
    assert str(backend_ws / "ledger" / "checkpoints.jsonl") in report["problem"]


def test_plain_verify_finds_a_tail_cut_and_forged_anew(run_cli, backend_ws, keys):
    on_then_off(run_cli, backend_ws, keys)
    conn = unlocked(ledger_of(backend_ws))
    conn.execute("DELETE FROM entry WHERE seq = 5")
    conn.execute("DELETE FROM flip WHERE id = 2")
    conn.close()
    forge_on(backend_ws)  # seq 5 and 6 anew: as long as the ledger was, with other entries
    code, report = verify(run_cli, backend_ws)
    named = f"{backend_ws / 'ledger' / 'checkpoints.jsonl'}:2"
    assert code == 1 and report["problem"].startswith("forked: entry seq 5 is") and named in report["problem"], report


def test_a_workspace_without_checkpoints_verifies_as_before_and_says_so(run_cli, trust_ws, keys):
    set_approvals(trust_ws)  # an older policy: checkpoint_after_flip left out, so off
    on_then_off(run_cli, trust_ws, keys)
    assert not (trust_ws / "ledger" / "checkpoints.jsonl").exists()
    code, report = verify(run_cli, trust_ws)
    assert code == 0 and report["checkpoints"] == [] and report["checkpoint_sources"] == {"workspace": 0, "given": 0}


def test_a_given_checkpoint_is_checked_besides_the_workspaces(run_cli, trust_ws, keys, tmp_path):
    on_then_off(run_cli, trust_ws, keys)
    checkpoint(run_cli, trust_ws, tmp_path / "cp.json")
    code, report = verify(run_cli, trust_ws, tmp_path / "cp.json")
    assert code == 0 and report["checkpoint_sources"] == {"workspace": 2, "given": 1}, report
    assert report["checkpoints"][0]["file"] == str(tmp_path / "cp.json")


def test_a_checkpoint_that_cannot_be_recorded_does_not_lose_the_flip(run_cli, trust_ws, keys):
    (trust_ws / "ledger" / "checkpoints.jsonl").mkdir()  # in the way: appending to it fails after the flip
    code, result = flip(run_cli, trust_ws, "on", "--sign", keys["ana"], operator="ana")
    assert code == 1 and result["action"] == "flipped" and result["state"] == "on", result
    assert result["checkpoint"]["error"].startswith("checkpoint_failed: prefix_cache is on (the ledger holds the flip)")
    assert "gatekeeper ledger checkpoint --record --sign KEY" in result["checkpoint"]["error"]
    assert state(trust_ws) == "on"
    (trust_ws / "ledger" / "checkpoints.jsonl").rmdir()
    assert verify(run_cli, trust_ws)[1]["problem"].startswith("no_checkpoint: prefix_cache's last flip (seq 4) is after every checkpoint")
    code, data = cli(run_cli, trust_ws, "ledger", "checkpoint", "--record", "--sign", keys["ana"])  # as it says
    assert code == 0 and data["recorded"] == str(trust_ws / "ledger" / "checkpoints.jsonl") and data["seq"] == 4
    assert verify(run_cli, trust_ws)[0] == 0


def test_a_line_of_the_log_that_is_no_checkpoint_is_exit_2_naming_it(run_cli, trust_ws, keys):
    on_then_off(run_cli, trust_ws, keys)
    path = trust_ws / "ledger" / "checkpoints.jsonl"
    path.write_text(path.read_text() + '{"type": "gatekeeper.checkpoint", "seq": 9}\n')
    code, report = verify(run_cli, trust_ws)
    assert code == 2 and report["error"].startswith(f"{path} line 3: field 'ledger' is missing"), report
    good = path.read_text().splitlines(keepends=True)[:2]
    path.write_text("".join(good) + '{"type": "gatekeeper.chec')  # a line cut short, then a record
    assert cli(run_cli, trust_ws, "ledger", "checkpoint", "--record")[0] == 0
    assert json.loads(path.read_text().splitlines()[-1])["seq"] == 5  # its own line, not joined to the cut one
    code, report = verify(run_cli, trust_ws)
    assert code == 2 and report["error"].startswith(f"{path} line 3: not a JSON checkpoint"), report


# --- the motivating attacks --------------------------------------------------------------------


def test_attack_a_deleting_the_last_flip_is_truncation(run_cli, backend_ws, keys, tmp_path):
    set_approvals(backend_ws)  # a policy that records no checkpoints of its own: only the one given shows it
    on_then_off(run_cli, backend_ws, keys)
    checkpoint(run_cli, backend_ws, tmp_path / "cp.json")
    conn = unlocked(ledger_of(backend_ws))  # delete the flip that turned the flag back off, entry and row
    conn.execute("DELETE FROM entry WHERE seq = 5")
    conn.execute("DELETE FROM flip WHERE id = 2")
    conn.close()
    assert state(backend_ws) == "on"
    with lg(backend_ws) as ledger:
        assert ledger.verify().ok  # the chain alone cannot tell
    assert verify(run_cli, backend_ws)[0] == 0  # nor can the signatures: what is left is genuine
    code, report = verify(run_cli, backend_ws, tmp_path / "cp.json")
    assert code == 1 and report["problem"].startswith("truncated: the ledger ends at seq 4, below checkpoint"), report
    assert "entry 5 were deleted" in report["problem"]


def test_attack_b_rewriting_a_verdict_and_rehashing_is_a_fork(run_cli, backend_ws, keys, tmp_path):
    on_then_off(run_cli, backend_ws, keys)
    checkpoint(run_cli, backend_ws, tmp_path / "cp.json", "--sign", keys["bob"])
    conn = unlocked(ledger_of(backend_ws))
    rewrite_row(conn, "verdict", 1, verdict="FAIL")  # PASS -> FAIL, and every later hash recomputed
    conn.close()
    with lg(backend_ws) as ledger:
        assert ledger.verify().ok and ledger.evaluation(1)["status"] == "FAIL"
    code, report = verify(run_cli, backend_ws, tmp_path / "cp.json")
    assert code == 1 and report["problem"].startswith("forked: entry seq 5 is"), report
    assert "rewritten at or before seq 5" in report["problem"]
    conn = unlocked(ledger_of(backend_ws))
    rewrite_row(conn, "verdict", 1, verdict="PASS")
    conn.close()
    assert verify(run_cli, backend_ws, tmp_path / "cp.json")[0] == 0  # put back exactly: the same hashes again


def test_cutting_the_tail_and_appending_again_is_a_fork(run_cli, backend_ws, keys, tmp_path):
    on_then_off(run_cli, backend_ws, keys)
    checkpoint(run_cli, backend_ws, tmp_path / "cp.json")
    conn = unlocked(ledger_of(backend_ws))
    conn.execute("DELETE FROM entry WHERE seq = 5")
    conn.execute("DELETE FROM flip WHERE id = 2")
    conn.close()
    assert flip(run_cli, backend_ws, "on", "--sign", keys["bob"], operator="bob")[0] == 0  # seq 5 and 6 anew
    code, report = verify(run_cli, backend_ws, tmp_path / "cp.json")
    assert code == 1 and report["problem"].startswith("forked: entry seq 5 is"), report


def forge_on(ws: Path, signature: dict | None = None) -> None:
    """Append an approval and a flip to on, with correct hashes, through gatekeeper's own code."""
    engine = make_engine(ledger_of(ws))
    seal = signature or {}
    with write(engine) as conn:
        ap = append(conn, "approval", dict(flag="prefix_cache", evaluation_id=1, operator="ana", reason="ok", **seal))
        append(conn, "flip", dict(flag="prefix_cache", state="on", evaluation_id=1, operator="ana", reason="ok",
                                  approval_ids=[ap], **seal))
    engine.dispose()


def test_attack_c_a_forged_approval_and_flip_are_found(run_cli, backend_ws, keys, tmp_path):
    set_approvals(backend_ws, signed=True, checkpoint_after_flip=True)
    on_then_off(run_cli, backend_ws, keys)
    assert (backend_ws / "ledger" / "checkpoint.json").is_file()  # written by the flip itself, signed
    assert json.loads((backend_ws / "ledger" / "checkpoint.json").read_text())["signer"] == "ana"
    assert verify(run_cli, backend_ws)[0] == 0

    forge_on(backend_ws)
    assert state(backend_ws) == "on"
    with lg(backend_ws) as ledger:
        assert ledger.verify().ok  # correct hashes
    code, report = verify(run_cli, backend_ws)  # ledger/checkpoint.json by default
    problems = report["problems"]
    assert code == 1
    assert any(p.startswith("seq 6: approval 2 (prefix_cache): unsigned:") for p in problems), problems  # signatures
    assert any(p.startswith("seq 7: flip 3 (prefix_cache): unsigned:") for p in problems), problems
    assert any(p.startswith("no_checkpoint: prefix_cache's last flip (seq 7)") for p in problems), problems  # checkpoint

    # the forger writes a fresh checkpoint too, but has no allowed key to sign it with
    checkpoint(run_cli, backend_ws, backend_ws / "ledger" / "checkpoint.json")
    code, report = verify(run_cli, backend_ws)
    assert code == 1 and any(p.startswith("unsigned: no signed checkpoint covers") for p in report["problems"])


def test_attack_c_without_signatures_is_found_by_the_fresh_checkpoint_rule(run_cli, backend_ws, keys, tmp_path):
    set_approvals(backend_ws, checkpoint_after_flip=True)
    assert flip(run_cli, backend_ws, "on", operator="ana")[0] == 0
    assert flip(run_cli, backend_ws, "off", operator="ana", evaluation=None)[0] == 0
    assert verify(run_cli, backend_ws)[0] == 0
    forge_on(backend_ws)
    code, report = verify(run_cli, backend_ws)
    assert code == 1 and report["problems"] == [report["problem"]] and report["problem"].startswith("no_checkpoint:")


def test_attack_c_signed_by_an_unknown_key(run_cli, backend_ws, keys, tmp_path):
    set_approvals(backend_ws, signed=True)
    on_then_off(run_cli, backend_ws, keys)
    from gatekeeper import signing
    from gatekeeper.gate.enable import attestation
    from gatekeeper.identity import sha256_hex

    with lg(backend_ws) as ledger:
        digest = attestation.identity_digest(ledger.evaluation(1))
    at = "2999-01-01T00:00:00.000000Z"
    message = attestation.record_message(attestation.flip_record("prefix_cache", "on", 1, digest, "ana", "ok", at))
    forged = signing.load_key(keys["mallory"]).sign(message)
    forge_on(backend_ws, {"signature": forged, "signer": "ana", "signed_at": at, "record_digest": sha256_hex(message)})
    code, report = verify(run_cli, backend_ws)
    assert code == 1 and report["problem"].startswith("seq 6: approval 2 (prefix_cache): unknown_signer:"), report


def test_attack_d_dropping_every_trigger_is_found_by_verify_alone(run_cli, backend_ws, keys, backend):
    on_then_off(run_cli, backend_ws, keys)
    with Raw(ledger_of(backend_ws)) as raw:
        triggers = raw.triggers()
        raw.drop_triggers()
    # on entry and every record table: UPDATE and DELETE, and on PostgreSQL TRUNCATE too
    assert len(triggers) == (1 + len(KINDS)) * (3 if backend == "postgresql" else 2)
    code, report = verify(run_cli, backend_ws)  # no checkpoint: the chain and the rows are all still genuine
    assert code == 1 and report["first_bad_seq"] is None, report
    assert report["problems"] == [f"trigger {name}: missing; {table} is no longer append-only (it was dropped)"
                                  for name, table in triggers], report


@pytest.mark.parametrize("backend", ["postgresql"])  # SQLite has no way to switch a trigger off but dropping it
def test_attack_d_disabling_every_trigger_is_found_by_verify_alone(run_cli, backend_ws, keys, backend):
    on_then_off(run_cli, backend_ws, keys)
    with Raw(ledger_of(backend_ws)) as raw:
        triggers = raw.triggers()
        for table in {t for _, t in triggers}:
            raw.execute(f"ALTER TABLE {table} DISABLE TRIGGER ALL")  # the superuser's way: internal ones too
    code, report = verify(run_cli, backend_ws)
    assert code == 1 and report["problems"] == [
        f"trigger {name}: disabled; {table} is no longer append-only (ALTER TABLE ... DISABLE TRIGGER)"
        for name, table in triggers], report


@pytest.mark.parametrize("edit, named", [
    ("UPDATE migrations SET name = '0002_other' WHERE version = 2",
     "migrations: version 2 is recorded as '0002_other', not '0002_flush_measurement'"),
    ("DELETE FROM migrations WHERE version = 3",
     "migrations: version 3 (0003_calibration) is not recorded, yet the schema is past it"),
], ids=["renamed", "deleted"])
def test_an_edit_of_migrations_is_found_by_verify_alone(run_cli, backend_ws, keys, edit, named):
    on_then_off(run_cli, backend_ws, keys)
    with Raw(ledger_of(backend_ws)) as raw:
        raw.execute(edit)  # the migrations table has no append-only triggers: it is only written when migrating
    code, report = verify(run_cli, backend_ws)
    assert code == 1 and report["problems"] == [report["problem"]] and report["problem"].startswith(named), report


def test_a_checkpoint_whose_signature_is_bad(run_cli, backend_ws, keys, tmp_path):
    on_then_off(run_cli, backend_ws, keys)
    path = tmp_path / "cp.json"
    checkpoint(run_cli, backend_ws, path, "--sign", keys["bob"])
    conn = unlocked(ledger_of(backend_ws))  # cut the tail, and move the checkpoint down to match
    conn.execute("DELETE FROM entry WHERE seq = 5")
    conn.execute("DELETE FROM flip WHERE id = 2")
    conn.close()
    with lg(backend_ws) as ledger:
        head = ledger.entries()[-1]
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "seq": 4, "entries": 4, "hash": head["hash"]}))
    code, report = verify(run_cli, backend_ws, path)
    assert code == 1 and report["problem"].startswith("bad_signature: checkpoint"), report

    mallory = tmp_path / "mallory.json"  # signed, but by a key nobody allowed
    from gatekeeper import signing

    body = {**data, "seq": 4, "entries": 4, "hash": head["hash"]}
    body["signature"] = signing.load_key(keys["mallory"]).sign(cp.message(body))
    mallory.write_text(json.dumps(body))
    code, report = verify(run_cli, backend_ws, mallory)
    assert code == 1 and report["problem"].startswith("unknown_signer: checkpoint"), report


# --- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize("content, expected", [
    (None, "no such file"),
    ("{not json", "not a JSON checkpoint"),
    ('{"type": "something"}', "not a gatekeeper checkpoint"),
    ('{"type": "gatekeeper.checkpoint", "ledger": "x", "seq": "5", "hash": "h", "entries": 5, "at": "t"}',
     "field 'seq' is missing or not an integer"),
])
def test_a_bad_checkpoint_file_is_exit_2(run_cli, trust_ws, tmp_path, content, expected):
    path = tmp_path / "cp.json"
    if content is not None:
        path.write_text(content)
    code, report = verify(run_cli, trust_ws, path)
    assert code == 2 and expected in report["error"], report


def test_bad_checkpoint_commands_are_exit_2_and_write_nothing(run_cli, trust_ws, keys, tmp_path):
    code, out = cli(run_cli, trust_ws, "ledger", "checkpoint", "--output", tmp_path / "no" / "cp.json")
    assert code == 2 and "existing folder" in out["error"]
    code, out = cli(run_cli, trust_ws, "ledger", "checkpoint", "--sign", keys["mallory"], "--output", tmp_path / "cp.json")
    assert code == 2 and out["error"].startswith("unknown_signer:") and not (tmp_path / "cp.json").exists()
    empty = tmp_path / "empty.db"
    Ledger(f"sqlite:///{empty}").close()
    code, out, _ = run_cli("--workspace", trust_ws, "--ledger", f"sqlite:///{empty}", "ledger", "checkpoint", "--json")
    assert code == 2 and "empty" in json.loads(out)["error"]
