"""The evidence ledger on real SQLite files and a real PostgreSQL server: lifecycle, derived status,
immutability, tampering. Every test runs on both backends unless its name says otherwise."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from postgres import Raw, db_errors, is_postgres
from sqlalchemy import inspect

import gatekeeper
from gatekeeper.errors import GatekeeperError, LedgerIntegrityError
from gatekeeper.identity import child_env
from gatekeeper.ledger import Ledger
from gatekeeper.ledger.tables import KINDS, Entry, Migration

pytest_plugins = ["postgres"]

REPO = Path(gatekeeper.__file__).resolve().parents[1]
CASES = ["router/arith-1", "router/plan-2", "summarize/long-1"]


def url_of(path: Path) -> str:
    return f"sqlite:///{path}"


@pytest.fixture
def url(ledger_url: str) -> str:
    """The ledger under test: a SQLite file or a fresh PostgreSQL database (see tests/postgres.py)."""
    return ledger_url


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


def drop_triggers(url: str) -> Raw:
    return Raw(url).drop_triggers()


def test_lifecycle_round_trip(url: str) -> None:
    with Ledger(url) as ledger:
        eid = run_lifecycle(ledger)
        report = ledger.verify()
        listed = ledger.evaluations()
        detail = ledger.evaluation(eid)
        entries = ledger.entries()

    assert is_postgres(url) or Path(url[len("sqlite:///"):]).is_file()
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
    with Ledger(url) as again:
        assert again.entries() == entries and again.evaluation(eid)["status"] == "PASS"


def test_entry_hash_is_sha256_of_canonical_entry(url: str) -> None:
    from gatekeeper.identity import canonical_json, sha256_hex

    with Ledger(url) as ledger:
        run_lifecycle(ledger)
        for e in ledger.entries():
            body = {k: e[k] for k in ("seq", "prev_hash", "kind", "record_id", "payload")}
            assert e["hash"] == sha256_hex(canonical_json(body))


def test_running_then_fail_and_inconclusive(url: str) -> None:
    with Ledger(url) as ledger:
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


def test_finish_twice_and_evidence_after_close_are_refused(url: str) -> None:
    with Ledger(url) as ledger:
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


def test_flips_approvals_refusals_flushes_measurements(url: str) -> None:
    with Ledger(url) as ledger:
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


def test_triggers_reject_update_and_delete_on_every_chained_table(url: str) -> None:
    with Ledger(url) as ledger:
        eid = run_lifecycle(ledger)
        other = ledger.start_evaluation("static_first", "ana", "assertion_equivalence", {}, {})
        ledger.abort_evaluation(other, "x")
        ledger.add_approval("prefix_cache", eid, "bo", "ok")
        ledger.add_flip("prefix_cache", "on", "bo", "ok", evaluation_id=eid)
        ledger.add_refusal("prefix_cache", "bo", ["stale: x"])
        ledger.add_flush("adapter", {}, {})
        ledger.add_measurement("ana", {}, {})
        ledger.add_calibration("prefix_cache", eid, "ana", {}, {"faults": []})
        ledger.add_shadow("prefix_cache", None, "guard", {"stages": {}}, [])
        before = ledger.entries()

    with Raw(url) as conn:
        for table in ["entry", *KINDS]:
            assert conn.scalar(f"SELECT COUNT(*) FROM {table}") >= 1, table
            with pytest.raises(db_errors(), match="append-only"):
                column = "kind" if table == "entry" else "id"
                conn.execute(f"UPDATE {table} SET {column} = {column}")
            with pytest.raises(db_errors(), match="append-only"):
                conn.execute(f"DELETE FROM {table}")
            if conn.postgres:  # SQLite has no TRUNCATE; PostgreSQL's bypasses row triggers, so it has its own
                with pytest.raises(db_errors(), match="append-only"):
                    conn.execute(f"TRUNCATE {table} CASCADE")
    with Ledger(url) as ledger:
        assert ledger.entries() == before and ledger.verify().ok


def test_tamper_typed_row_field(url: str) -> None:
    with Ledger(url) as ledger:
        run_lifecycle(ledger)
        bad_seq = seq_of(ledger, "case_result", 2)
    assert bad_seq == 3
    conn = drop_triggers(url)
    row = json.loads(conn.execute("SELECT result FROM case_result WHERE id = 2").fetchone()[0])
    row["text"] = "5"
    conn.execute("UPDATE case_result SET result = ? WHERE id = 2", (canonical(row),))
    conn.close()

    with Ledger(url) as ledger:
        report = ledger.verify()
    assert not report.ok and report.entries == 11
    assert report.first_bad_seq == 3
    assert report.problem == "seq 3: case_result 2 does not match its entry (field 'result')"
    with pytest.raises(LedgerIntegrityError, match="seq 3"):
        report.raise_if_bad()


def test_tamper_boolean_column(url: str) -> None:
    with Ledger(url) as ledger:
        run_lifecycle(ledger)
        bad_seq = seq_of(ledger, "comparison", 3)
    conn = drop_triggers(url)
    if conn.postgres:  # a real boolean column: flipping it is the edit
        conn.execute("UPDATE comparison SET equal = NOT equal WHERE id = 3")
    else:
        conn.execute("UPDATE comparison SET equal = 2 WHERE id = 3")  # still truthy: must not pass as True
    conn.close()
    with Ledger(url) as ledger:
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
def test_tamper_entry_payload_byte(url: str, old: str, new: str) -> None:
    with Ledger(url) as ledger:
        run_lifecycle(ledger)
    conn = drop_triggers(url)
    payload = conn.execute("SELECT payload FROM entry WHERE seq = 5").fetchone()[0]
    assert payload.count(old) == 1
    edited = payload.replace(old, new)
    assert sum(a != b for a, b in zip(payload.encode(), edited.encode())) == 1 and len(edited) == len(payload)
    conn.execute("UPDATE entry SET payload = ? WHERE seq = 5", (edited,))
    conn.close()

    with Ledger(url) as ledger:
        report = ledger.verify()
    assert not report.ok
    assert report.first_bad_seq == 5
    assert report.problem.startswith("seq 5: ")


def test_tamper_rehashed_entry_breaks_the_next_link(url: str) -> None:
    """An editor who also rewrites the hash still breaks the link the next entry holds."""
    from gatekeeper.ledger.chain import entry_hash

    with Ledger(url) as ledger:
        run_lifecycle(ledger)
        e = ledger.entries()[4]
    payload = {**e["payload"], "repeat": 7}
    conn = drop_triggers(url)
    conn.execute(
        "UPDATE entry SET payload = ?, hash = ? WHERE seq = 5",
        (canonical(payload), entry_hash(5, e["prev_hash"], e["kind"], e["record_id"], payload)),
    )
    conn.execute("UPDATE case_result SET repeat = 7 WHERE id = ?", (e["record_id"],))
    conn.close()
    with Ledger(url) as ledger:
        report = ledger.verify()
    assert report.first_bad_seq == 6 and "prev_hash" in report.problem


def test_tamper_delete_entry(url: str) -> None:
    with Ledger(url) as ledger:
        run_lifecycle(ledger)
    conn = drop_triggers(url)
    conn.execute("DELETE FROM entry WHERE seq = 7")
    conn.close()

    with Ledger(url) as ledger:
        report = ledger.verify()
    assert not report.ok and report.entries == 10
    assert report.first_bad_seq == 8
    assert report.problem.startswith("seq 8: seq 7 missing")
    assert any("has no entry in the chain" in p for p in report.problems)  # its row is now orphaned


def test_tamper_delete_last_entry_or_row(url: str) -> None:
    with Ledger(url) as ledger:
        run_lifecycle(ledger)
    conn = drop_triggers(url)
    conn.execute("DELETE FROM entry WHERE seq = 11")  # no gap left, but the verdict row lost its entry
    conn.close()
    with Ledger(url) as ledger:
        report = ledger.verify()
    assert not report.ok and report.first_bad_seq is None
    assert report.problem == "verdict 1 has no entry in the chain"

    with Raw(url) as conn:
        conn.execute("DELETE FROM case_result WHERE id = 4")
    with Ledger(url) as ledger:
        report = ledger.verify()
    assert report.first_bad_seq == 5 and "case_result 4 is missing" in report.problem


def test_started_by_killed_process_reads_aborted(url: str) -> None:
    script = (
        "import sys, time\n"
        "from gatekeeper.ledger import Ledger\n"
        "ledger = Ledger(sys.argv[1])\n"
        "eid = ledger.start_evaluation('prefix_cache', 'ana', 'byte_equivalence', {}, {})\n"
        "ledger.add_case_result(eid, 'router/arith-1', 'off', 0, {'tokens': [1]})\n"
        "print(eid, flush=True)\n"
        "time.sleep(120)\n"
    )
    env = child_env(PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-c", script, url], stdout=subprocess.PIPE, text=True, env=env)
    try:
        eid = int(proc.stdout.readline())
        with Ledger(url) as ledger:
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


def test_started_on_another_host_reads_aborted(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import gatekeeper.ledger.store as store

    with Ledger(url) as ledger:
        monkeypatch.setattr(store.socket, "gethostname", lambda: "elsewhere")
        eid = ledger.start_evaluation("prefix_cache", "ana", "byte_equivalence", {}, {})
        monkeypatch.undo()
        assert ledger.evaluation(eid)["host"] == "elsewhere"
        assert ledger.evaluation(eid)["status"] == "aborted"


def test_models_match_migrated_schema(url: str) -> None:
    with Ledger(url) as ledger:
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


def test_postgresql_urls_and_bad_inputs(pg_server, pg_url: str) -> None:
    plain = pg_url.replace("postgresql+psycopg://", "postgresql://")  # no driver named: psycopg 3 all the same
    with Ledger(plain) as ledger:
        assert ledger.engine.dialect.driver == "psycopg"
        ledger.add_measurement("ana", {}, {})
        assert ledger.verify().ok
    secret = f"postgresql+psycopg://ana:s3cret@127.0.0.1:{pg_server.port}/no_such_database"
    with pytest.raises(GatekeeperError, match="cannot open the ledger") as e:
        Ledger(secret)
    assert "s3cret" not in str(e.value)
    with pytest.raises(GatekeeperError, match="driver that is not installed"):
        Ledger(pg_url.replace("+psycopg", "+pg8000"))
    with pytest.raises(GatekeeperError, match="not valid"):
        Ledger(pg_url.replace("+psycopg", "+nosuchdriver"))


def test_postgresql_appends_wait_for_the_write_lock(pg_url: str) -> None:
    """A writer holding the ledger's write transaction blocks another's append until it commits."""
    import threading

    from gatekeeper.ledger.database import write

    with Ledger(pg_url) as first, Ledger(pg_url) as second:
        done = threading.Event()
        with write(first.engine):
            t = threading.Thread(target=lambda: (second.add_measurement("bo", {}, {}), done.set()))
            t.start()
            assert not done.wait(0.5)  # queued behind the advisory lock
        t.join(10)
        assert done.is_set() and second.verify().ok and len(second.entries()) == 1


# -- ledger copy SRC DST ----------------------------------------------------------------------------

def _sqlite_ledger(tmp_path: Path) -> str:
    src = url_of(tmp_path / "src" / "evidence.db")
    with Ledger(src) as ledger:
        eid = run_lifecycle(ledger)
        ledger.add_comparison(ledger.start_evaluation("static_first", "ana", "byte_equivalence", {}, {}), "a/b", False, {})
        ledger.add_approval("prefix_cache", eid, "bo", "ok")
        flip = ledger.add_flip("prefix_cache", "on", "bo", "ok", evaluation_id=eid, approval_ids=[1])
        ledger.add_flush("model", {"model": "a"}, {"model": "b"})
        ledger.add_calibration("prefix_cache", eid, "ana", {}, {"faults": []})
        ledger.add_shadow("prefix_cache", flip, "guard", {"stages": {"router": {"compared": 4, "mismatches": 0}}}, [])
    return src


def test_copy_sqlite_ledger_to_postgresql(tmp_path: Path, pg_url: str, run_cli, workspace: Path) -> None:
    src = _sqlite_ledger(tmp_path)
    with Ledger(src) as ledger:
        before = ledger.entries()
    code, out, err = run_cli("ledger", "copy", src, pg_url, "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["ok"] and data["entries"] == len(before) == 18 and data["head"]["hash"] == before[-1]["hash"]

    with Ledger(pg_url) as team:
        assert team.entries() == before  # same seq, ids, payloads and hashes
        assert team.evaluation(1)["status"] == "PASS" and team.evaluation(2)["comparisons"][0]["equal"] is False
        # The id sequences moved past the copied rows: appending goes on where the source left off.
        ev = team.start_evaluation("prefix_cache", "cy", "byte_equivalence", {}, {})
        assert ev == 3 and team.add_flip("prefix_cache", "off", "cy", "rollback") == 2
        assert team.verify().ok and team.verify().entries == 20
        after = team.entries()
    back = url_of(tmp_path / "back.db")  # and back again, PostgreSQL to SQLite
    assert run_cli("ledger", "copy", pg_url, back)[0] == 0
    with Ledger(back) as ledger:
        assert ledger.entries() == after and ledger.verify().ok

    policy = workspace / "policies" / "prefix_cache.yaml"  # flips made here record no checkpoint: a policy wanting none
    policy.write_text(policy.read_text().replace(", checkpoint_after_flip: true", ""))
    code, out, _ = run_cli("--workspace", workspace, "--ledger", pg_url, "ledger", "verify")
    assert code == 0 and out.startswith("ledger ok: 20 entries")
    with Raw(pg_url) as conn:
        conn.drop_triggers()
        conn.execute("UPDATE flip SET reason = 'looked fine' WHERE id = 1")
    code, out, _ = run_cli("--workspace", workspace, "--ledger", pg_url, "ledger", "verify", "--full", "--json")
    flip_seq = next(e["seq"] for e in before if e["kind"] == "flip")
    assert code == 1 and json.loads(out)["first_bad_seq"] == flip_seq
    assert f"seq {flip_seq}: flip 1 does not match its entry (field 'reason')" in json.loads(out)["problem"]


def test_copy_refuses_a_non_empty_destination_a_bad_url_and_a_tampered_source(
    tmp_path: Path, ledger_url: str, run_cli
) -> None:
    src = _sqlite_ledger(tmp_path)
    assert run_cli("ledger", "copy", src, ledger_url)[0] == 0
    code, _, err = run_cli("ledger", "copy", src, ledger_url)
    assert code == 2 and "not empty (rows of entry: 18, evaluation: 2" in err and "only fills an empty ledger" in err
    code, _, err = run_cli("ledger", "copy", "ledger/evidence.db", ledger_url)
    assert code == 2 and "SRC 'ledger/evidence.db' is not a ledger URL" in err
    code, _, err = run_cli("ledger", "copy", src, "postgres//nowhere")
    assert code == 2 and "DST" in err
    code, _, err = run_cli("ledger", "copy", url_of(tmp_path / "missing.db"), ledger_url)
    assert code == 2 and "no ledger at" in err

    with drop_triggers(src) as conn:
        conn.execute("UPDATE case_result SET repeat = 5 WHERE id = 1")
    fresh = url_of(tmp_path / "fresh.db") if not is_postgres(ledger_url) else ledger_url + "_2"
    if is_postgres(ledger_url):
        with Raw(ledger_url) as conn:
            conn.execute(f"CREATE DATABASE {fresh.rsplit('/', 1)[1]}")
    code, out, err = run_cli("ledger", "copy", src, fresh)
    assert code == 1 and "source ledger does not verify (seq 2: case_result 1" in err and "nothing was copied" in err
    with Ledger(fresh) as dst:
        assert dst.entries() == [] and dst.verify().ok
