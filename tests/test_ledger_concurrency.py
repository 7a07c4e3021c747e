"""Concurrent writers from separate OS processes (8 x 25 appends at once) wait for the lock and lose nothing: one chain, on SQLite
(BEGIN IMMEDIATE) and on PostgreSQL (a transaction-level advisory lock)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import gatekeeper
from gatekeeper.identity import child_env
from gatekeeper.ledger import CURRENT_VERSION, Ledger
from gatekeeper.ledger.database import read

pytest_plugins = ["postgres"]

REPO = Path(gatekeeper.__file__).resolve().parents[1]
WORKERS = 8
CASES, MEASUREMENTS = 12, 11
RECORDS = 1 + CASES + MEASUREMENTS + 1  # per worker, 25: start, case results, measurements, verdict

# Each worker opens the ledger, reports ready, waits for "go", then appends as fast as it can.
WORKER = """
import sys, time
from pathlib import Path
from gatekeeper.ledger import Ledger
url, tmp, worker = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
cases, measurements = int(sys.argv[4]), int(sys.argv[5])
with Ledger(url) as ledger:
    (tmp / f"ready-{worker}").touch()
    while not (tmp / "go").exists():
        time.sleep(0.005)
    eid = ledger.start_evaluation("prefix_cache", f"w{worker}", "byte_equivalence", {}, {"worker": worker})
    for i in range(max(cases, measurements)):
        if i < cases:
            ledger.add_case_result(eid, f"suite/case-{i}", "on", 0, {"worker": worker, "i": i})
        if i < measurements:
            ledger.add_measurement(f"w{worker}", {"worker": worker}, {"i": i})
    ledger.finish_evaluation(eid, "PASS", [], {"worker": worker})
"""


def race(worker: str, url: str, tmp_path: Path) -> None:
    """Run WORKERS copies of ``worker`` against ``url``, released together once all are ready; all must succeed."""
    env = child_env(PYTHONPATH=str(REPO))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", worker, url, str(tmp_path), str(w), str(CASES), str(MEASUREMENTS)], env=env, stderr=subprocess.PIPE, text=True
        )
        for w in range(WORKERS)
    ]
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"ready-{w}").exists() for w in range(WORKERS)):
            assert all(p.poll() is None for p in procs), [p.stderr.read() for p in procs if p.poll() is not None]
            assert time.monotonic() < deadline, "workers never became ready"
            time.sleep(0.01)
        (tmp_path / "go").touch()
        errors = [p.communicate(timeout=120)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert [p.returncode for p in procs] == [0] * WORKERS, errors


def test_concurrent_processes_append_without_loss(ledger_url: str, tmp_path: Path) -> None:
    url = ledger_url
    Ledger(url).close()  # created and migrated once, so the race is about appends only
    race(WORKER, url, tmp_path)

    with Ledger(url) as ledger:
        report = ledger.verify()
        entries = ledger.entries()
        evaluations = ledger.evaluations()
        measurements = ledger.measurements()
        cases = [c for e in evaluations for c in ledger.evaluation(e["id"])["case_results"]]

    assert report.ok, report.problem
    assert report.entries == len(entries) == WORKERS * RECORDS
    assert [e["seq"] for e in entries] == list(range(1, WORKERS * RECORDS + 1))
    assert len({(e["kind"], e["record_id"]) for e in entries}) == len(entries)
    assert sorted(e["operator"] for e in evaluations) == [f"w{w}" for w in range(WORKERS)]
    assert all(e["status"] == "PASS" and e["case_results"] == CASES for e in evaluations)
    # Every record present exactly once.
    assert Counter((m["config"]["worker"], m["result"]["i"]) for m in measurements) == Counter(
        {(w, i): 1 for w in range(WORKERS) for i in range(MEASUREMENTS)}
    )
    assert Counter((c["result"]["worker"], c["result"]["i"]) for c in cases) == Counter(
        {(w, i): 1 for w in range(WORKERS) for i in range(CASES)}
    )
    # Stamped under the lock, so time never runs backwards along the chain.
    stamps = [e["payload"].get("at") or e["payload"].get("started_at") or e["payload"]["finished_at"] for e in entries]
    assert stamps == sorted(stamps)


# Each worker opens a blank database at the same moment: migrating it must happen once, then each appends.
OPENER = """
import sys, time
from pathlib import Path
from gatekeeper.ledger import Ledger
url, tmp, worker = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
(tmp / f"ready-{worker}").touch()
while not (tmp / "go").exists():
    time.sleep(0.005)
with Ledger(url) as ledger:
    ledger.add_measurement(f"w{worker}", {"worker": worker}, {})
"""


def test_concurrent_processes_migrate_a_blank_ledger_once(ledger_url: str, tmp_path: Path) -> None:
    race(OPENER, ledger_url, tmp_path)
    with Ledger(ledger_url) as ledger:
        report = ledger.verify()
        assert report.ok and report.entries == WORKERS
        assert sorted(m["operator"] for m in ledger.measurements()) == [f"w{w}" for w in range(WORKERS)]
        with read(ledger.engine) as conn:
            versions = [v for (v,) in conn.exec_driver_sql("SELECT version FROM migrations ORDER BY version")]
        assert versions == list(range(1, CURRENT_VERSION + 1))
