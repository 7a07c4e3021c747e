"""The SQLite reader ``status`` and ``hash`` read flag states with (no SQLAlchemy): the same rows, decoded the
same way, as ``Ledger``; every ledger it does not read (missing, older, newer, not a database, not SQLite) is
left to ``Ledger``, so those commands answer as before; and the commands' output is the same either way."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url

from gatekeeper.errors import GatekeeperError
from gatekeeper.ledger import CURRENT_VERSION, Ledger, migrate, records
from gatekeeper.ledger.database import make_engine
from gatekeeper.ledger.migrations import MIGRATIONS
from gatekeeper.ledger.reader import SQLiteReader, open_reader, sqlite_file
from gatekeeper.ledger.tables import KINDS, SEAL_FIELDS

SEAL = {name: f"{name}-value" for name in SEAL_FIELDS}


def url_of(path: Path) -> str:
    return f"sqlite:///{path}"


def fill(db: Path) -> list[int]:
    """Evaluations of every status with their evidence, approvals (one signed), a calibration, a refusal and
    flips of two flags; returns the evaluation ids."""
    with Ledger(url_of(db)) as ledger:
        ids = [ledger.start_evaluation("prefix_cache", "ana", "byte_equivalence", {"off": {"model": n}},
                                       {"engine": "tiny", "suites": None, "candidate": {"path": "a", "digest": "d"}})
               for n in range(4)]
        passed, failed, aborted, _running = ids  # the last has neither verdict nor abort, and its process lives
        ledger.add_case_result(passed, "s/a", "off", 0, {"tokens": [1, 2], "text": "é"})
        ledger.add_comparison(passed, "s/a", True, {"first": None})
        ledger.add_comparison(passed, "s/b", False, {"first": 3})
        ledger.finish_evaluation(passed, "PASS", [], {"cases": 2})
        ledger.finish_evaluation(failed, "FAIL", ["differs: s/a"], {"cases": 1})
        ledger.abort_evaluation(aborted, "interrupted")
        ledger.add_calibration("prefix_cache", passed, "ana", {"faults": ["noise"]}, {"faults": []})
        first = ledger.add_approval("prefix_cache", passed, "bo", "ok")
        second = ledger.add_approval("prefix_cache", passed, "cy", "ok", seal=SEAL)
        ledger.add_refusal("prefix_cache", "dee", ["self_approval: no"], evaluation_id=passed)
        ledger.add_flip("static_first", "on", "bo", "go")
        ledger.add_flip("prefix_cache", "on", "cy", "go", evaluation_id=passed, approval_ids=[first, second], seal=SEAL)
        ledger.add_flip("static_first", "off", "bo", "back")
    return ids


def test_the_reader_returns_what_the_ledger_returns(tmp_path):
    db = tmp_path / "evidence.db"
    ids = fill(db)
    before = db.read_bytes()
    with open_reader(url_of(db)) as reader:
        assert isinstance(reader, SQLiteReader)
        read = reader.flag_states(), [reader.evaluation(eid) for eid in ids]
    assert db.read_bytes() == before  # it wrote nothing
    with open_reader(url_of(db)) as reader, Ledger(url_of(db)) as ledger:
        assert read == (ledger.flag_states(), [ledger.evaluation(eid) for eid in ids])
        assert reader.flag_states() == ledger.flag_states()
        assert reader.flag_states()["prefix_cache"]["approval_ids"] == [1, 2]  # JSON decoded
        for flag in (None, "prefix_cache", "static_first", "adapter"):
            assert reader.flips(flag) == ledger.flips(flag)
        for eid in [*ids, 99]:
            assert reader.evaluation(eid) == ledger.evaluation(eid)
        assert [reader.evaluation(eid)["status"] for eid in ids] == ["PASS", "FAIL", "aborted", "running"]
        assert [c["equal"] for c in reader.evaluation(ids[0])["comparisons"]] == [True, False]  # booleans, not 0/1


def test_a_missing_file_is_no_ledger_and_stays_missing(tmp_path):
    db = tmp_path / "ledger" / "evidence.db"
    assert open_reader(url_of(db)) is None
    assert not db.parent.exists()


def test_a_ledger_of_an_older_schema_is_opened_by_ledger_which_upgrades_it(tmp_path):
    db = tmp_path / "evidence.db"
    engine = make_engine(url_of(db))
    migrate(engine, target=1)
    engine.dispose()
    assert SQLiteReader.at_current_version(db) is None
    with open_reader(url_of(db)) as opened:
        assert isinstance(opened, Ledger) and opened.version == CURRENT_VERSION


def test_a_newer_schema_and_a_file_that_is_no_database_are_refused_as_ledger_refuses_them(tmp_path):
    newer = tmp_path / "newer.db"
    fill(newer)
    with sqlite3.connect(newer) as conn:
        conn.execute("INSERT INTO migrations VALUES (99, 'future', 'then')")
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"this is not a database\n" * 100)
    for db, says in ((newer, "newer than this gatekeeper knows"), (junk, "file is not a database")):
        with pytest.raises(GatekeeperError) as read:
            open_reader(url_of(db))
        with pytest.raises(GatekeeperError) as opened:
            Ledger(url_of(db))
        assert says in str(read.value) and str(read.value) == str(opened.value)


@pytest.mark.parametrize("url", ["sqlite:////abs/evidence.db", "sqlite:///relative/evidence.db", "sqlite:///a b/é@x:1.db"])
def test_a_plain_sqlite_url_names_the_file_sqlalchemy_opens(url):
    assert sqlite_file(url) == Path(make_url(url).database)


@pytest.mark.parametrize("url", ["postgresql+psycopg://u@h/db", "postgresql://u:p@h:5432/db", "sqlite://", "sqlite:///:memory:",
                                 "sqlite:///x.db?mode=ro", "sqlite:///file:x.db?uri=true", "sqlite:///a%20b.db"])
def test_other_urls_are_left_to_sqlalchemy(url):
    assert sqlite_file(url) is None


def test_the_schema_facts_agree_with_the_table_models_and_migrations():
    from sqlalchemy import Boolean

    assert set(KINDS) == set(records.JSON_FIELDS)
    for kind, model in KINDS.items():
        columns = model.__table__.c  # type: ignore[attr-defined]
        assert records.JSON_FIELDS[kind] <= set(columns.keys()), kind
        assert {c.name for c in columns if isinstance(c.type, Boolean)} == records.BOOL_FIELDS.get(kind, set()), kind
    assert [number for number, _, _ in MIGRATIONS] == list(range(1, CURRENT_VERSION + 1))


LIGHT = """
from gatekeeper.engines.base import Engine


class LightReader(Engine):
    name = "light"

    @classmethod
    def identity_of(cls, profile, *, workspace_root=None):
        return {"engine": cls.name, "model": profile.model}

    def identity(self):
        return self.identity_of(self.profile)
"""


@pytest.fixture
def light_ws(workspace, tmp_path, monkeypatch) -> Path:
    """The init workspace on an adapter whose identity needs no model."""
    (tmp_path / "light_reader_engine.py").write_text(LIGHT)
    monkeypatch.syspath_prepend(str(tmp_path))
    (workspace / "engines" / "auto.yaml").write_text("adapter: light_reader_engine:LightReader\nmodel: m\n")
    return workspace


def both_ways(run_cli, monkeypatch, *args: str) -> tuple:
    """A command's (exit code, stdout, stderr) reading with the SQLite reader, and through ``Ledger`` instead."""
    fast = run_cli(*args)
    with monkeypatch.context() as m:
        m.setattr(SQLiteReader, "at_current_version", classmethod(lambda cls, path: None))
        full = run_cli(*args)
    return fast, full


def test_status_and_hash_print_the_same_through_the_reader_and_through_ledger(light_ws, run_cli, monkeypatch):
    db = light_ws / "ledger" / "evidence.db"
    for _ in range(2):  # no ledger, then one with flips
        for args in (["status", "--json"], ["status"], ["hash", "--json"], ["hash"]):
            fast, full = both_ways(run_cli, monkeypatch, "--workspace", light_ws, *args)
            assert fast == full and fast[0] == 0, args
        with Ledger(url_of(db)) as ledger:
            ledger.add_flip("prefix_cache", "on", "ana", "try")
    assert json.loads(run_cli("--workspace", light_ws, "hash", "--json")[1])["parts"]["flags"] == {"prefix_cache": "on"}


def test_a_damaged_table_reads_as_the_same_one_line_exit_2(light_ws, run_cli, monkeypatch):
    db = light_ws / "ledger" / "evidence.db"
    with Ledger(url_of(db)) as ledger:
        for n in range(200):
            ledger.add_flip("prefix_cache", "on" if n % 2 else "off", "ana", "x" * 200)
    assert not db.with_name(db.name + "-wal").exists()  # everything is in the file
    with sqlite3.connect(db) as conn:
        (root,) = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = 'flip'").fetchone()
    data = bytearray(db.read_bytes())
    size = int.from_bytes(data[16:18], "big")
    data[(root - 1) * size: (root - 1) * size + 64] = b"\xa5" * 64  # the flip table's root page; migrations intact
    db.write_bytes(bytes(data))
    reader = SQLiteReader.at_current_version(db)
    assert reader is not None  # the damage lies past what opening reads: the reader meets it
    reader.close()
    for args in (["status", "--json"], ["hash"]):
        fast, full = both_ways(run_cli, monkeypatch, "--workspace", light_ws, *args)
        assert fast == full and fast[0] == 2, (fast, full)
        assert "the ledger cannot be read: " in fast[1] + fast[2] and "Traceback" not in fast[1] + fast[2]
