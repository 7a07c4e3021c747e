"""Long commands show life in a log: where stderr is not a terminal, a line per stage and at most one every 30
seconds (what runs, done of total, elapsed, the rest); nothing under --json."""

import io
import json
import re
import subprocess
import sys
import time

from conftest import ROOT, read_reference

from gatekeeper.cli.progress import LogLines, clock
from gatekeeper.identity import child_env


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_a_line_per_stage_and_at_most_one_every_30_seconds_within_one():
    out, now = io.StringIO(), Clock()
    with LogLines("evaluate", 6, stream=out, now=now) as advance:
        for label in ("off#0 a", "off#0 b", "off#0 c"):
            now.t += 4
            advance(label)
        now.t += 31
        advance("off#0 d")  # 30 s since the last line: a line, though the stage is the same
        now.t += 2
        advance("on#0 a")  # a new stage: a line at once
        now.t += 2
        advance("on#0 b")
    lines = out.getvalue().splitlines()
    assert lines == ["evaluate: starting (0/6 done), 0s elapsed",
                     "evaluate: off#0 a (1/6 done), 4s elapsed, about 20s left",
                     "evaluate: off#0 d (4/6 done), 43s elapsed, about 22s left",
                     "evaluate: on#0 a (5/6 done), 45s elapsed, about 9s left",
                     "evaluate: finished in 47s"]


def test_a_heartbeat_while_one_step_runs_long_and_a_stop_says_where():
    out = io.StringIO()
    try:
        with LogLines("runtime prepare x", 2, stream=out, every=0.2, label="installing torch") as step:
            time.sleep(0.7)  # no step finishes: the heartbeat still writes
            step("installing transformers")
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        pass
    lines = out.getvalue().splitlines()
    assert sum(line.startswith("runtime prepare x: installing torch (0/2 done)") for line in lines) >= 2, lines
    assert lines[-1].startswith("runtime prepare x: stopped after installing transformers (1/2 done)"), lines
    assert clock(3725) == "1h 02m" and clock(65) == "1m 05s" and clock(7.4) == "7s"


def test_evaluate_through_a_pipe_prints_its_stage_lines(tiny_ws):
    """The real command as CI runs it: stdout and stderr pipes, a line for each configuration and repeat."""
    read_reference(tiny_ws)
    env = child_env(PYTHONPATH=str(ROOT))
    args = [sys.executable, "-m", "gatekeeper.cli", "--workspace", str(tiny_ws), "evaluate", "--flag", "prefix_cache",
            "--engine", "tiny", "--operator", "ci", "--limit", "2"]
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("evaluate: ")]
    stages = [m.group(1) for line in lines if (m := re.match(r"evaluate: (\S+) \S+ \(\d+/8 done\)", line))]
    assert stages == ["off#0", "off#1", "on#0", "reference"], lines
    assert lines[0] == "evaluate: starting (0/8 done), 0s elapsed" and lines[-1].startswith("evaluate: finished in ")
    assert "PASS" in done.stdout and "evaluate:" not in done.stdout  # stdout keeps the result alone
    quiet = subprocess.run(args + ["--json"], capture_output=True, text=True, env=env, timeout=600)
    assert json.loads(quiet.stdout)["verdict"] == "PASS" and "evaluate:" not in quiet.stderr
