"""Numbered migrations: a blank database and an old one both reach the current schema, data kept,
on SQLite and on PostgreSQL alike."""

from __future__ import annotations

import pytest
from postgres import Raw
from sqlalchemy import inspect

from gatekeeper.errors import GatekeeperError
from gatekeeper.ledger import CURRENT_VERSION, Ledger, migrate
from gatekeeper.ledger.chain import append
from gatekeeper.ledger.database import make_engine, write
from gatekeeper.ledger.migrations import schema_version

pytest_plugins = ["postgres"]


def recorded(url: str) -> list[tuple[int, str]]:
    with Raw(url) as conn:
        return [tuple(r) for r in conn.execute("SELECT version, name FROM migrations ORDER BY version").fetchall()]


def schema(url: str) -> dict[str, list[str]]:
    """Table -> column names, plus trigger names: what two routes to the same version must share."""
    with Raw(url) as conn:
        return {**conn.columns(), "<triggers>": [name for name, _ in conn.triggers()]}


def make_version_1(url: str) -> None:
    """A ledger as release 1 left it: schema 1 only, with an evaluation and a flip in its chain."""
    engine = make_engine(url)
    try:
        assert migrate(engine, target=1) == 1
        with write(engine) as conn:
            eid = append(conn, "evaluation", dict(
                flag="prefix_cache", operator="ana", pid=1, host="old-host",
                gate="byte_equivalence", identity={"model": "m1"}, config={"limit": 2},
            ))
            append(conn, "case_result", dict(evaluation_id=eid, case_id="router/arith-1", config="off", repeat=0,
                                             result={"tokens": [5, 6]}))
            append(conn, "verdict", dict(evaluation_id=eid, verdict="PASS", reasons=[], summary={}))
            append(conn, "flip", dict(flag="prefix_cache", state="on", evaluation_id=eid, operator="bo", reason="ok"))
    finally:
        engine.dispose()


def test_blank_database_reaches_current_version(new_ledger_url) -> None:
    db = new_ledger_url("blank")
    with Ledger(db) as ledger:
        assert ledger.version == CURRENT_VERSION == 5
        assert ledger.verify().ok and ledger.entries() == []
    assert recorded(db) == [(1, "0001_initial"), (2, "0002_flush_measurement"), (3, "0003_calibration"),
                           (4, "0004_signatures"), (5, "0005_shadow")]
    with Raw(db) as conn:
        applied = [r[0] for r in conn.execute("SELECT applied_at FROM migrations")]
    assert all(a.endswith("Z") and "T" in a for a in applied)


def test_version_1_database_upgrades_in_place(new_ledger_url) -> None:
    old = new_ledger_url("old")
    make_version_1(old)
    assert recorded(old) == [(1, "0001_initial")]
    before = schema(old)
    assert "flush" not in before and "measurement" not in before and "approval_ids" not in before["flip"]
    assert "calibration" not in before and "signature" not in before["approval"]

    with Ledger(old) as ledger:
        assert ledger.version == 5
        old_entries = ledger.entries()
        assert [e["kind"] for e in old_entries] == ["evaluation", "case_result", "verdict", "flip"]
        assert ledger.verify().ok  # rows from before the migration still match their entries
        ev = ledger.evaluation(1)
        assert ev["identity"] == {"model": "m1"} and ev["status"] == "PASS"
        assert ev["case_results"][0]["result"] == {"tokens": [5, 6]}
        assert ledger.flips()[0]["approval_ids"] is None
        assert ledger.flag_states()["prefix_cache"]["state"] == "on"
        # New kinds and the new column work on the upgraded database.
        ledger.add_flip("prefix_cache", "off", "cy", "rollback", approval_ids=[])
        ledger.add_flush("model", {"model": "m1"}, {"model": "m2"})
        ledger.add_measurement("ana", {}, {"calls": 1})
        ledger.add_calibration("prefix_cache", 1, "ana", {}, {"faults": []})
        assert ledger.entries()[:4] == old_entries
        assert ledger.verify().ok and ledger.verify().entries == 8
        assert ledger.evaluation(1)["calibrations"][0]["operator"] == "ana"
        assert ledger.flips()[1]["approval_ids"] == []
        assert ledger.flips()[0]["signature"] is None  # rows from before migration 4 are unsigned
        assert ledger.shadows() == []  # migration 5: the guard's table, empty
        seal = {"signature": "-----BEGIN SSH SIGNATURE-----", "signer": "cy", "signed_at": "2025-01-01T00:00:00.000000Z",
                "record_digest": "0" * 64}
        ledger.add_approval("prefix_cache", 1, "cy", "signed", seal=seal)
        assert ledger.approvals()[0]["signer"] == "cy" and ledger.verify().ok
    assert recorded(old) == [(1, "0001_initial"), (2, "0002_flush_measurement"), (3, "0003_calibration"),
                           (4, "0004_signatures"), (5, "0005_shadow")]

    blank = new_ledger_url("blank")
    Ledger(blank).close()
    assert schema(old) == schema(blank)  # upgraded and fresh databases end up identical


def test_column_added_later_must_stay_null_on_old_rows(new_ledger_url) -> None:
    db = new_ledger_url("old")
    make_version_1(db)
    Ledger(db).close()
    with Raw(db) as conn:
        conn.drop_trigger("flip_no_update", "flip")
        conn.execute("UPDATE flip SET approval_ids = '[1]' WHERE id = 1")
    with Ledger(db) as ledger:
        report = ledger.verify()
    assert report.first_bad_seq == 4 and "field 'approval_ids'" in report.problem


def test_migrate_is_idempotent_and_bounded(new_ledger_url) -> None:
    db = new_ledger_url("e")
    engine = make_engine(db)
    try:
        assert schema_version(engine) == 0
        assert migrate(engine, target=0) == 0 and not inspect(engine).has_table("entry")
        assert migrate(engine, target=1) == 1 and not inspect(engine).has_table("flush")
        assert migrate(engine, target=2) == 2 and not inspect(engine).has_table("calibration")
        assert migrate(engine, target=3) == 3
        assert "signature" not in {c["name"] for c in inspect(engine).get_columns("flip")}
        assert migrate(engine) == 5 and migrate(engine) == 5 and migrate(engine, target=1) == 5
        with pytest.raises(ValueError):
            migrate(engine, target=CURRENT_VERSION + 1)
    finally:
        engine.dispose()
    assert recorded(db) == [(1, "0001_initial"), (2, "0002_flush_measurement"), (3, "0003_calibration"),
                           (4, "0004_signatures"), (5, "0005_shadow")]


def test_newer_database_is_refused(new_ledger_url) -> None:
    db = new_ledger_url("future")
    Ledger(db).close()
    with Raw(db) as conn:
        conn.execute("INSERT INTO migrations VALUES (99, '0099_future', '2100-01-01T00:00:00Z')")
    with pytest.raises(GatekeeperError, match="newer than this gatekeeper"):
        Ledger(db)
