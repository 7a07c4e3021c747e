import functools
import json
import os
from pathlib import Path

import pytest
from served import tiny_gguf  # noqa: F401  (fixture: built once per worker)
from tiny_models import tiny_llama  # noqa: F401  (fixture)

# Under pytest-xdist (make check and make test: TEST_JOBS workers) each worker, and every process it starts, runs on a
# core of its own: llama.cpp's and OpenMP's threads spin while they wait, and two engines sharing a core slow each other
# many times over. Engines size their threads by the cores they may run on (served.threads, the llamacpp adapter).
if (worker := os.environ.get("PYTEST_XDIST_WORKER")) and hasattr(os, "sched_setaffinity"):
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")):
        os.sched_setaffinity(0, {cores[int(worker.removeprefix("gw")) % len(cores)]})
        os.environ["OMP_NUM_THREADS"] = "1"

# The longest files go to the workers first (longest first, as measured; docs/testing.md), so the two end together. The
# Makefile passes --no-loadscope-reorder: pytest-xdist otherwise hands out files by their number of tests.
LONGEST = ("test_served_vllm.py", "test_shipped_power.py", "test_engine_http.py", "test_probes.py", "test_load.py",
           "test_real_bugs.py", "test_served_sides.py", "test_default_model_verdicts.py", "test_engine_llamacpp.py",
           "test_ray.py", "test_examples.py", "test_served_llama_cpp_python.py", "test_guard.py", "test_worker.py",
           "test_enablements.py", "test_declared.py", "test_serve.py", "test_aligned_gate.py", "test_served_mlx.py")


def pytest_collection_modifyitems(items):
    # the longest files first, then the other files with slow tests, then the fast ones (short: they fill the tails)
    slow = {item.path.name for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: (LONGEST.index(item.path.name) if item.path.name in LONGEST else len(LONGEST),
                                 item.path.name not in slow))


FILE_SECONDS: dict[str, float] = {}  # per test file, its tests' setup, call and teardown (on the controller: every worker's)


def pytest_runtest_logreport(report):
    FILE_SECONDS[report.nodeid.split("::")[0]] = FILE_SECONDS.get(report.nodeid.split("::")[0], 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    """The longest files, to keep LONGEST in the order they cost (docs/testing.md)."""
    if FILE_SECONDS:
        terminalreporter.section("longest files")
        for path, seconds in sorted(FILE_SECONDS.items(), key=lambda kv: -kv[1])[:15]:
            terminalreporter.write_line(f"{seconds:8.1f}s {path}")


ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    """A fresh workspace laid out by the real ``init`` code."""
    from gatekeeper.setup.scaffold import init_workspace

    ws = tmp_path / "ws"
    init_workspace(ws)
    # Flips in these tests are about evidence and approvals; the power a flip needs (min_power) is tested
    # where calibrations are made (test_calibrate.py, test_shipped_power.py).
    policy = ws / "policies" / "prefix_cache.yaml"
    policy.write_text("".join(line for line in policy.read_text().splitlines(keepends=True) if not line.startswith("min_power:")))
    # The cache probes, the teacher-forced distance and the reference arm (all on by default) are tested where they
    # are the subject (test_probes.py; test_gate.py, test_distance.py and the gates that are not exact;
    # test_reference.py and the tests that call ``read_reference``); elsewhere the probes would only add their cases
    # to every count, the distance three prefills per turn, and the reference one cache-free read per answer.
    policy.write_text(policy.read_text() + "probes: off\ndistance: false\nreference: false\n")
    return ws


def read_reference(ws: Path) -> None:
    """The prefix_cache policy with the reference arm read, as shipped (the ``workspace`` fixture turns it off)."""
    policy = ws / "policies" / "prefix_cache.yaml"
    policy.write_text(policy.read_text().replace("reference: false\n", ""))


@pytest.fixture
def run_cli(monkeypatch, tmp_path):
    """Invoke the real CLI in-process; returns (exit_code, stdout, stderr)."""
    import typer.testing
    from typer.testing import CliRunner

    from gatekeeper.cli import app

    monkeypatch.delenv("GATEKEEPER_WORKSPACE", raising=False)
    # typer builds the click tree, and each command's click object, on every invoke (two thirds of a `ledger verify`
    # here); the tree is the same each time, so a worker builds it once and keeps the commands it has built
    monkeypatch.setattr(typer.testing, "_get_command", _built)

    def run(*args: str):
        result = CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)
        return result.exit_code, result.stdout, result.stderr

    return run


@functools.cache
def _built(app):
    import typer.main

    return typer.main.get_command(app)


def rules(n: int = 12) -> str:
    """A static system prompt of ``n`` rules (about 20 tokens each)."""
    return " ".join(f"Rule {i}: the router reads the request, picks a tool, and passes the arguments on." for i in range(n))


RULES = rules()
# The default model's tests read five rules (about 100 tokens of static prompt; three of vLLM's 32-token blocks):
# prefill is most of a turn's time on a CPU, and twelve cost them twice as much. The tiny random models' tests keep
# twelve (near-ties planted in them were measured on that prompt).
SHORT = 5


def suite(n_rules: int = 12) -> str:
    """The tiny suite: four cases, one of three turns, behind a static prompt of ``n_rules`` rules."""
    return f"""suite: tiny
stage: tiny
prompt:
  - {{role: system, static: false, text: "Session: {{session}}"}}
  - {{role: system, static: true, text: "{rules(n_rules)}"}}
  - {{role: user, static: false, text: "{{query}}"}}
decoding: {{max_tokens: 12}}
cases:
  - id: a
    vars: {{session: "user=ana", query: "What is 2+2?"}}
    assert: [{{type: max-length, value: 10000}}]
  - id: b
    vars: {{session: "user=ben", query: "Book the cheapest flight to Porto."}}
    assert: [{{type: min-length, value: 1}}]
  - id: c
    vars: {{session: "user=cat", query: "Summarise the meeting notes."}}
    assert: [{{type: not-contains, value: "zebra"}}]
  - id: loop
    vars: {{session: "user=dan"}}
    turns: [{{query: "Find flights"}}, {{query: "Now book the cheapest"}}, {{query: "Send the mail"}}]
    assert: [{{type: max-length, value: 10000}}]
"""


SUITE = suite()


def wide_suite(ws: Path, n: int, assertions=None) -> list[str]:
    """``assertions/wide.yaml``: n one-turn cases, enough for a paired verdict to decide (the tiny suite's 4
    cases never can). ``assertions(i)`` gives case i's assertions (default: one every answer passes). Returns
    the case ids."""
    lines = [f"suite: wide\nstage: wide\nprompt:\n  - {{role: system, static: true, text: \"{RULES}\"}}\n"
             "  - {role: user, static: false, text: \"{{query}}\"}\ndecoding: {max_tokens: 8}\ncases:"]
    for i in range(n):
        checks = assertions(i) if assertions else [{"type": "max-length", "value": 10000}]
        lines.append(f"  - id: w{i}\n    vars: {{query: \"Request {i}: find item {i * 7 % 13} for user {i}.\"}}\n"
                     f"    assert: {json.dumps(checks)}")
    (ws / "assertions" / "wide.yaml").write_text("\n".join(lines) + "\n")
    return [f"wide/w{i}" for i in range(n)]


def profile(adapter: str, model: Path) -> str:
    return f"adapter: {adapter}\nmodel: {model}\ndtype: float32\ndevice: cpu\nprefill: monolithic\n"


@pytest.fixture
def tiny_ws(workspace, tiny_llama):
    (workspace / "assertions" / "assistant.yaml").unlink()
    (workspace / "assertions" / "tiny.yaml").write_text(SUITE)
    for name, adapter in [("tiny", "torch"), ("tiny_mlx", "mlx"), ("short", "fault_engines:ShortRestore"),
                          ("never", "fault_engines:NeverServes"), ("unstable", "fault_engines:Unstable"), ("half", "fault_engines:HalfServes"),
                          ("uncounted", "fault_engines:Uncounted"), ("warm_off", "fault_engines:WarmBaseline")]:
        (workspace / "engines" / f"{name}.yaml").write_text(profile(adapter, tiny_llama))
    return workspace




def evaluate(run_cli, ws, engine, *extra, operator="ci"):
    """``gatekeeper evaluate --flag prefix_cache`` through the CLI; returns (exit code, JSON)."""
    code, out, _ = run_cli("--workspace", ws, "evaluate", "--flag", "prefix_cache", "--engine", engine,
                           "--operator", operator, *extra, "--json")
    return code, json.loads(out)


def ledger(ws):
    from gatekeeper.ledger import Ledger

    return Ledger(f"sqlite:///{ws / 'ledger' / 'evidence.db'}")


def wait_for_case_results(ws: Path, n: int, timeout: float = 120) -> int:
    """The running evaluation's id once it has recorded ``n`` case results (for tests that interrupt it)."""
    import time

    deadline = time.time() + timeout
    while time.time() < deadline:
        if (ws / "ledger" / "evidence.db").exists():
            with ledger(ws) as lg:
                evs = lg.evaluations()
                if evs and evs[0]["case_results"] >= n:
                    return evs[0]["id"]
        time.sleep(0.2)
    raise AssertionError("the evaluation never got going")
