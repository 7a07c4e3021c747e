"""Signed approvals and flips: OpenSSH SSHSIG both ways with the real ssh-keygen, allowed_signers,
and a policy's ``approvals.signed`` judged by the signing principal."""

from __future__ import annotations

import json
import subprocess
from datetime import datetime, timezone
from pathlib import Path

import pytest
from trust import (  # noqa: F401
    SSH_KEYGEN,
    allowed_line,
    cli,
    db_of,
    flip,
    keys,
    rewrite_row,
    set_approvals,
    ssh_sign,
    ssh_verify,
    trust_ws,
    unlocked,
)

from gatekeeper import signing
from gatekeeper.errors import GatekeeperError
from gatekeeper.ledger import Ledger


def lg(ws: Path) -> Ledger:
    return Ledger(f"sqlite:///{db_of(ws)}")


def print_record(run_cli, ws: Path, folder: Path, name: str = "rec", operator: str = "bob", reason: str = "reviewed") -> Path:
    code, out, _ = run_cli("--workspace", ws, "flip", "prefix_cache", "on", "--evaluation", 1, "--operator", operator,
                           "--reason", reason, "--print-record")
    assert code == 0, out
    path = folder / name
    path.write_text(out)
    return path


# --- the SSHSIG format against the real ssh-keygen ---------------------------------------------


@pytest.mark.parametrize("who", ["ana", "cy", "dee"])  # ed25519, RSA (rsa-sha2-512), ECDSA nistp256
def test_sshsig_interoperates_with_ssh_keygen_both_ways(keys, tmp_path, who):
    allowed = tmp_path / "allowed_signers"
    allowed.write_text(allowed_line(who, keys[who]))
    message = b'{"type":"gatekeeper.flip","flag":"prefix_cache"}\n'
    key = signing.load_key(keys[who])

    ours = tmp_path / "ours.sig"
    ours.write_text(key.sign(message))
    done = ssh_verify(allowed, who, ours, message)
    assert done.returncode == 0 and b'Good "gatekeeper" signature for ' + who.encode() in done.stdout, done
    assert ssh_verify(allowed, who, ours, message + b"x").returncode != 0  # ssh-keygen can say no, too

    (tmp_path / "msg").write_bytes(message)
    theirs = ssh_sign(keys[who], tmp_path / "msg").read_text()
    sig = signing.verify(theirs, message)
    assert sig.blob == key.blob and sig.hash_alg == "sha512"
    assert signing.AllowedSigners.load(allowed).principal(sig.blob, datetime.now(timezone.utc)) == who
    with pytest.raises(signing.BadSignature, match="does not match"):
        signing.verify(theirs, message.replace(b"prefix_cache", b"static_first"))
    with pytest.raises(signing.BadSignature, match="namespace"):
        signing.verify(theirs, message, namespace="git")


def test_a_signature_for_another_namespace_is_refused(keys, tmp_path):
    (tmp_path / "msg").write_bytes(b"hello\n")
    subprocess.run([SSH_KEYGEN, "-Y", "sign", "-n", "file", "-f", str(keys["ana"]), str(tmp_path / "msg")],
                   check=True, capture_output=True)
    with pytest.raises(signing.BadSignature, match="namespace 'file'"):
        signing.verify((tmp_path / "msg.sig").read_text(), b"hello\n")


@pytest.mark.parametrize("who", ["ana", "cy"])
def test_a_gatekeeper_signed_approval_verifies_with_ssh_keygen(run_cli, trust_ws, keys, tmp_path, who):
    code, out = flip(run_cli, trust_ws, "on", "--sign", keys[who], operator=who)
    assert code == 0 and out["action"] == "flipped" and out["signer"] == who, out
    code, exported = cli(run_cli, trust_ws, "ledger", "signature", "approval", 1, "--output", tmp_path)
    assert code == 0 and exported["signer"] == who
    message = Path(exported["record"]).read_bytes()
    record = json.loads(message)
    assert (record["flag"], record["state"], record["evaluation_id"], record["operator"], record["reason"]) == \
        ("prefix_cache", "on", 1, who, "reviewed")
    assert len(record["identity_digest"]) == 64 and record["at"].endswith("Z")
    done = ssh_verify(trust_ws / "policies" / "allowed_signers", who, Path(exported["signature"]), message)
    assert done.returncode == 0, done
    # the flip the approval completed carries the same signature
    code, exported = cli(run_cli, trust_ws, "ledger", "signature", "flip", 1, "--output", tmp_path)
    assert code == 0 and Path(exported["record"]).read_bytes() == message
    code, report = cli(run_cli, trust_ws, "ledger", "verify")
    assert code == 0 and report["ok"] and report["signatures"]["checked"] == 2, report


def test_an_ssh_keygen_signature_is_accepted(run_cli, trust_ws, keys, tmp_path):
    record = print_record(run_cli, trust_ws, tmp_path, operator="bob")
    sig = ssh_sign(keys["bob"], record)
    code, out = flip(run_cli, trust_ws, "on", "--record", record, "--signature", sig, operator="bob")
    assert code == 0 and (out["action"], out["state"], out["signer"]) == ("flipped", "on", "bob"), out
    with lg(trust_ws) as ledger:
        approval = ledger.approvals("prefix_cache")[0]
        assert approval["signer"] == "bob" and approval["signature"] == sig.read_text()
        assert approval["signed_at"] == json.loads(record.read_text())["at"]
    code, report = cli(run_cli, trust_ws, "ledger", "verify")
    assert code == 0 and report["signatures"]["checked"] == 2


# --- refusals ----------------------------------------------------------------------------------


def refused(run_cli, ws, out, code, prefix):
    assert code == 1 and out["action"] == "refused" and out["state"] == "off", out
    assert out["reasons"][0].startswith(prefix), out["reasons"]
    with lg(ws) as ledger:
        assert ledger.approvals() == [] and ledger.flips() == []
        assert ledger.refusals("prefix_cache")[-1]["reasons"] == out["reasons"]


def test_a_key_not_in_allowed_signers_is_refused(run_cli, trust_ws, keys, tmp_path):
    code, out = flip(run_cli, trust_ws, "on", "--sign", keys["mallory"], operator="ana")
    refused(run_cli, trust_ws, out, code, "unknown_signer:")
    assert signing.load_key(keys["mallory"]).fingerprint in out["reasons"][0]
    sig = ssh_sign(keys["mallory"], print_record(run_cli, trust_ws, tmp_path, operator="ana"))
    code, out = flip(run_cli, trust_ws, "on", "--record", tmp_path / "rec", "--signature", sig, operator="ana")
    refused(run_cli, trust_ws, out, code, "unknown_signer:")


def test_a_signature_over_another_record_is_refused(run_cli, trust_ws, keys, tmp_path):
    first = print_record(run_cli, trust_ws, tmp_path, "first", reason="reviewed")
    sig = ssh_sign(keys["bob"], first)
    second = print_record(run_cli, trust_ws, tmp_path, "second", reason="reviewed")  # same act, a later time
    assert second.read_bytes() != first.read_bytes()
    code, out = flip(run_cli, trust_ws, "on", "--record", second, "--signature", sig, operator="bob")
    refused(run_cli, trust_ws, out, code, "bad_signature:")


def test_an_unsigned_approval_is_refused_when_the_policy_wants_signatures(run_cli, trust_ws, keys):
    set_approvals(trust_ws, signed=True)
    code, out = flip(run_cli, trust_ws, "on", operator="ana")
    refused(run_cli, trust_ws, out, code, "unsigned:")
    code, out = flip(run_cli, trust_ws, "on", "--sign", keys["ana"], operator="ana")
    assert code == 0 and out["state"] == "on"
    code, out = flip(run_cli, trust_ws, "off", operator="ana", evaluation=None)  # off needs no signature
    assert code == 0 and out["state"] == "off" and out["signer"] is None


def test_the_signing_key_can_come_from_the_environment(run_cli, trust_ws, keys, monkeypatch):
    set_approvals(trust_ws, signed=True)
    monkeypatch.setenv("GATEKEEPER_SIGNING_KEY", str(keys["ana"]))
    code, out = flip(run_cli, trust_ws, "on", operator="ana")
    assert code == 0 and out["signer"] == "ana"


def test_one_key_under_two_typed_names_counts_once(run_cli, trust_ws, keys):
    set_approvals(trust_ws, signed=True, required=2)
    code, out = flip(run_cli, trust_ws, "on", "--sign", keys["ana"], operator="ana")
    assert code == 0 and (out["action"], out["approvals"]) == ("approved", 1), out
    code, out = flip(run_cli, trust_ws, "on", "--sign", keys["ana"], operator="anna")
    assert code == 1 and out["reasons"][0].startswith("duplicate_approval: ana already approved"), out
    assert out["state"] == "off"
    code, out = flip(run_cli, trust_ws, "on", "--sign", keys["bob"], operator="ana")  # a typed name proves nothing
    assert code == 0 and (out["action"], out["state"], out["approvals"]) == ("flipped", "on", 2), out
    with lg(trust_ws) as ledger:
        assert [a["signer"] for a in ledger.approvals()] == ["ana", "bob"]


def test_self_approval_is_judged_by_the_signing_principal(run_cli, trust_ws, keys):
    set_approvals(trust_ws, signed=True)
    code, out = flip(run_cli, trust_ws, "on", "--sign", keys["ci"], operator="someone-else")  # evaluation 1 is ci's
    assert code == 1 and out["reasons"][0].startswith("self_approval: ci ran evaluation 1"), out
    code, out = flip(run_cli, trust_ws, "on", "--sign", keys["dee"], operator="ci")
    assert code == 0 and out["state"] == "on" and out["signer"] == "dee"


def test_a_signed_record_is_not_replayed_after_a_flip(run_cli, trust_ws, keys, tmp_path):
    record = print_record(run_cli, trust_ws, tmp_path, operator="bob")
    sig = ssh_sign(keys["bob"], record)
    assert flip(run_cli, trust_ws, "on", "--record", record, "--signature", sig, operator="bob")[0] == 0
    assert flip(run_cli, trust_ws, "off", operator="ana", evaluation=None)[0] == 0
    code, out = flip(run_cli, trust_ws, "on", "--record", record, "--signature", sig, operator="bob")
    assert code == 1 and out["reasons"][0].startswith("replayed:"), out


# --- bad input: exit 2, nothing written --------------------------------------------------------


def rows(ws: Path) -> int:
    with lg(ws) as ledger:
        return len(ledger.entries())


def _text(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.parametrize("make, expected", [
    (lambda d, k: ["--sign", d / "nope"], "no such file"),
    (lambda d, k: ["--sign", k["ana"].with_name("ana.pub")], "this is a public key"),
    (lambda d, k: ["--sign", _text(d / "notakey", "hello\n")], "not an SSH private key"),
    (lambda d, k: ["--signature", d / "x.sig"], "--signature and --record go together"),
    (lambda d, k: ["--sign", k["ana"], "--record", d / "r", "--signature", d / "r.sig"], "not both"),
    (lambda d, k: ["--record", d / "r", "--signature", d / "r.sig"], "--record"),  # the files do not exist
])
def test_bad_signing_input_exits_2_and_writes_nothing(run_cli, trust_ws, keys, tmp_path, make, expected):
    before = rows(trust_ws)
    code, out = flip(run_cli, trust_ws, "on", *make(tmp_path, keys))
    assert code == 2 and expected in out["error"], out
    assert rows(trust_ws) == before


def test_a_passphrase_protected_key_points_at_ssh_keygen(run_cli, trust_ws, tmp_path):
    key = tmp_path / "locked"
    subprocess.run([SSH_KEYGEN, "-q", "-t", "ed25519", "-N", "secret", "-f", str(key)], check=True)
    before = rows(trust_ws)
    code, out = flip(run_cli, trust_ws, "on", "--sign", key)
    assert code == 2 and "passphrase" in out["error"] and "ssh-keygen -Y sign" in out["error"]
    assert rows(trust_ws) == before


def test_a_record_that_is_not_this_flips_is_exit_2(run_cli, trust_ws, keys, tmp_path):
    record = print_record(run_cli, trust_ws, tmp_path, operator="bob")
    sig = ssh_sign(keys["bob"], record)
    before = rows(trust_ws)
    code, out = flip(run_cli, trust_ws, "on", "--record", record, "--signature", sig, operator="ana")
    assert code == 2 and "its operator is 'bob'" in out["error"], out
    (tmp_path / "junk").write_text("not a record\n")
    code, out = flip(run_cli, trust_ws, "on", "--record", tmp_path / "junk", "--signature", sig, operator="bob")
    assert code == 2 and "not a gatekeeper flip record" in out["error"]
    assert rows(trust_ws) == before


@pytest.mark.parametrize("line, expected", [
    ("ana ssh-ed25519 !!!notbase64\n", "line 2: the key is not valid base64"),
    ("ana*,bob ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIFUzFFDpEbRmvqJuGLCpvMEvwwbyOtx4kqrEKhsE1h5U\n", "line 2: principal"),
    ("ana cert-authority ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIFUzFFDpEbRmvqJuGLCpvMEvwwbyOtx4kqrEKhsE1h5U\n",
     "line 2: cert-authority is not supported"),
    ("ana ssh-dss AAAA\n", "line 2: key type 'ssh-dss' is not supported"),
    ("ana restrict ssh-ed25519 AAAA\n", "line 2: unknown option 'restrict'"),
    ("ana\n", "line 2: expected 'principal key-type key'"),
])
def test_a_bad_allowed_signers_line_is_exit_2_naming_file_and_line(run_cli, trust_ws, keys, line, expected):
    path = trust_ws / "policies" / "allowed_signers"
    path.write_text(allowed_line("ana", keys["ana"]) + line)
    before = rows(trust_ws)
    code, out = flip(run_cli, trust_ws, "on", "--sign", keys["ana"])
    assert code == 2 and str(path) in out["error"] and expected in out["error"], out
    assert rows(trust_ws) == before


def test_allowed_signers_options_namespaces_and_validity(keys, tmp_path):
    path = tmp_path / "allowed_signers"
    path.write_text(allowed_line("ana", keys["ana"], 'namespaces="git,file"')
                    + allowed_line("bob", keys["bob"], 'valid-after="20200101",valid-before="20300101Z"'))
    allowed = signing.AllowedSigners.load(path)
    ana, bob = (signing.load_key(keys[n]).blob for n in ("ana", "bob"))
    now = datetime(2025, 6, 1, tzinfo=timezone.utc)
    assert allowed.principal(ana, now) is None  # not for the gatekeeper namespace
    assert allowed.principal(bob, now) == "bob"
    assert allowed.principal(bob, datetime(2031, 1, 1, tzinfo=timezone.utc)) is None


def test_signing_with_no_allowed_signers_is_exit_2(run_cli, trust_ws, keys):
    (trust_ws / "policies" / "allowed_signers").unlink()
    before = rows(trust_ws)
    code, out = flip(run_cli, trust_ws, "on", "--sign", keys["ana"])
    assert code == 2 and "allowed_signers: missing" in out["error"]
    assert rows(trust_ws) == before


# --- ledger verify rechecks every signature ----------------------------------------------------


def test_verify_finds_a_signed_row_that_was_rewritten(run_cli, trust_ws, keys):
    assert flip(run_cli, trust_ws, "on", "--sign", keys["ana"], operator="ana")[0] == 0
    conn = unlocked(db_of(trust_ws))
    rewrite_row(conn, "approval", 1, reason="rubber stamp")  # row, payload and every hash made to agree
    conn.close()
    with lg(trust_ws) as ledger:
        assert ledger.verify().ok  # the chain alone cannot tell
    code, report = cli(run_cli, trust_ws, "ledger", "verify")
    assert code == 1 and not report["ok"]
    assert report["problem"].startswith("seq 3: approval 1 (prefix_cache): bad_signature:"), report
    assert report["first_bad_seq"] == 3


def test_verify_finds_a_signer_whose_key_is_no_longer_allowed(run_cli, trust_ws, keys):
    assert flip(run_cli, trust_ws, "on", "--sign", keys["ana"], operator="ana")[0] == 0
    (trust_ws / "policies" / "allowed_signers").write_text(allowed_line("bob", keys["bob"]))
    code, report = cli(run_cli, trust_ws, "ledger", "verify")
    assert code == 1 and "unknown_signer:" in report["problem"], report
    assert len(report["signatures"]["problems"]) == 2  # the approval and the flip


def test_verify_refinds_a_forged_signature_field(run_cli, trust_ws, keys, tmp_path):
    assert flip(run_cli, trust_ws, "on", "--sign", keys["ana"], operator="ana")[0] == 0
    sig = ssh_sign(keys["mallory"], print_record(run_cli, trust_ws, tmp_path, operator="ana"))
    conn = unlocked(db_of(trust_ws))
    rewrite_row(conn, "flip", 1, signature=sig.read_text())
    conn.close()
    code, report = cli(run_cli, trust_ws, "ledger", "verify")
    assert code == 1 and "flip 1 (prefix_cache): bad_signature:" in report["problem"], report


def test_migration_leaves_unsigned_rows_verifying(run_cli, trust_ws):
    assert flip(run_cli, trust_ws, "on", operator="ana")[0] == 0
    with lg(trust_ws) as ledger:
        assert ledger.verify().ok and ledger.approvals()[0]["signature"] is None
    code, report = cli(run_cli, trust_ws, "ledger", "verify")
    assert code == 0 and report["signatures"] == {"checked": 0, "problems": []}


def test_load_key_rejects_what_is_not_a_private_key(tmp_path):
    (tmp_path / "k").write_text("hello\n")
    with pytest.raises(GatekeeperError, match="not an SSH private key"):
        signing.load_key(tmp_path / "k")
