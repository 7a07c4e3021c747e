"""The in-process OpenFeature provider through the real Python SDK: the ledger's states with their reasons and
metadata, flips seen without a restart, and an unverifiable or unreadable ledger resolved as an error (the
caller's default), never as the last state. (That it answers as `flags serve` does: tests/test_ofrep.py.)"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys

import pytest
from conftest import evaluate
from trust import unlocked

DOMAIN = "gatekeeper-provider-test"


@pytest.fixture
def client_of():
    from openfeature import api

    from gatekeeper.openfeature import GatekeeperProvider

    def make(ws, **options):
        api.set_provider_and_wait(GatekeeperProvider(workspace=ws, **options), DOMAIN)
        return api.get_client(DOMAIN)

    yield make
    api.clear_providers()


def flip(run_cli, ws, state, *extra):
    code, out, _ = run_cli("--workspace", ws, "flip", "prefix_cache", state, *extra, "--operator", "ops",
                           "--reason", "test", "--json")
    assert code == 0, out


def pipeline_hash(run_cli, ws, engine="tiny"):
    code, out, _ = run_cli("--workspace", ws, "hash", "--engine", engine, "--json")
    return json.loads(out)["pipeline_hash"]


def test_states_reasons_metadata_and_a_flip_seen_live(run_cli, tiny_ws, client_of):
    client = client_of(tiny_ws, engine="tiny")
    never = client.get_boolean_details("prefix_cache", True)
    assert (never.value, never.variant, never.reason, never.error_code) == (False, "off", "DEFAULT", None)
    assert never.flag_metadata == {"pipelineHash": pipeline_hash(run_cli, tiny_ws)}

    code, out = evaluate(run_cli, tiny_ws, "tiny", "--limit", "1")
    assert out["verdict"] == "PASS", out
    flip(run_cli, tiny_ws, "on", "--evaluation", out["evaluation_id"])
    on = client.get_boolean_details("prefix_cache", False)  # the same provider: no restart
    assert (on.value, on.variant, on.reason, on.error_code) == (True, "on", "STATIC", None)
    assert on.flag_metadata["evaluationId"] == out["evaluation_id"]
    assert on.flag_metadata["pipelineHash"] == pipeline_hash(run_cli, tiny_ws) != never.flag_metadata["pipelineHash"]

    missing = client.get_boolean_details("no_such_flag", True)
    assert (missing.value, missing.error_code) == (True, "FLAG_NOT_FOUND")
    for details in (client.get_string_details("prefix_cache", "x"), client.get_integer_details("prefix_cache", 7)):
        assert details.error_code == "TYPE_MISMATCH" and details.value in ("x", 7)


def test_tampered_ledger_resolves_to_the_default_never_on(run_cli, tiny_ws, client_of):
    code, out = evaluate(run_cli, tiny_ws, "tiny", "--limit", "1")
    flip(run_cli, tiny_ws, "on", "--evaluation", out["evaluation_id"])
    flip(run_cli, tiny_ws, "off")
    client = client_of(tiny_ws, engine="tiny")
    assert client.get_boolean_details("prefix_cache", True).value is False

    db = sqlite3.connect(tiny_ws / "ledger" / "evidence.db", isolation_level=None)
    triggers = db.execute("SELECT name, sql FROM sqlite_master WHERE type = 'trigger'").fetchall()
    for name, _ in triggers:
        db.execute(f"DROP TRIGGER {name}")
    db.execute("UPDATE flip SET state = 'on' WHERE id = (SELECT max(id) FROM flip)")  # off, edited to on
    for _, sql in triggers:
        db.execute(sql)
    db.close()
    details = client.get_boolean_details("prefix_cache", False)
    assert (details.value, details.error_code, details.reason) == (False, "GENERAL", "ERROR")
    assert "does not verify" in details.error_message and "ledger verify" in details.error_message
    code, out, _ = run_cli("--workspace", tiny_ws, "ledger", "verify", "--json")
    assert code == 1  # the same judgement as the CLI's


def test_a_cut_tail_with_a_rewritten_newest_checkpoint_is_caught_by_the_recorded_ones(run_cli, tiny_ws, client_of):
    code, out = evaluate(run_cli, tiny_ws, "tiny", "--limit", "1")
    flip(run_cli, tiny_ws, "on", "--evaluation", out["evaluation_id"])
    flip(run_cli, tiny_ws, "off")
    assert len((tiny_ws / "ledger" / "checkpoints.jsonl").read_text().splitlines()) == 2  # one per flip
    client = client_of(tiny_ws, engine="tiny")
    assert client.get_boolean_details("prefix_cache", True).value is False

    db = unlocked(tiny_ws / "ledger" / "evidence.db")  # the "off" flip deleted: the flag reads "on" again
    seq, flip_id = db.execute("SELECT seq, record_id FROM entry ORDER BY seq DESC LIMIT 1").fetchone()
    db.execute("DELETE FROM entry WHERE seq = ?", (seq,))
    db.execute("DELETE FROM flip WHERE id = ?", (flip_id,))
    db.close()
    # ...and the newest checkpoint rewritten to the cut head; the committed log still has the line it had
    code, _, err = run_cli("--workspace", tiny_ws, "ledger", "checkpoint", "--output", tiny_ws / "ledger" / "checkpoint.json")
    assert code == 0, err
    details = client.get_boolean_details("prefix_cache", False)
    assert (details.value, details.error_code) == (False, "GENERAL"), details
    assert "truncated:" in details.error_message and "checkpoints.jsonl:2" in details.error_message
    code, out, _ = run_cli("--workspace", tiny_ws, "ledger", "verify", "--json")
    assert code == 1 and json.loads(out)["problem"].startswith("truncated:")  # the same judgement as the CLI's


def test_unreadable_and_missing_ledgers(workspace, client_of):
    # No ledger yet: nothing was flipped, so the policy's default, said as such.
    (workspace / "engines" / "auto.yaml").write_text("adapter: gatekeeper.engines.sim:SimEngine\nmodel: default\n")
    client = client_of(workspace)
    details = client.get_boolean_details("prefix_cache", True)
    assert (details.value, details.reason, details.error_code) == (False, "DEFAULT", None)
    assert not (workspace / "ledger" / "evidence.db").exists()  # serving never creates one

    (workspace / "ledger" / "evidence.db").write_bytes(b"this is not a SQLite database" * 100)
    details = client.get_boolean_details("prefix_cache", True)
    assert (details.value, details.error_code) == (True, "GENERAL")  # the caller's default, with the error
    assert "cannot be read" in details.error_message


def test_the_cli_never_imports_the_sdk():
    code = ("import sys, gatekeeper.cli, gatekeeper.openfeature, gatekeeper.openfeature.ofrep; "
            "assert not any(m == 'openfeature' or m.startswith('openfeature.') for m in sys.modules), sorted(sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).returncode == 0
