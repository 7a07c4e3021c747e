"""The evidence ledger on real SQLite files: lifecycle, derived status, immutability, tampering."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import inspect

import gatekeeper
from gatekeeper.errors import GatekeeperError, LedgerIntegrityError
from gatekeeper.ledger import Ledger
from gatekeeper.ledger.tables import KINDS, Entry, Migration

REPO = Path(gatekeeper.__file__).resolve().parents[1]
CASES = ["router/arith-1", "router/plan-2", "summarize/long-1"]


def url_of(path: Path) -> str:
    return f"sqlite:///{path}"


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "ledger" / "evidence.db"


def run_lifecycle(ledger: Ledger) -> int:
    """start -> 2 configs x 3 cases -> 3 comparisons -> PASS: 1 + 6 + 3 + 1 = 11 entries."""
    eid = ledger.start_evaluation(
        "prefix_cache", "ana", "byte_equivalence", {"model": "sha256:abc", "battery": "d1"}, {"limit": None}
    )
    for config in ("off", "on"):
        for case in CASES:
            result = {"tokens": [1, 2, 3], "text": "4", "outcomes": {"answers": True}, "telemetry": {"cached": 12}}
            ledger.add_case_result(eid, case, config, 0, result)
    for case in CASES:
        ledger.add_comparison(eid, case, True, {"first_divergence": None})
    ledger.finish_evaluation(eid, "PASS", [], {"cases": 3, "differing": 0})
    return eid


def seq_of(ledger: Ledger, kind: str, record_id: int) -> int:
    return next(e["seq"] for e in ledger.entries() if e["kind"] == kind and e["record_id"] == record_id)


def canonical(obj: object) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def drop_triggers(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None)
    for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'trigger'").fetchall():
        conn.execute(f"DROP TRIGGER {name}")
    return conn


def test_lifecycle_round_trip(db: Path) -> None:
    with Ledger(url_of(db)) as ledger:
        eid = run_lifecycle(ledger)
        report = ledger.verify()
        listed = ledger.evaluations()
        detail = ledger.evaluation(eid)
        entries = ledger.entries()

    assert db.is_file()
    assert report.ok and report.entries == 11 and report.first_bad_seq is None and report.problem == ""
    assert listed == [
        {
            "id": eid, "flag": "prefix_cache", "operator": "ana", "gate": "byte_equivalence",
            "started_at": detail["started_at"], "status": "PASS", "verdict": "PASS", "reasons": [],
            "case_results": 6, "comparisons": 3,
        }
    ]
    assert detail["status"] == "PASS" and detail["aborted_record"] is None
    assert detail["identity"] == {"model": "sha256:abc", "battery": "d1"} and detail["config"] == {"limit": None}
    assert detail["pid"] == os.getpid()
    order = [(c["case_id"], c["config"]) for c in detail["case_results"]]
    assert order == [(c, k) for k in ("off", "on") for c in CASES]
    assert detail["case_results"][0]["result"]["outcomes"] == {"answers": True}
    assert all(c["equal"] is True for c in detail["comparisons"])
    assert detail["verdict_record"]["summary"] == {"cases": 3, "differing": 0}
    assert detail["started_at"].endswith("Z") and detail["verdict_record"]["finished_at"] >= detail["started_at"]

    assert [e["seq"] for e in entries] == list(range(1, 12))
    assert entries[0]["prev_hash"] == "0" * 64
    assert all(b["prev_hash"] == a["hash"] for a, b in zip(entries, entries[1:]))
    assert entries[0]["kind"] == "evaluation" and entries[0]["payload"]["id"] == eid
    assert entries[-1]["kind"] == "verdict" and entries[-1]["payload"]["verdict"] == "PASS"

    # Reopening sees the same chain: nothing lives only in memory.
    with Ledger(url_of(db)) as again:
        assert again.entries() == entries and again.evaluation(eid)["status"] == "PASS"


def test_entry_hash_is_sha256_of_canonical_entry(db: Path) -> None:
    from gatekeeper.identity import canonical_json, sha256_hex

    with Ledger(url_of(db)) as ledger:
        run_lifecycle(ledger)
        for e in ledger.entries():
            body = {k: e[k] for k in ("seq", "prev_hash", "kind", "record_id", "payload")}
            assert e["hash"] == sha256_hex(canonical_json(body))


def test_running_then_fail_and_inconclusive(db: Path) -> None:
    with Ledger(url_of(db)) as ledger:
        a = ledger.start_evaluation("prefix_cache", "ana", "byte_equivalence", {}, {})
        assert ledger.evaluation(a)["status"] == "running"  # this process is alive
        ledger.add_comparison(a, "router/arith-1", False, {"position": 4, "tokens": [17, 23], "margin": 0.001})
        ledger.finish_evaluation(a, "FAIL", ["differs: router/arith-1 at token 4"], {})
        b = ledger.start_evaluation("prefix_cache", "ana", "byte_equivalence", {}, {})
        ledger.finish_evaluation(b, "INCONCLUSIVE", ["not_exercised: 0 cached tokens"], {})
        c = ledger.start_evaluation("prefix_cache", "ana", "byte_equivalence", {}, {})
        ledger.abort_evaluation(c, "interrupted by operator")

        listed = {e["id"]: e for e in ledger.evaluations()}
        assert [e["id"] for e in ledger.evaluations()] == [c, b, a]  # newest first
        assert [e["id"] for e in ledger.evaluations(limit=2)] == [c, b]
        assert listed[a]["status"] == "FAIL" and listed[a]["reasons"] == ["differs: router/arith-1 at token 4"]
        assert listed[b]["status"] == "INCONCLUSIVE"
        assert listed[c]["status"] == "aborted" and listed[c]["verdict"] is None
        assert ledger.evaluation(c)["aborted_record"]["reason"] == "interrupted by operator"
        assert ledger.evaluation(a)["comparisons"][0]["equal"] is False
        assert ledger.evaluation(999) is None
        assert ledger.verify().ok


def test_finish_twice_and_evidence_after_close_are_refused(db: Path) -> None:
    with Ledger(url_of(db)) as ledger:
        eid = run_lifecycle(ledger)
        with pytest.raises(GatekeeperError, match="already has a verdict"):
            ledger.finish_evaluation(eid, "FAIL", [], {})
        with pytest.raises(GatekeeperError, match="already has a verdict"):
            ledger.abort_evaluation(eid, "late")
        with pytest.raises(GatekeeperError, match="already has a verdict"):
            ledger.add_case_result(eid, "router/arith-1", "on", 1, {})

        other = ledger.start_evaluation("prefix_cache", "ana", "byte_equivalence", {}, {})
        ledger.abort_evaluation(other, "interrupted")
        with pytest.raises(GatekeeperError, match="aborted"):
            ledger.finish_evaluation(other, "PASS", [], {})
        with pytest.raises(GatekeeperError, match="no evaluation 42"):
            ledger.finish_evaluation(42, "PASS", [], {})
        with pytest.raises(GatekeeperError, match="not one of"):
            ledger.finish_evaluation(other, "MAYBE", [], {})

        n = len(ledger.entries())
        assert ledger.evaluation(eid)["verdict"] == "PASS" and ledger.evaluation(other)["verdict"] is None
        assert len(ledger.entries()) == n == 13  # refusals wrote nothing
        assert ledger.verify().ok


def test_flips_approvals_refusals_flushes_measurements(db: Path) -> None:
    with Ledger(url_of(db)) as ledger:
        eid = run_lifecycle(ledger)
        assert ledger.flag_states() == {}  # never flipped: absent, caller treats it as off
        ap = ledger.add_approval("prefix_cache", eid, "bo", "reviewed the diff")
        ledger.add_flip("prefix_cache", "on", "bo", "approved", evaluation_id=eid, approval_ids=[ap])
        ledger.add_refusal("static_first", "bo", ["stale: evaluation predates model change"], evaluation_id=eid)
        ledger.add_flip("static_first", "off", "cy", "rollback")
        ledger.add_flip("prefix_cache", "off", "cy", "incident 12")
        ledger.add_flush("model", {"model": "a"}, {"model": "b"}, {"dropped": 3})
        ledger.add_measurement("ana", {"engine": "torch"}, {"stages": {"router": {"calls": 2}}})

        states = ledger.flag_states()
        assert {f: s["state"] for f, s in states.items()} == {"prefix_cache": "off", "static_first": "off"}
        assert states["prefix_cache"]["reason"] == "incident 12"
        assert [f["state"] for f in ledger.flips("prefix_cache")] == ["on", "off"]
        assert ledger.flips("prefix_cache")[0]["approval_ids"] == [ap]
        assert ledger.approvals(evaluation_id=eid)[0]["operator"] == "bo"
        assert ledger.approvals(flag="static_first") == []
        assert ledger.refusals("static_first")[0]["reasons"] == ["stale: evaluation predates model change"]
        assert ledger.flushes()[0]["new"] == {"model": "b"}
        assert ledger.measurements()[0]["result"]["stages"]["router"]["calls"] == 2
        assert ledger.evaluation(eid)["approvals"][0]["id"] == ap

        with pytest.raises(GatekeeperError, match="on, off"):
            ledger.add_flip("prefix_cache", "maybe", "bo", "x")
        with pytest.raises(GatekeeperError, match="no evaluation 77"):
            ledger.add_approval("prefix_cache", 77, "bo", "x")
        with pytest.raises(GatekeeperError, match="JSON"):
            ledger.add_measurement("ana", {"bad": object()}, {})
        report = ledger.verify()
        assert report.ok and report.entries == 11 + 7


def test_triggers_reject_update_and_delete_on_every_chained_table(db: Path) -> None:
    with Ledger(url_of(db)) as ledger:
        eid = run_lifecycle(ledger)
        other = ledger.start_evaluation("static_first", "ana", "assertion_equivalence", {}, {})
        ledger.abort_evaluation(other, "x")
        ledger.add_approval("prefix_cache", eid, "bo", "ok")
        ledger.add_flip("prefix_cache", "on", "bo", "ok", evaluation_id=eid)
        ledger.add_refusal("prefix_cache", "bo", ["stale: x"])
        ledger.add_flush("adapter", {}, {})
        ledger.add_measurement("ana", {}, {})
        ledger.add_calibration("prefix_cache", eid, "ana", {}, {"faults": []})
        before = ledger.entries()

    conn = sqlite3.connect(db)
    for table in ["entry", *KINDS]:
        assert conn.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0] >= 1, table
        with pytest.raises(sqlite3.DatabaseError, match="append-only"):
            column = "kind" if table == "entry" else "id"
            conn.execute(f"UPDATE {table} SET {column} = {column}")
        with pytest.raises(sqlite3.DatabaseError, match="append-only"):
            conn.execute(f"DELETE FROM {table}")
    conn.close()
    with Ledger(url_of(db)) as ledger:
        assert ledger.entries() == before and ledger.verify().ok


def test_tamper_typed_row_field(db: Path) -> None:
    with Ledger(url_of(db)) as ledger:
        run_lifecycle(ledger)
        bad_seq = seq_of(ledger, "case_result", 2)
    assert bad_seq == 3
    conn = drop_triggers(db)
    row = json.loads(conn.execute("SELECT result FROM case_result WHERE id = 2").fetchone()[0])
    row["text"] = "5"
    conn.execute("UPDATE case_result SET result = ? WHERE id = 2", (canonical(row),))
    conn.close()

    with Ledger(url_of(db)) as ledger:
        report = ledger.verify()
    assert not report.ok and report.entries == 11
    assert report.first_bad_seq == 3
    assert report.problem == "seq 3: case_result 2 does not match its entry (field 'result')"
    with pytest.raises(LedgerIntegrityError, match="seq 3"):
        report.raise_if_bad()


def test_tamper_boolean_column(db: Path) -> None:
    with Ledger(url_of(db)) as ledger:
        run_lifecycle(ledger)
        bad_seq = seq_of(ledger, "comparison", 3)
    conn = drop_triggers(db)
    conn.execute("UPDATE comparison SET equal = 2 WHERE id = 3")  # still truthy: must not pass as True
    conn.close()
    with Ledger(url_of(db)) as ledger:
        report = ledger.verify()
    assert report.first_bad_seq == bad_seq == 10 and "field 'equal'" in report.problem


@pytest.mark.parametrize(
    "old, new",
    [
        ('"repeat":0', '"repeat":1'),  # still valid, canonical JSON: only the hash can tell
        ('"text":"4"', '"text":"5"'),
        ('"case_id":', '"case_id";'),  # no longer JSON at all
    ],
)
def test_tamper_entry_payload_byte(db: Path, old: str, new: str) -> None:
    with Ledger(url_of(db)) as ledger:
        run_lifecycle(ledger)
    conn = drop_triggers(db)
    payload = conn.execute("SELECT payload FROM entry WHERE seq = 5").fetchone()[0]
    assert payload.count(old) == 1
    edited = payload.replace(old, new)
    assert sum(a != b for a, b in zip(payload.encode(), edited.encode())) == 1 and len(edited) == len(payload)
    conn.execute("UPDATE entry SET payload = ? WHERE seq = 5", (edited,))
    conn.close()

    with Ledger(url_of(db)) as ledger:
        report = ledger.verify()
    assert not report.ok
    assert report.first_bad_seq == 5
    assert report.problem.startswith("seq 5: ")


def test_tamper_rehashed_entry_breaks_the_next_link(db: Path) -> None:
    """An editor who also rewrites the hash still breaks the link the next entry holds."""
    from gatekeeper.ledger.chain import entry_hash

    with Ledger(url_of(db)) as ledger:
        run_lifecycle(ledger)
        e = ledger.entries()[4]
    payload = {**e["payload"], "repeat": 7}
    conn = drop_triggers(db)
    conn.execute(
        "UPDATE entry SET payload = ?, hash = ? WHERE seq = 5",
        (canonical(payload), entry_hash(5, e["prev_hash"], e["kind"], e["record_id"], payload)),
    )
    conn.execute("UPDATE case_result SET repeat = 7 WHERE id = ?", (e["record_id"],))
    conn.close()
    with Ledger(url_of(db)) as ledger:
        report = ledger.verify()
    assert report.first_bad_seq == 6 and "prev_hash" in report.problem


def test_tamper_delete_entry(db: Path) -> None:
    with Ledger(url_of(db)) as ledger:
        run_lifecycle(ledger)
    conn = drop_triggers(db)
    conn.execute("DELETE FROM entry WHERE seq = 7")
    conn.close()

    with Ledger(url_of(db)) as ledger:
        report = ledger.verify()
    assert not report.ok and report.entries == 10
    assert report.first_bad_seq == 8
    assert report.problem.startswith("seq 8: seq 7 missing")
    assert any("has no entry in the chain" in p for p in report.problems)  # its row is now orphaned


def test_tamper_delete_last_entry_or_row(db: Path) -> None:
    with Ledger(url_of(db)) as ledger:
        run_lifecycle(ledger)
    conn = drop_triggers(db)
    conn.execute("DELETE FROM entry WHERE seq = 11")  # no gap left, but the verdict row lost its entry
    conn.close()
    with Ledger(url_of(db)) as ledger:
        report = ledger.verify()
    assert not report.ok and report.first_bad_seq is None
    assert report.problem == "verdict 1 has no entry in the chain"

    conn = sqlite3.connect(db)
    conn.execute("DELETE FROM case_result WHERE id = 4")
    conn.commit()
    conn.close()
    with Ledger(url_of(db)) as ledger:
        report = ledger.verify()
    assert report.first_bad_seq == 5 and "case_result 4 is missing" in report.problem


def test_started_by_killed_process_reads_aborted(db: Path) -> None:
    script = (
        "import sys, time\n"
        "from gatekeeper.ledger import Ledger\n"
        "ledger = Ledger(sys.argv[1])\n"
        "eid = ledger.start_evaluation('prefix_cache', 'ana', 'byte_equivalence', {}, {})\n"
        "ledger.add_case_result(eid, 'router/arith-1', 'off', 0, {'tokens': [1]})\n"
        "print(eid, flush=True)\n"
        "time.sleep(120)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", script, url_of(db)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        eid = int(proc.stdout.readline())
        with Ledger(url_of(db)) as ledger:
            running = ledger.evaluation(eid)
            assert running["status"] == "running" and running["pid"] == proc.pid
            proc.kill()  # SIGKILL: the run gets no chance to write anything
            proc.wait(timeout=10)
            dead = ledger.evaluation(eid)
            listed = ledger.evaluations()[0]
            assert ledger.verify().ok
    finally:
        proc.kill()
        proc.wait()
    assert dead["status"] == "aborted" and dead["verdict"] is None
    assert dead["verdict_record"] is None and dead["aborted_record"] is None  # derived, not written
    assert len(dead["case_results"]) == 1
    assert listed["status"] == "aborted" and listed["verdict"] is None


def test_started_on_another_host_reads_aborted(db: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import gatekeeper.ledger.store as store

    with Ledger(url_of(db)) as ledger:
        monkeypatch.setattr(store.socket, "gethostname", lambda: "elsewhere")
        eid = ledger.start_evaluation("prefix_cache", "ana", "byte_equivalence", {}, {})
        monkeypatch.undo()
        assert ledger.evaluation(eid)["host"] == "elsewhere"
        assert ledger.evaluation(eid)["status"] == "aborted"


def test_models_match_migrated_schema(db: Path) -> None:
    with Ledger(url_of(db)) as ledger:
        insp = inspect(ledger.engine)
        for model in [Entry, Migration, *KINDS.values()]:
            table = model.__table__
            reflected = {c["name"]: c for c in insp.get_columns(table.name)}
            assert list(reflected) == [c.name for c in table.columns], table.name
            for col in table.columns:
                r = reflected[col.name]
                assert r["nullable"] == col.nullable, (table.name, col.name)
                declared = col.type.compile(ledger.engine.dialect)
                assert type(r["type"]).__name__.upper() == declared, (table.name, col.name)
            pk = insp.get_pk_constraint(table.name)["constrained_columns"]
            assert pk == [c.name for c in table.primary_key.columns]


def test_for_workspace_default_and_bad_inputs(tmp_path: Path) -> None:
    with Ledger.for_workspace(tmp_path) as ledger:
        ledger.add_measurement("ana", {}, {})
    assert (tmp_path / "ledger" / "evidence.db").is_file()
    other = tmp_path / "elsewhere.db"
    with Ledger.for_workspace(tmp_path, url_of(other)) as ledger:
        assert ledger.entries() == []
    assert other.is_file()

    (tmp_path / "junk.db").write_bytes(b"this is not a database" * 100)
    with pytest.raises(GatekeeperError, match="cannot open the ledger"):
        Ledger(url_of(tmp_path / "junk.db"))
    with pytest.raises(GatekeeperError, match="not valid"):
        Ledger("not a url")
