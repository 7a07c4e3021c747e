"""PostgreSQL going away: a server lost mid-evaluation leaves the evaluation aborted and the ledger verifying
once it is back; a server that cannot be reached at all is bad input (exit 2) naming the URL and the fix."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest
from postgres import Server, new_database, serving

from gatekeeper.identity import child_env

TESTS = Path(__file__).resolve().parent


@pytest.fixture
def own_server() -> Iterator[Server]:
    """A PostgreSQL server of this test's own, which it may stop and restart (not the run's shared one)."""
    yield from serving()


def gatekeeper(ws: Path, url: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = child_env(PYTHONPATH=f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    env.pop("GATEKEEPER_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "gatekeeper.cli", "--workspace", str(ws), "--ledger", url, *args],
                          env=env, capture_output=True, text=True, timeout=timeout)


def _wait_for_evaluation(server: Server, database: str, proc: subprocess.Popen, timeout: float = 120) -> int:
    """The id of the evaluation the subprocess started, once its row is in the ledger."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        try:
            with server.connect(database) as conn:
                row = conn.execute("SELECT id FROM evaluation ORDER BY id LIMIT 1").fetchone()
        except Exception:  # noqa: BLE001 - not created or migrated yet
            row = None
        if row:
            return row[0]
        time.sleep(0.05)
    raise AssertionError("the evaluation never started writing")


def test_server_lost_mid_evaluation_leaves_it_aborted_and_the_ledger_verifying(tiny_ws: Path, own_server: Server):
    url = new_database(own_server)
    database = url.rsplit("/", 1)[1]
    env = child_env(PYTHONPATH=f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    env.pop("GATEKEEPER_DEBUG", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "gatekeeper.cli", "--workspace", str(tiny_ws), "--ledger", url, "evaluate",
         "--flag", "prefix_cache", "--engine", "tiny", "--json"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        eid = _wait_for_evaluation(own_server, database, proc)
        own_server.crash()
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
        proc.wait()

    # A clear one-line error: bad circumstances (2), or at worst no verdict (1); never a crash (3) or a traceback.
    assert proc.returncode in (1, 2), (proc.returncode, out, err)
    assert "Traceback" not in out + err, err
    error = json.loads(out)["error"]
    assert "\n" not in error and "127.0.0.1" in error, error
    assert not (tiny_ws / "ledger" / "evidence.db").exists()  # nothing fell back to the workspace's SQLite ledger

    own_server.restart()
    listed = gatekeeper(tiny_ws, url, "ledger", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    evaluations = json.loads(listed.stdout)["evaluations"]
    assert [(e["id"], e["status"]) for e in evaluations] == [(eid, "aborted")]
    verified = gatekeeper(tiny_ws, url, "ledger", "verify", "--json")
    assert verified.returncode == 0 and json.loads(verified.stdout)["ok"], verified.stdout + verified.stderr


UNREACHABLE = "postgresql+psycopg://nobody:s3cret@127.0.0.1:1/none"


@pytest.mark.parametrize("command", [
    ["status"],
    ["evaluate", "--flag", "prefix_cache", "--engine", "tiny"],
    ["ledger", "verify"],
])
def test_unreachable_server_is_exit_2_naming_the_url_and_the_fix(tiny_ws: Path, command: list[str]):
    for json_ in ([], ["--json"]):
        done = gatekeeper(tiny_ws, UNREACHABLE, *command, *json_)
        assert done.returncode == 2, (done.stdout, done.stderr)
        message = json.loads(done.stdout)["error"] if json_ else done.stderr.strip().removeprefix("error: ")
        assert "Traceback" not in done.stdout + done.stderr
        assert "\n" not in message, message
        assert "postgresql+psycopg://nobody:***@127.0.0.1:1/none" in message and "s3cret" not in message, message
        assert "check that" in message, message  # the fix
    assert not (tiny_ws / "ledger" / "evidence.db").exists()  # nothing written, not even a fallback
