"""``ledger verify`` from the last good verify (the workspace's mark): it rechecks only what was appended since (and
every flip, approval, evaluation and verdict), on SQLite and PostgreSQL, and finds there what is wrong with new entries
and rows, and a tail cut or rewritten below the mark; an old case result or shadow batch edited without a trace in the
schema is found by ``--full`` only, as docs/ledger.md says. No timings here: bench/ledger.py measures them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from trust import backend_ws, cli, flip, keys, ledger_of, rewrite_row, unlocked  # noqa: F401

from gatekeeper.identity import canonical_json
from gatekeeper.ledger import Ledger, mark
from gatekeeper.ledger.chain import entry_hash

pytest_plugins = ["postgres"]


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    (tmp_path / "ledger").mkdir()
    return tmp_path


def edit(url: str, *sql: str, params: tuple = ()) -> None:
    """Run ``sql`` on the ledger with its triggers dropped and put back after, as an attacker with the file can."""
    conn = unlocked(url)
    try:
        for statement in sql:
            conn.execute(statement, params)
    finally:
        conn.close()


def add(ledger: Ledger, n: int) -> int:
    """``n`` appends (an evaluation, then its case results); the evaluation's id."""
    ev = ledger.start_evaluation("prefix_cache", "ci", "byte_equivalence", {"engine": "sim"}, {})
    for i in range(n - 1):
        ledger.add_case_result(ev, f"s/{i}", "on", 0, {"text": str(i)})
    return ev


def test_a_verify_records_where_it_got_to_and_the_next_checks_only_what_came_after(ledger_url, ws):
    with Ledger(ledger_url) as ledger:
        add(ledger, 5)
        first = ledger.verify(ws)
        assert first.ok and first.since is None and first.why_full == "no verified mark yet"
        assert (first.reached.seq, first.reached.entries) == (5, 5) and mark.path(ws).is_file()
        add(ledger, 3)
        second = ledger.verify(ws)
        assert second.ok and second.since == 5 and second.entries == 8 and second.why_full == ""
        assert ledger.verify(ws).since == 8  # and on from there; nothing new is fine too
        assert ledger.verify(ws).since == 8
        full = ledger.verify(ws, full=True)
        assert full.ok and full.since is None and full.why_full == "--full" and full.entries == 8
        assert ledger.verify().since is None  # no workspace: no mark, the whole chain, as before


def test_a_broken_new_entry_is_found_from_the_mark(ledger_url, ws):
    with Ledger(ledger_url) as ledger:
        add(ledger, 4)
        assert ledger.verify(ws).ok
        add(ledger, 2)
    edit(ledger_url, "UPDATE case_result SET case_id = 's/forged' WHERE id = 4")  # seq 6: after the mark
    with Ledger(ledger_url) as ledger:
        report = ledger.verify(ws)
    assert not report.ok and report.since == 4 and report.first_bad_seq == 6
    assert report.problem == "seq 6: case_result 4 does not match its entry (field 'case_id')"


def test_a_new_row_without_its_entry_is_found_from_the_mark(ledger_url, ws):
    with Ledger(ledger_url) as ledger:
        ev = add(ledger, 3)
        assert ledger.verify(ws).ok
    edit(ledger_url, "INSERT INTO case_result (evaluation_id, case_id, config, repeat, result, at) "
                     "VALUES (?, 's/x', 'on', 0, '{}', '2026-01-01T00:00:00Z')", params=(ev,))
    with Ledger(ledger_url) as ledger:
        report = ledger.verify(ws)
    assert not report.ok and report.since == 3 and report.problem == "case_result 3 has no entry in the chain"


@pytest.mark.parametrize("how", ["cut", "rewritten"])
def test_a_tail_cut_or_rewritten_below_the_mark_is_found(ledger_url, ws, how):
    with Ledger(ledger_url) as ledger:
        add(ledger, 5)
        assert ledger.verify(ws).ok
    if how == "cut":
        edit(ledger_url, "DELETE FROM entry WHERE seq = 5", "DELETE FROM case_result WHERE id = 4")
    else:
        conn = unlocked(ledger_url)
        rewrite_row(conn, "case_result", 2, case_id="s/forged")  # every hash after it recomputed
        conn.close()
    with Ledger(ledger_url) as ledger:
        assert ledger.verify().ok  # the chain alone cannot tell
        report = ledger.verify(ws)
        assert not report.ok and report.since is None  # and the whole chain was checked besides
        if how == "cut":
            assert report.problem.startswith("truncated: the ledger ends at seq 4, below seq 5 that an earlier verify")
            assert report.why_full == "the ledger no longer holds the entry the mark names"
        else:
            assert report.problem.startswith("forked: seq 5 has hash ")
        assert f"delete ledger/{mark.FILE}" in report.problem
        assert not ledger.verify(ws).ok  # a failed verify does not move the mark


def test_without_a_usable_mark_it_checks_the_whole_chain_and_says_why(ledger_url, ws, tmp_path):
    with Ledger(ledger_url) as ledger:
        add(ledger, 3)
        assert ledger.verify(ws).why_full == "no verified mark yet"
        mark.path(ws).write_text("{not json")
        report = ledger.verify(ws)
        assert report.ok and report.since is None and "cannot be read" in report.why_full
        assert ledger.verify(ws).since == 3  # rewritten by the good verify
        marks = json.loads(mark.path(ws).read_text())
        (key,) = marks
        marks[key]["first"] = "0" * 64  # a mark of another ledger at the same place: a new database
        mark.path(ws).write_text(json.dumps(marks))
        report = ledger.verify(ws)
        assert report.ok and report.since is None and "another ledger" in report.why_full


def test_an_old_row_edited_since_the_mark_is_found_by_full_only(ledger_url, ws):
    """What docs/ledger.md says an incremental verify does not cover: a row it verified before, edited without a trace
    in the schema (the triggers put back), is seen by --full."""
    with Ledger(ledger_url) as ledger:
        add(ledger, 4)
        assert ledger.verify(ws).ok
        add(ledger, 2)
    edit(ledger_url, "UPDATE case_result SET case_id = 's/forged' WHERE id = 1")  # seq 2, verified before
    with Ledger(ledger_url) as ledger:
        incremental = ledger.verify(ws)
        assert incremental.ok and incremental.since == 4
        full = ledger.verify(ws, full=True)
    assert not full.ok and full.first_bad_seq == 2
    assert full.problem == "seq 2: case_result 1 does not match its entry (field 'case_id')"


def test_an_old_flip_edited_is_found_from_the_mark(ledger_url, ws):
    """Flips, approvals, evaluations and verdicts are few and flags rest on them: every verify rechecks all of them,
    and that each still links into the chain."""
    with Ledger(ledger_url) as ledger:
        add(ledger, 3)
        ledger.add_flip("prefix_cache", "off", "ana", "r")  # seq 4
        add(ledger, 2)
        assert ledger.verify(ws).ok
        add(ledger, 1)
    edit(ledger_url, "UPDATE flip SET state = 'on' WHERE id = 1")
    with Ledger(ledger_url) as ledger:
        report = ledger.verify(ws)
    assert not report.ok and report.since == 6
    assert report.problem == "seq 4: flip 1 does not match its entry (field 'state')"
    conn = unlocked(ledger_url)  # the entry's payload and hash made to match, that entry alone
    conn.execute("UPDATE flip SET state = 'off' WHERE id = 1")
    rewrite = conn.execute("SELECT prev_hash, payload FROM entry WHERE seq = 4").fetchone()
    payload = {**json.loads(rewrite[1]), "reason": "forged"}
    conn.execute("UPDATE flip SET reason = 'forged' WHERE id = 1")
    conn.execute("UPDATE entry SET payload = ?, hash = ? WHERE seq = 4",
                 (canonical_json(payload).decode(), entry_hash(4, rewrite[0], "flip", 1, payload)))
    conn.close()
    with Ledger(ledger_url) as ledger:
        report = ledger.verify(ws)
    assert not report.ok and report.since == 6 and report.problem == "seq 5: prev_hash does not link to the entry before it"


def test_the_command_says_what_it_checked(run_cli, backend_ws):
    """backend_ws holds an evaluation and its verdict (seq 1, 2)."""
    with Ledger(ledger_of(backend_ws)) as ledger:
        add(ledger, 2)  # seq 3, 4: case_result 1
    code, data = cli(run_cli, backend_ws, "ledger", "verify")
    assert code == 0 and data["coverage"] == {"full": True, "from_seq": None, "why": "no verified mark yet"}
    assert flip(run_cli, backend_ws, "off", evaluation=None)[0] == 0
    code, data = cli(run_cli, backend_ws, "ledger", "verify")
    assert code == 0 and data["entries"] == 5 and data["coverage"] == {"full": False, "from_seq": 4, "why": ""}
    edit(ledger_of(backend_ws), "UPDATE case_result SET case_id = 's/forged' WHERE id = 1")  # seq 4, verified before
    ledger = ("--ledger", ledger_of(backend_ws))
    code, out, _ = run_cli("--workspace", backend_ws, *ledger, "ledger", "verify")
    assert code == 0 and out.splitlines()[-1].startswith("checked: from seq 5 (the entries since the last good verify")
    code, data = cli(run_cli, backend_ws, "ledger", "verify", "--full")
    assert code == 1 and data["coverage"] == {"full": True, "from_seq": None, "why": "--full"}
    assert data["problem"] == "seq 4: case_result 1 does not match its entry (field 'case_id')"
    code, out, _ = run_cli("--workspace", backend_ws, *ledger, "ledger", "verify", "--full")
    assert code == 1 and out.splitlines()[-1] == "checked: full (--full)"
