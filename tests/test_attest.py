"""ledger attest / verify-attestation: an in-toto Statement v1 about a real evaluation in a DSSE envelope signed
with real ssh-keygen keys, checked both here and by in-toto's own libraries (securesystemslib's DSSE Envelope and
SSlibKey, in_toto_attestation's v1 Statement), including edited statements, foreign keys and a rewritten ledger."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SUITE, profile
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed448

# in-toto's own libraries (the optional extra intoto, which make test installs): missing, this module fails, never skips
from google.protobuf import json_format
from in_toto_attestation.v1 import statement_pb2
from in_toto_attestation.v1.statement import Statement
from securesystemslib.dsse import Envelope
from securesystemslib.exceptions import VerificationError
from securesystemslib.signer import SSlibKey
from trust import SSH_KEYGEN, allowed_line, keys, rewrite_row, unlocked  # noqa: F401

from gatekeeper import signing
from gatekeeper.identity import canonical_json
from gatekeeper.ledger import Ledger, dsse, intoto

# who -> the scheme securesystemslib's SSlibKey.from_crypto gives that key, which the envelope must be signed under
SCHEMES = {"ana": "ed25519", "dee": "ecdsa-sha2-nistp256", "p384": "ecdsa-sha2-nistp384", "p521": "ecdsa-sha2-nistp521",
           "cy": "rsassa-pss-sha256"}


def run(ws: Path, *args: str) -> tuple[int, dict | str]:
    """The real CLI in-process; (exit code, the --json document or, without --json, stdout)."""
    from typer.testing import CliRunner

    from gatekeeper.cli import app

    result = CliRunner().invoke(app, ["--workspace", str(ws), *map(str, args)], catch_exceptions=False)
    return result.exit_code, (json.loads(result.stdout) if "--json" in args else result.stdout + result.stderr)


@pytest.fixture(scope="module")
def all_keys(keys, tmp_path_factory) -> dict[str, Path]:
    """trust.py's keys plus ECDSA nistp384 and nistp521 ones."""
    folder, out = tmp_path_factory.mktemp("ecdsa"), dict(keys)
    for bits in (384, 521):
        out[f"p{bits}"] = folder / f"p{bits}"
        subprocess.run([SSH_KEYGEN, "-q", "-t", "ecdsa", "-b", str(bits), "-N", "", "-C", f"p{bits}", "-f", str(out[f"p{bits}"])],
                       check=True)
    return out


@pytest.fixture(scope="module")
def ws(tiny_llama, all_keys, tmp_path_factory) -> Path:
    """A workspace with one real PASS evaluation (id 1) on the tiny model, calibrated, and approved and turned on
    by a signed flip; allowed_signers lists everyone but mallory."""
    from gatekeeper.setup.scaffold import init_workspace

    root = tmp_path_factory.mktemp("attest") / "ws"
    init_workspace(root)
    (root / "assertions" / "assistant.yaml").unlink()
    (root / "assertions" / "tiny.yaml").write_text(SUITE)
    (root / "engines" / "tiny.yaml").write_text(profile("torch", tiny_llama))
    policy = root / "policies" / "prefix_cache.yaml"
    policy.write_text("".join(line for line in policy.read_text().splitlines(keepends=True) if not line.startswith("min_power:")))
    (root / "policies" / "allowed_signers").write_text("".join(allowed_line(n, all_keys[n]) for n in SCHEMES))
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("GATEKEEPER_WORKSPACE", raising=False)
        mp.delenv("GATEKEEPER_SIGNING_KEY", raising=False)
        code, out = run(root, "evaluate", "--flag", "prefix_cache", "--engine", "tiny", "--limit", "1", "--operator", "ci", "--json")
        assert code == 0 and out["verdict"] == "PASS" and out["evaluation_id"] == 1, out
        code, out = run(root, "calibrate", "--evaluation", "1", "--operator", "cal", "--json")
        assert code == 0, out
        code, out = run(root, "flip", "prefix_cache", "on", "--evaluation", "1", "--operator", "ana", "--reason", "reviewed",
                        "--sign", all_keys["ana"], "--json")
        assert code == 0 and out["state"] == "on", out
    return root


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.delenv("GATEKEEPER_WORKSPACE", raising=False)
    monkeypatch.delenv("GATEKEEPER_SIGNING_KEY", raising=False)


@pytest.fixture(scope="module")
def attested(ws, all_keys) -> Path:
    """Evaluation 1 attested with ana's ed25519 key."""
    path = ws / "eval-1.intoto.json"
    code, out = run(ws, "ledger", "attest", "1", "--sign", all_keys["ana"], "--output", path, "--json")
    assert code == 0, out
    return path


def sslib_key(key: Path, keyid: str | None = None) -> SSlibKey:
    """securesystemslib's key for an SSH public key file, under the keyid gatekeeper writes (its SSH fingerprint)."""
    public = serialization.load_ssh_public_key(key.with_name(key.name + ".pub").read_bytes())
    blob = base64.b64decode(key.with_name(key.name + ".pub").read_text().split()[1])
    return SSlibKey.from_crypto(public, keyid=keyid or signing.fingerprint(blob))


def envelope_of(path: Path) -> dict:
    return json.loads(path.read_text())


def payload_of(env: dict) -> dict:
    return json.loads(base64.b64decode(env["payload"]))


def with_payload(env: dict, statement: dict) -> dict:
    return {**env, "payload": base64.b64encode(canonical_json(statement)).decode()}


def verify(ws: Path, path: Path, *extra) -> tuple[int, dict]:
    return run(ws, "ledger", "verify-attestation", path, *extra, "--json")


# --- the statement and its signature, in in-toto's own libraries and here ------------------------


@pytest.mark.parametrize("who", list(SCHEMES))  # ed25519, ECDSA nistp256, 384 and 521, RSA 3072
def test_attestation_verifies_in_securesystemslib_in_toto_and_here(ws, all_keys, tmp_path, who):
    path = tmp_path / "att.json"
    code, out = run(ws, "ledger", "attest", "1", "--sign", all_keys[who], "--output", path, "--json")
    assert code == 0, out
    assert out["signer"]["principal"] == who and out["signer"]["scheme"] == SCHEMES[who]
    raw = envelope_of(path)
    assert raw["payloadType"] == "application/vnd.in-toto+json" and raw == out["envelope"]

    # securesystemslib: the DSSE envelope, PAE and signature, with a key built from the same public key
    env = Envelope.from_dict(envelope_of(path))
    key = sslib_key(all_keys[who])
    assert key.scheme == SCHEMES[who]
    assert set(env.verify([key], 1)) == {key.keyid} == {raw["signatures"][0]["keyid"]}

    # in_toto_attestation: the payload is a valid in-toto Statement v1
    statement = json_format.Parse(env.payload, statement_pb2.Statement())
    Statement.copy_from_pb(statement).validate()
    assert statement.type == "https://in-toto.io/Statement/v1"
    assert statement.predicate_type == intoto.PREDICATE_TYPE == "https://gatekeeper.dev/evaluation/v1"

    # the subjects are the digests the ledger recorded for evaluation 1
    with Ledger(f"sqlite:///{ws / 'ledger' / 'evidence.db'}") as lg:
        evaluation, head = lg.evaluation(1), lg.head()
        flips = lg.flips("prefix_cache")
    on = evaluation["identity"]["on"]
    digests = {s.name: s.digest["sha256"] for s in statement.subject}
    assert digests == {"model": on["engine"]["model_digest"], "battery": on["battery_digest"], "policy": on["policy_digest"]}
    pred = json.loads(env.payload)["predicate"]
    assert pred["verdict"] == "PASS" and pred["identity"] == evaluation["identity"]
    assert pred["strength"]["grade"] == evaluation["verdict_record"]["summary"]["strength"]["grade"]
    assert [c["id"] for c in pred["calibrations"]] == [1] and pred["calibrations"][0]["result"]["faults"]
    assert [a["operator"] for a in pred["approvals"]] == ["ana"] and pred["approvals"][0]["signer"] == "ana"
    assert [(f["id"], f["state"]) for f in pred["flips"]] == [(f["id"], "on") for f in flips]
    assert {k: pred["ledger"][k] for k in ("seq", "hash", "entries")} == head

    code, result = verify(ws, path)
    assert code == 0 and result["ok"], result
    assert result["signer"] == {"principal": who, "keyid": key.keyid, "key_type": signing.key_type(
        base64.b64decode(all_keys[who].with_name(f"{who}.pub").read_text().split()[1]))}
    assert result["ledger"]["checked"] and result["ledger"]["checkpoint"]["ok"]
    assert result["statement"]["evaluation"] == 1 and result["statement"]["verdict"] == "PASS"


def test_printed_envelope_and_plain_output(ws, all_keys, attested, tmp_path):
    code, text = run(ws, "ledger", "attest", "1", "--sign", all_keys["dee"])
    assert code == 0
    printed = tmp_path / "printed.json"
    printed.write_text(text)
    Envelope.from_dict(json.loads(text)).verify([sslib_key(all_keys["dee"])], 1)
    code, text = run(ws, "ledger", "verify-attestation", printed)
    assert code == 0 and text.startswith("attestation ok: evaluation 1 (prefix_cache, PASS), signed by dee"), text
    code, text = run(ws, "ledger", "attest", "1", "--sign", all_keys["ana"], "--output", tmp_path / "o.json")
    assert code == 0 and "attested by ana" in text and "model: sha256:" in text


def test_edited_statement_fails_in_securesystemslib_and_here(ws, all_keys, attested, tmp_path):
    env = envelope_of(attested)
    statement = payload_of(env)
    statement["predicate"]["reasons"] = ["waived: nothing to see"]
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(with_payload(env, statement)))  # the payload changed, the signature kept
    with pytest.raises(VerificationError):
        Envelope.from_dict(envelope_of(edited)).verify([sslib_key(all_keys["ana"])], 1)
    code, result = verify(ws, edited)
    assert code == 1 and result["problem"].startswith("bad_signature:"), result
    assert "edited" in result["problem"] and result["signer"] is None
    code, text = run(ws, "ledger", "verify-attestation", edited)
    assert code == 1 and text.startswith("attestation BAD: bad_signature:")

    # An allowed signer who edits and signs again passes securesystemslib: the ledger is what catches it.
    statement = payload_of(env)
    statement["predicate"]["verdict"] = "FAIL"
    dee = signing.load_key(all_keys["dee"])
    statement["predicate"]["signer"] = {**statement["predicate"]["signer"], "principal": "dee", "keyid": dee.fingerprint,
                                        "key": " ".join(all_keys["dee"].with_name("dee.pub").read_text().split()[:2]),
                                        "scheme": "ecdsa-sha2-nistp256"}
    resigned = tmp_path / "resigned.json"
    resigned.write_text(intoto.text(dsse.sign(dee, intoto.PAYLOAD_TYPE, canonical_json(statement))))
    Envelope.from_dict(envelope_of(resigned)).verify([sslib_key(all_keys["dee"])], 1)
    code, result = verify(ws, resigned)
    assert code == 1 and result["problem"].startswith("mismatch:") and "verdict" in result["problem"], result


def test_foreign_key_is_an_unknown_signer_and_fails_in_securesystemslib(ws, all_keys, attested, tmp_path):
    mallory = signing.load_key(all_keys["mallory"])
    env = envelope_of(attested)
    payload = base64.b64decode(env["payload"])
    forged = tmp_path / "forged.json"
    forged.write_text(intoto.text(dsse.sign(mallory, env["payloadType"], payload)))  # ana's statement, mallory's signature
    ana_key = sslib_key(all_keys["ana"])
    with pytest.raises(VerificationError):
        Envelope.from_dict(envelope_of(forged)).verify([ana_key], 1)
    with pytest.raises(VerificationError):  # ana's key offered under mallory's keyid: the signature itself fails
        Envelope.from_dict(envelope_of(forged)).verify([sslib_key(all_keys["ana"], keyid=mallory.fingerprint)], 1)
    Envelope.from_dict(envelope_of(forged)).verify([sslib_key(all_keys["mallory"])], 1)  # it is mallory's signature
    code, result = verify(ws, forged)
    assert code == 1 and result["problem"].startswith("unknown_signer:") and mallory.fingerprint in result["problem"], result

    # Claiming to be mallory throughout: named as the unlisted key it is, with the line that would list it.
    statement = payload_of(env)
    statement["predicate"]["signer"] = {**statement["predicate"]["signer"], "principal": "mallory", "keyid": mallory.fingerprint,
                                        "key": " ".join(all_keys["mallory"].with_name("mallory.pub").read_text().split()[:2])}
    forged.write_text(intoto.text(dsse.sign(mallory, intoto.PAYLOAD_TYPE, canonical_json(statement))))
    code, result = verify(ws, forged)
    assert code == 1 and result["problem"].startswith("unknown_signer:") and "does not list" in result["problem"], result

    # gatekeeper will not sign with a key allowed_signers does not list: exit 2, nothing written
    out = tmp_path / "never.json"
    code, result = run(ws, "ledger", "attest", "1", "--sign", all_keys["mallory"], "--output", out, "--json")
    assert code == 2 and "unknown_signer" in result["error"] and not out.exists()
    # and another allowed_signers (mallory's only) does not vouch for ana's attestation
    only = tmp_path / "allowed_signers"
    only.write_text(allowed_line("mallory", all_keys["mallory"]))
    code, result = verify(ws, attested, "--allowed-signers", only)
    assert code == 1 and result["problem"].startswith("unknown_signer:"), result


def test_signed_but_not_a_gatekeeper_statement(ws, all_keys, attested, tmp_path):
    ana, statement = signing.load_key(all_keys["ana"]), payload_of(envelope_of(attested))
    path = tmp_path / "other.json"
    for payload_type, edit, expected in [
        ("text/plain", {}, "payloadType is 'text/plain'"),
        (intoto.PAYLOAD_TYPE, {"predicateType": "https://slsa.dev/provenance/v1"}, "not gatekeeper's"),
        (intoto.PAYLOAD_TYPE, {"_type": "https://in-toto.io/Statement/v0.1"}, "not an in-toto Statement v1"),
        (intoto.PAYLOAD_TYPE, {"predicate": [1]}, "'predicate' is missing or not an object"),
        (intoto.PAYLOAD_TYPE, {"subject": []}, "'subject'"),
    ]:
        path.write_text(intoto.text(dsse.sign(ana, payload_type, canonical_json({**statement, **edit}))))
        code, result = verify(ws, path)
        assert code == 1 and result["problem"].startswith("wrong_type:") and expected in result["problem"], result


def test_ledger_that_no_longer_matches(ws, attested, tmp_path):
    copy = tmp_path / "ws"
    shutil.copytree(ws, copy)
    code, result = verify(copy, attested)
    assert code == 0, result  # the copy is the same ledger, named relative to its workspace
    code, out = run(copy, "flip", "prefix_cache", "off", "--operator", "ana", "--reason", "later", "--json")
    assert code == 0, out
    code, result = verify(copy, attested)
    assert code == 0, result  # a ledger that grew still extends the checkpoint
    conn = unlocked(copy / "ledger" / "evidence.db")
    rewrite_row(conn, "verdict", 1, reasons=json.dumps(["rewritten"]))  # the chain re-hashed: only a checkpoint shows it
    conn.close()
    code, result = verify(copy, attested)
    assert code == 1 and result["problem"].startswith("forked:"), result
    assert any(p.startswith("mismatch:") and "reasons" in p for p in result["problems"]), result


def test_no_ledger_at_hand_checks_the_envelope_only(ws, attested, tmp_path):
    elsewhere = tmp_path / "auditor"
    elsewhere.mkdir()
    code, result = verify(elsewhere, attested, "--allowed-signers", ws / "policies" / "allowed_signers")
    assert code == 0 and result["ledger"]["checked"] is False and "no ledger" in result["ledger"]["why"], result
    code, result = verify(elsewhere, attested)  # and no allowed_signers there either
    assert code == 2 and "--allowed-signers" in result["error"]


# --- bad input: exit 2 naming the file, nothing written ------------------------------------------


@pytest.mark.parametrize("content, expected", [
    ("not json at all", "not JSON"),
    ("[1, 2]", "not a DSSE envelope"),
    ('{"payloadType": "application/vnd.in-toto+json", "signatures": []}', "'payload'"),
    ('{"payloadType": "x", "payload": "e30=", "signatures": []}', "'signatures' is missing or empty"),
    ('{"payloadType": "x", "payload": "!!", "signatures": [{"keyid": "k", "sig": "AA=="}]}', "'payload' is not base64"),
    ('{"payloadType": "x", "payload": "e30=", "signatures": [{"keyid": "k"}]}', "signatures[0]"),
])
def test_garbage_envelope_exits_2_naming_the_file(ws, tmp_path, content, expected):
    path = tmp_path / "garbage.json"
    path.write_text(content)
    code, result = verify(ws, path)
    assert code == 2 and str(path) in result["error"] and expected in result["error"], result


def test_unreadable_inputs_exit_2(ws, all_keys, tmp_path):
    code, result = verify(ws, tmp_path / "missing.json")
    assert code == 2 and "missing.json: no such file" in result["error"]
    (tmp_path / "binary").write_bytes(b"\xff\xfe\x00garbage")
    code, result = verify(ws, tmp_path / "binary")
    assert code == 2 and "binary: not UTF-8" in result["error"]
    code, result = verify(ws, tmp_path / "binary", "--allowed-signers", tmp_path / "nope")
    assert code == 2  # the envelope is read first


def test_wrong_keys_and_evaluations_exit_2_writing_nothing(ws, all_keys, tmp_path):
    out = tmp_path / "att.json"
    ed448_key = tmp_path / "ed448.pem"  # a key type SSH signatures (and gatekeeper) do not use
    ed448_key.write_bytes(ed448.Ed448PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    garbage = tmp_path / "garbage_key"
    garbage.write_text("not a key\n")
    for args, expected in [
        (["--sign", ed448_key], f"{ed448_key}: Ed448PrivateKey keys are not supported"),
        (["--sign", all_keys["ana"].with_name("ana.pub")], "this is a public key"),
        (["--sign", garbage], f"{garbage}: not an SSH private key"),
        (["--sign", tmp_path / "absent"], "no such file"),
        ([], "pass --sign KEY"),
    ]:
        code, result = run(ws, "ledger", "attest", "1", *args, "--output", out, "--json")
        assert code == 2 and expected in result["error"], (args, result)
    for eid, expected in [(7, "no evaluation 7"), (0, "no evaluation 0")]:
        code, result = run(ws, "ledger", "attest", eid, "--sign", all_keys["ana"], "--output", out, "--json")
        assert code == 2 and expected in result["error"], result
    code, result = run(ws, "ledger", "attest", "1", "--sign", all_keys["ana"], "--output", tmp_path / "no" / "f.json", "--json")
    assert code == 2 and "--output" in result["error"]
    assert not out.exists()


def test_statement_of_a_tampered_ledger_is_refused(ws, all_keys, tmp_path):
    copy = tmp_path / "ws"
    shutil.copytree(ws, copy)
    conn = unlocked(copy / "ledger" / "evidence.db")
    conn.execute("UPDATE verdict SET reasons = '[\"edited\"]' WHERE id = 1")  # no re-hash: verify names it
    conn.close()
    code, result = run(copy, "ledger", "attest", "1", "--sign", all_keys["ana"], "--output", tmp_path / "a.json", "--json")
    assert code == 2 and "does not verify" in result["error"] and not (tmp_path / "a.json").exists()


# --- the parts on their own ----------------------------------------------------------------------


def test_pae_is_dsse_v1():
    assert dsse.pae("http://example.com/HelloWorld", b"hello world") == \
        b"DSSEv1 29 http://example.com/HelloWorld 11 hello world"
    assert dsse.pae("t", "é".encode()) == b"DSSEv1 1 t 2 \xc3\xa9"  # byte lengths, not characters


def test_subjects_follow_the_identity():
    adapter, base, model, battery = "a" * 64, "b" * 64, "c" * 64, "d" * 64
    side = {"battery_digest": battery, "policy_digest": "e" * 64}
    pred = {"evaluation": {"flag": "adapter", "gate": "non_inferiority", "cases": ["s/1"]}, "identity": {
        "off": {**side, "engine": {"model_digest": model, "adapter_digest": None}},
        "on": {**side, "engine": {"model_digest": model, "adapter_digest": adapter}}}}
    got = {s["name"]: (s["digest"]["sha256"], s["annotations"]) for s in intoto.subjects(pred)}
    assert got == {"model": (model, {"recorded": "identity.on.engine.model_digest"}),
                   "adapter": (adapter, {"recorded": "identity.on.engine.adapter_digest"}),
                   "battery": (battery, {"recorded": "identity.on.battery_digest"}),
                   "policy": ("e" * 64, {"recorded": "identity.on.policy_digest"})}
    pred["identity"]["off"]["engine"]["adapter_digest"] = base  # a LoRA in force, replaced by the candidate
    assert {s["name"] for s in intoto.subjects(pred)} == {"model", "adapter", "baseline-adapter", "battery", "policy"}
    # nothing recorded as a SHA-256: derived from what was, and said so
    bare = {"evaluation": {"flag": "f", "gate": "byte_equivalence", "cases": ["s/1"]},
            "identity": {"off": {"engine": {"engine": "sim"}}, "on": {"engine": {"engine": "sim"}}}}
    derived = {s["name"]: s["annotations"] for s in intoto.subjects(bare)}
    assert derived == {"model": {"derived": "identity.on.engine"}, "battery": {"derived": "evaluation.cases"},
                       "policy": {"derived": "evaluation.gate"}}


def test_the_cli_needs_no_in_toto_library(ws, attested):
    code = ("import sys; from typer.testing import CliRunner; from gatekeeper.cli import app; "
            f"r = CliRunner().invoke(app, ['--workspace', {str(ws)!r}, 'ledger', 'verify-attestation', {str(attested)!r}]); "
            "assert r.exit_code == 0, r.stdout; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('securesystemslib', 'in_toto', 'in_toto_attestation')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out
