"""Nothing escapes as a traceback: a damaged ledger is named problems, a damaged user file is exit 2 naming
it, and a crash is exit 3 (never 1, which is a FAIL)."""

from __future__ import annotations

import json
import random
import sqlite3
from pathlib import Path

import pytest
from postgres import Raw, is_postgres

from gatekeeper.ledger import Ledger

pytest_plugins = ["postgres"]

GARBAGE = {
    "binary": bytes(range(256)) * 4,  # NULs, control bytes and bytes that are no UTF-8
    "non_utf8": b"adapter: torch\nmodel: \"caf\xe9\"\n",  # one Latin-1 byte in otherwise good YAML/JSON
    "deep_yaml": b"[" * 100_000,  # nested past any parser's recursion limit (also JSON)
    "deep_mapping": b"a: " + b"{b: " * 50_000 + b"1" + b"}" * 50_000 + b"\n",
}


def db_of(ws: Path) -> Path:
    return ws / "ledger" / "evidence.db"


@pytest.fixture
def workspace(workspace: Path) -> Path:
    """The flips here are written straight into the ledger, no checkpoint after them: so a policy that wants
    none (under the shipped one's checkpoint_after_flip, verify would also name each such flip uncovered)."""
    policy = workspace / "policies" / "prefix_cache.yaml"
    policy.write_text(policy.read_text().replace(", checkpoint_after_flip: true", ""))
    return workspace


def fill(db: Path | str) -> None:
    """A small ledger with one record of most kinds (at a SQLite file, or any ledger URL), closed (its WAL folded
    back into the file)."""
    with Ledger(db if isinstance(db, str) else f"sqlite:///{db}") as ledger:
        eid = ledger.start_evaluation("prefix_cache", "ana", "byte_equivalence", {"off": {"m": 1}, "on": {"m": 1}},
                                      {"limit": 2})
        for i in range(3):
            ledger.add_case_result(eid, f"s/c{i}", "off", 0, {"text": f"answer {i}", "tokens": [i, i + 1]})
            ledger.add_comparison(eid, f"s/c{i}", i != 1, {"first_difference": i})
        ledger.finish_evaluation(eid, "PASS", ["equal: all"], {"cases": 3})
        aid = ledger.add_approval("prefix_cache", eid, "bo", "reviewed")
        ledger.add_flip("prefix_cache", "on", "bo", "ship it", eid, [aid])
        ledger.add_refusal("prefix_cache", "cy", ["stale: evidence"], eid)
        ledger.add_measurement("ana", {"suite": "s"}, {"tax": 0.5})
    assert isinstance(db, str) or not db.with_name(db.name + "-wal").exists()


def verify(run_cli, ws: Path, *extra, ledger: str | None = None) -> tuple[int, dict, str]:
    code, out, err = run_cli("--workspace", ws, *(("--ledger", ledger) if ledger else ()), "ledger", "verify", *extra, "--json")
    assert "Traceback" not in out + err
    return code, json.loads(out), err


def sql(db: Path, *statements: str) -> None:
    conn = sqlite3.connect(db, isolation_level=None)
    for s in statements:
        conn.execute(s)
    conn.close()


# --- the ledger file, damaged byte by byte -----------------------------------------------------


def content(db: Path, layout: dict[str, list[str]]) -> object:
    """Everything the file holds, as SQLite reads it (rows with their stored types, the schema), or
    'unreadable'; read-only, so judging a flip changes nothing."""
    try:
        conn = sqlite3.connect(f"file:{db}?immutable=1", uri=True)
        conn.text_factory = bytes
        try:
            out = [conn.execute("SELECT type, name, tbl_name, hex(sql) FROM sqlite_master ORDER BY type, name").fetchall()]
            for table, columns in layout.items():
                cols = ", ".join(f'typeof("{c}"), hex("{c}")' for c in columns)
                out.append(conn.execute(f'SELECT rowid, {cols} FROM "{table}" ORDER BY rowid').fetchall())
            return out
        finally:
            conn.close()
    except (sqlite3.Error, UnicodeDecodeError):  # the latter: SQLite's message quotes a damaged schema
        return "unreadable"


def test_random_byte_flips_are_all_reported_never_a_traceback(run_cli, workspace, tmp_path):
    db = db_of(workspace)
    fill(db)
    original = db.read_bytes()
    conn = sqlite3.connect(db)
    tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")]
    layout = {t: [c[1] for c in conn.execute(f'PRAGMA table_info("{t}")')] for t in tables}
    conn.close()
    before = content(db, layout)
    assert before != "unreadable"
    code, report, _ = verify(run_cli, workspace)
    assert code == 0 and report["ok"], report

    rng = random.Random(20261201)
    changed = reported = 0
    for n in range(300):
        at, mask = rng.randrange(len(original)), rng.randrange(1, 256)
        flipped = bytearray(original)
        flipped[at] ^= mask
        for extra in ("-wal", "-shm"):
            db.with_name(db.name + extra).unlink(missing_ok=True)
        db.write_bytes(bytes(flipped))
        differs = content(db, layout) != before
        where = f"flip {n}: byte {at} ^ {mask:#04x}"
        if n % 10 == 0:  # from the mark the first verify left: old rows are not reread, but nothing may traceback
            code, out, err = run_cli("--workspace", workspace, "ledger", "verify", "--json")
            assert "Traceback" not in out + err and code in (0, 1, 2), (where, code, out, err)
        # the whole check: every flipped byte of an old row is its subject
        code, out, err = run_cli("--workspace", workspace, "ledger", "verify", "--full", "--json")
        assert "Traceback" not in out + err, where
        doc = json.loads(out)  # one JSON document whatever happened
        assert code in (0, 1, 2), (where, code, out, err)
        if code == 1:
            assert doc["ok"] is False and doc["problems"] and all(isinstance(p, str) and p for p in doc["problems"])
        if code == 2:
            assert str(db) in doc["error"], (where, doc)  # one line naming the file
        if differs:
            changed += 1
            assert code != 0, (where, "the content changed and verify said ok")
        reported += code != 0
    assert changed >= 30  # the flips reached rows, the schema and the b-tree pages, not only free space
    assert reported >= changed


def test_a_file_that_is_not_a_database_is_one_line_exit_2(run_cli, workspace):
    db = db_of(workspace)
    db.write_bytes(b"this is not a database, just text\n" * 200)
    code, out, err = run_cli("--workspace", workspace, "ledger", "verify")
    assert code == 2 and "Traceback" not in out + err
    assert err.count("\n") == 1 and str(db) in err and "not a ledger" in err


def test_a_damaged_page_is_one_line_exit_1(run_cli, workspace):
    db = db_of(workspace)
    fill(db)
    data = bytearray(db.read_bytes())
    page = int.from_bytes(data[16:18], "big")
    data[page * 2: page * 3] = b"\xa5" * page  # scribble over the whole second page
    db.write_bytes(bytes(data))
    code, report, _ = verify(run_cli, workspace)
    assert code == 1 and not report["ok"] and report["problems"]
    code, out, err = run_cli("--workspace", workspace, "ledger", "verify")
    assert code == 1 and "Traceback" not in out + err and ("TAMPERED" in out or "DAMAGED" in out)


def test_invalid_utf8_in_a_row_is_named(run_cli, workspace):
    db = db_of(workspace)
    fill(db)
    sql(db, "DROP TRIGGER case_result_no_update",
        "UPDATE case_result SET result = CAST(X'7b22746578223aff7d' AS TEXT) WHERE id = 2")
    conn = sqlite3.connect(db)
    seq = conn.execute("SELECT seq FROM entry WHERE kind = 'case_result' AND record_id = 2").fetchone()[0]
    conn.close()
    code, report, _ = verify(run_cli, workspace)
    assert code == 1 and report["first_bad_seq"] == seq
    assert f"seq {seq}: case_result 2: field 'result' is not UTF-8 text" in report["problems"]


# --- what the chain does not hash --------------------------------------------------------------


@pytest.fixture
def filled(backend, request, workspace) -> str:
    """The workspace's ledger, filled, on this test's backend (its SQLite file or a fresh PostgreSQL database): its URL."""
    url = request.getfixturevalue("pg_url") if backend == "postgresql" else f"sqlite:///{db_of(workspace)}"
    fill(url)
    return url


def verify_at(run_cli, ws: Path, url: str) -> tuple[int, dict, str]:
    return verify(run_cli, ws, ledger=url)


def snapshot(url: str) -> object:
    """What verify must leave as it found it: the SQLite file's bytes, or PostgreSQL's tables, columns and migrations."""
    if not is_postgres(url):
        return Path(url[len("sqlite:///"):]).read_bytes()
    with Raw(url) as raw:
        tables = raw.columns()
        return tables, raw.execute("SELECT * FROM migrations ORDER BY version").fetchall() if "migrations" in tables else None


# SQL per backend: SQLite's trigger bodies, PostgreSQL's EXECUTE FUNCTION
ALTERED = {"sqlite": "CREATE TRIGGER flip_no_update BEFORE UPDATE ON flip BEGIN SELECT 1; END",
           # still a BEFORE UPDATE trigger calling the function, but only for one column: state can be changed
           "postgresql": "CREATE TRIGGER flip_no_update BEFORE UPDATE OF flag ON flip FOR EACH ROW "
                         "EXECUTE FUNCTION gatekeeper_append_only()"}
ADDED = {"sqlite": "CREATE TRIGGER sneaky AFTER INSERT ON verdict BEGIN SELECT 1; END",
         "postgresql": "CREATE TRIGGER sneaky AFTER INSERT ON verdict FOR EACH ROW EXECUTE FUNCTION gatekeeper_append_only()"}


def test_a_dropped_trigger_is_named(run_cli, workspace, filled):
    with Raw(filled) as raw:
        raw.drop_trigger("flip_no_update", "flip")
    code, report, _ = verify_at(run_cli, workspace, filled)
    assert code == 1 and report["problem"].startswith("trigger flip_no_update: missing"), report
    assert report["problems"] == [report["problem"]] and report["first_bad_seq"] is None
    with Ledger(filled) as ledger:
        assert not ledger.verify().ok  # the library's verify, not only the command


def test_an_altered_trigger_is_named(run_cli, workspace, filled, backend):
    with Raw(filled) as raw:
        raw.drop_trigger("flip_no_update", "flip")
        raw.execute(ALTERED[backend])
    code, report, _ = verify_at(run_cli, workspace, filled)
    assert code == 1 and report["problems"] == ["trigger flip_no_update: altered; it is not the append-only "
                                                "trigger on flip the migrations created"], report


def test_an_added_trigger_is_named(run_cli, workspace, filled, backend):
    with Raw(filled) as raw:
        raw.execute(ADDED[backend])
    code, report, _ = verify_at(run_cli, workspace, filled)
    assert code == 1 and "trigger sneaky (on verdict): not one gatekeeper creates" in report["problem"], report


@pytest.mark.parametrize("backend", ["postgresql"])  # SQLite triggers cannot be switched off, only dropped
@pytest.mark.parametrize("mode, named", [("DISABLE", "disabled"), ("ENABLE REPLICA", "enabled for replication sessions only")])
def test_a_disabled_trigger_is_named(run_cli, workspace, filled, mode, named):
    with Raw(filled) as raw:
        raw.execute(f"ALTER TABLE verdict {mode} TRIGGER verdict_no_update")
    code, report, _ = verify_at(run_cli, workspace, filled)
    assert code == 1 and report["problems"] == [f"trigger verdict_no_update: {named}; verdict is no longer "
                                                "append-only (ALTER TABLE ... DISABLE TRIGGER)"], report


@pytest.mark.parametrize("backend", ["postgresql"])  # the triggers' function: PostgreSQL's only
@pytest.mark.parametrize("body", ["BEGIN RETURN NEW; END", "BEGIN RETURN NULL; END"])
def test_an_altered_trigger_function_is_named(run_cli, workspace, filled, body):
    with Raw(filled) as raw:  # every trigger left as it was, each now calling a function that lets the change through
        raw.execute(f"CREATE OR REPLACE FUNCTION gatekeeper_append_only() RETURNS trigger LANGUAGE plpgsql AS $${body}$$")
        raw.execute("UPDATE verdict SET verdict = 'FAIL'")
    code, report, _ = verify_at(run_cli, workspace, filled)
    assert code == 1 and "function gatekeeper_append_only: altered; it is not the append-only function the " \
                         "migrations created" in report["problems"], report


MIGRATION_EDITS = [
    ("UPDATE migrations SET name = '0002_other' WHERE version = 2", "migrations: version 2 is recorded as '0002_other'"),
    ("UPDATE migrations SET version = 9 WHERE version = 4", "migrations: version 4 (0004_signatures) is not recorded"),
    ("UPDATE migrations SET version = 8 WHERE version = 3", "migrations: version 3 (0003_calibration) is not recorded"),
    ("DELETE FROM migrations WHERE version = 4", "migrations: version 4 (0004_signatures) is not recorded"),
    ("DELETE FROM migrations WHERE version = 2", "migrations: version 2 (0002_flush_measurement) is not recorded"),
    ("UPDATE migrations SET applied_at = 'yesterday' WHERE version = 1", "migrations: version 1: field 'applied_at'"),
    ("UPDATE migrations SET applied_at = '1999-01-01T00:00:00Z' WHERE version = 3", "migrations: version 3 was applied at"),
    ("DROP TABLE migrations", "migrations: the table is missing"),
]
@pytest.mark.parametrize("edit, named", MIGRATION_EDITS)
def test_an_edit_of_the_migrations_table_is_named(run_cli, workspace, filled, backend, edit, named):
    # Some edits would make opening migrate again: the command judges the migrations table before it opens.
    with Raw(filled) as raw:
        raw.execute(edit)
    before = snapshot(filled)
    code, report, _ = verify_at(run_cli, workspace, filled)
    assert code == 1 and any(p.startswith(named) for p in report["problems"]), report
    assert snapshot(filled) == before  # verify did not "repair" it by migrating again


@pytest.mark.parametrize("edit, named", MIGRATION_EDITS)
def test_preflight_names_an_edit_of_the_migrations_table(filled, edit, named):
    """What the command judges before opening the ledger (which would migrate it), on both backends."""
    from gatekeeper.ledger.database import make_engine, read
    from gatekeeper.ledger.verify import preflight

    with Raw(filled) as raw:
        raw.execute(edit)
    engine = make_engine(filled)
    try:
        with read(engine) as conn:
            problems = preflight(conn)
    finally:
        engine.dispose()
    assert any(p.startswith(named) for p in problems), problems


def test_a_ledger_from_a_newer_gatekeeper_is_exit_2_not_tampered(run_cli, workspace, filled):
    with Raw(filled) as raw:
        raw.execute("INSERT INTO migrations VALUES (7, '0007_future', '2030-01-01T00:00:00Z')")
    code, report, _ = verify_at(run_cli, workspace, filled)
    assert code == 2 and "newer than this gatekeeper knows" in report["error"], report


def test_an_older_ledger_still_upgrades_and_verifies(run_cli, workspace):
    from gatekeeper.ledger import migrate
    from gatekeeper.ledger.database import make_engine

    engine = make_engine(f"sqlite:///{db_of(workspace)}")
    migrate(engine, target=2)
    engine.dispose()
    code, report, _ = verify(run_cli, workspace)
    assert code == 0 and report["ok"], report


# --- user files: garbage in, exit 2 naming the file ---------------------------------------------


def _expect_named(code, out, err, path: Path, json_: bool = True):
    assert "Traceback" not in out + err
    message = json.loads(out)["error"] if json_ else err
    assert code == 2, (code, out, err)
    assert str(path) in message or path.name in message, message
    return message


@pytest.mark.parametrize("garbage", GARBAGE)
@pytest.mark.parametrize("file, command", [
    ("engines/auto.yaml", ["evaluate", "--flag", "prefix_cache"]),
    ("policies/prefix_cache.yaml", ["evaluate", "--flag", "prefix_cache"]),
    ("assertions/assistant.yaml", ["measure"]),
    ("engines/auto.yaml", ["measure"]),
])
def test_workspace_yaml_garbage_is_exit_2_naming_the_file(run_cli, workspace, file, command, garbage):
    path = workspace / file
    path.write_bytes(GARBAGE[garbage])
    code, out, err = run_cli("--workspace", workspace, *command, "--json")
    _expect_named(code, out, err, path)


@pytest.mark.parametrize("garbage", GARBAGE)
def test_a_prompt_segment_file_that_is_not_utf8(run_cli, workspace, garbage):
    path = workspace / "prompts" / "assistant_system.txt"
    assert path.is_file()  # the template suite loads its system prompt from this file
    path.write_bytes(b"\xff\xfe" + GARBAGE[garbage])
    code, out, err = run_cli("--workspace", workspace, "measure", "--json")
    _expect_named(code, out, err, path)


@pytest.mark.parametrize("garbage", [*GARBAGE, "surrogate", "huge_int"])
@pytest.mark.parametrize("command", [["analyze"], ["replay", "--simulate"]])
def test_capture_and_trace_garbage_is_exit_2_naming_the_file(run_cli, workspace, tmp_path, command, garbage):
    path = tmp_path / "trace.jsonl"
    path.write_bytes({
        "surrogate": b'{"stage": "a", "stream": 1, "t": 0, "text": "ab\\ud800"}\n',
        "huge_int": b'{"stage": "a", "stream": 1, "t": 0, "tokens": [' + b"9" * 5000 + b', 2]}\n',
    }.get(garbage) or GARBAGE[garbage])
    code, out, err = run_cli("--workspace", workspace, command[0], path, *command[1:], "--json")
    _expect_named(code, out, err, path)


@pytest.mark.parametrize("garbage", GARBAGE)
def test_allowed_signers_garbage_is_exit_2_naming_the_file(run_cli, workspace, garbage):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    fill(db_of(workspace))
    key = workspace.parent / "id_ed25519"
    key.write_bytes(Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()))
    path = workspace / "policies" / "allowed_signers"
    path.write_bytes(GARBAGE[garbage])
    code, out, err = run_cli("--workspace", workspace, "ledger", "checkpoint", "--sign", key, "--json")
    _expect_named(code, out, err, path)


@pytest.mark.parametrize("garbage", [*GARBAGE, "bad_time", "signature_not_text"])
def test_checkpoint_garbage_is_exit_2_naming_the_file(run_cli, workspace, tmp_path, garbage):
    fill(db_of(workspace))
    path = tmp_path / "cp.json"
    assert run_cli("--workspace", workspace, "ledger", "checkpoint", "--output", path)[0] == 0
    good = json.loads(path.read_text())
    path.write_bytes({
        "bad_time": json.dumps({**good, "at": "not a time"}).encode(),
        "signature_not_text": json.dumps({**good, "signer": "ana", "signature": 7}).encode(),
    }.get(garbage) or GARBAGE[garbage])
    code, out, err = run_cli("--workspace", workspace, "ledger", "verify", "--checkpoint", path, "--json")
    _expect_named(code, out, err, path)


# --- recipe.json -------------------------------------------------------------------------------


@pytest.mark.parametrize("body, field", [
    ('{"version": 1, "engine": "torch", "stages": {"tiny": "pinned"}}', "stages.tiny"),
    ('{"version": 1, "engine": "torch", "stages": {}, "pinned_by": "ana"}', "pinned_by"),
    ('{"version": 1, "engine": "torch", "stages": {"tiny": {"boundary": 3, "content_hash": "x", '
     '"model_digest": null, "adapter_digest": null, "extra": 1}}}', "stages.tiny.extra"),
    ('{"version": 1, "engine": "torch", "stages": {"tiny": {"boundary": "3", "content_hash": "x", '
     '"model_digest": null, "adapter_digest": null}}}', "stages.tiny.boundary"),
    ('{"version": 1, "engine": "torch", "stages": {"tiny": {"boundary": 3}}}', "stages.tiny.content_hash"),
    ('{"version": 1, "engine": ["torch"], "stages": {}}', "engine"),
])
def test_recipe_unknown_keys_and_wrong_shapes_name_the_field(tmp_path, body, field):
    from gatekeeper.cache import recipe
    from gatekeeper.errors import GatekeeperError

    (tmp_path / "recipe.json").write_text(body)
    with pytest.raises(GatekeeperError, match=rf"recipe\.json: field '{field}'"):
        recipe.read(tmp_path)


@pytest.mark.parametrize("garbage", GARBAGE)
def test_recipe_garbage_is_a_named_error(tmp_path, garbage):
    from gatekeeper.cache import recipe
    from gatekeeper.errors import GatekeeperError

    (tmp_path / "recipe.json").write_bytes(GARBAGE[garbage])
    with pytest.raises(GatekeeperError, match=r"recipe\.json: .*gatekeeper pin"):
        recipe.read(tmp_path)


@pytest.mark.parametrize("body", ['{"version": 1, "engine": "torch", "stages": {"tiny": "pinned"}}', "[" * 100_000,
                                  b"\xff{}"])
def test_recipe_through_the_cli(run_cli, tiny_ws, tmp_path, monkeypatch, body):
    monkeypatch.setenv("GATEKEEPER_HOME", str(tmp_path / "home"))
    path = tiny_ws / "recipe.json"
    path.write_bytes(body if isinstance(body, bytes) else body.encode())
    code, out, err = run_cli("--workspace", tiny_ws, "measure", "--engine", "tiny", "--limit", "1", "--json")
    message = _expect_named(code, out, err, path)
    if "pinned" in str(body):
        assert "field 'stages.tiny'" in message


# --- a crash is exit 3 -------------------------------------------------------------------------


def test_an_internal_error_is_exit_3_with_one_line(run_cli, tmp_path, monkeypatch):
    from gatekeeper.traffic.captures import capture

    def broken(path, **options):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(capture, "read", broken)
    path = tmp_path / "c.jsonl"
    path.write_text('{"stage": "a", "stream": 1, "t": 0, "tokens": [1, 2]}\n')
    code, out, err = run_cli("analyze", path)
    assert code == 3 and out == "" and "Traceback" not in err
    assert err.count("\n") == 1 and "bug" in err and "ZeroDivisionError" in err
    code, out, err = run_cli("analyze", path, "--json")
    assert code == 3 and "Traceback" not in out + err
    assert "ZeroDivisionError" in json.loads(out)["error"] and "bug" in json.loads(out)["error"]


def test_an_internal_error_in_verify_is_exit_3_not_a_fail(run_cli, workspace, monkeypatch):
    from gatekeeper.ledger import store

    fill(db_of(workspace))

    def broken(conn):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(store, "verify", broken)
    code, out, err = run_cli("--workspace", workspace, "ledger", "verify", "--json")
    assert code == 3 and "Traceback" not in out + err and "bug" in json.loads(out)["error"]


def test_a_damaged_ledger_under_another_command_is_exit_2_not_a_crash(run_cli, workspace):
    db = db_of(workspace)
    fill(db)
    data = bytearray(db.read_bytes())
    page = int.from_bytes(data[16:18], "big")
    for p in range(1, len(data) // page):
        data[p * page + 8: p * page + 40] = b"\xa5" * 32
    db.write_bytes(bytes(data))
    code, out, err = run_cli("--workspace", workspace, "ledger", "list", "--json")
    assert code == 2 and "Traceback" not in out + err
    assert any(w in json.loads(out)["error"] for w in ("cannot be read", "cannot open the ledger"))
