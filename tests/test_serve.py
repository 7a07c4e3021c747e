"""Servers gatekeeper starts from a profile's ``serve`` command: a real llama-server on a port gatekeeper picks,
evaluated, then stopped (after a finished run and after an interrupted one); a server that never becomes ready is
exit 2 naming its command and last output; the port never enters the identity, so evidence stays fresh."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from conftest import ledger, wait_for_case_results, wide_suite
from served import evaluate, served_ws, threads

from gatekeeper.errors import GatekeeperError
from gatekeeper.identity import child_env
from gatekeeper.workspace import Workspace

TESTS = Path(__file__).resolve().parent


def running(marker: str) -> list[int]:
    """The processes whose command line holds ``marker``."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker in (proc / "cmdline").read_bytes().decode(errors="replace"):
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def llama_command(marker: str, *extra: str) -> str:
    """A llama-server command line (the default model's GGUF, flash attention off: exact reuse) as YAML."""
    from gatekeeper.setup.llama_build import build_server
    from gatekeeper.setup.models import find_gguf

    return json.dumps([str(build_server()), "-m", str(find_gguf()), "--host", "{host}", "--port", "{port}", "-np", "1",
                       "-c", "4096", "-t", str(threads()), "-fa", "off", "--alias", marker, *extra])


def llama_serve(marker: str) -> str:
    """A profile whose llama-server gatekeeper starts."""
    return ("adapter: http\ncache_switch: cache_prompt\ntimeout: 600\n"
            f"serve: {{command: {llama_command(marker)}, ready: /health}}\n")


@pytest.mark.parametrize("body, field", [
    ("adapter: http\nserve: {command: llama-server -m m.gguf}\n", "never says '{port}'"),
    ("adapter: http\nurl: http://127.0.0.1:8080\nserve: {command: 'llama-server --port {port}'}\n", "remove 'url'"),
    ("adapter: torch\nserve: {command: 'llama-server --port {port}'}\n", "only a served engine"),
    ("adapter: http\nserve: {command: 'llama-server --port {port}', ready: health}\n", "is no path"),
    ("adapter: http\nserve: {command: []}\n", "an empty command"),
])
def test_bad_serve_fields_name_the_file_and_field(workspace, body, field):
    (workspace / "engines" / "bad.yaml").write_text(body)
    with pytest.raises(GatekeeperError) as err:
        Workspace(workspace).engine("bad")
    assert "engines/bad.yaml: invalid" in str(err.value) and field in str(err.value)


@pytest.mark.parametrize("script, timeout, says", [
    ("print('loading weights', flush=True); print('error: weights not found', flush=True); raise SystemExit(3)", 60,
     "exited with status 3 before it was ready"),
    ("import time; print('still loading', flush=True); time.sleep(120)", 1.5, "was not ready within 1.5 s"),
])
def test_a_server_that_never_becomes_ready_is_exit_2_naming_its_command_and_output(workspace, run_cli, script, timeout, says):
    marker = f"gk-{uuid.uuid4().hex}"
    command = [sys.executable, "-c", script, "{port}", marker]
    ws = served_ws(workspace, late=f"adapter: http\ncache_switch: cache_prompt\n"
                                   f"serve: {{command: {json.dumps(command)}, timeout: {timeout}}}\n")
    code, out = evaluate(run_cli, ws, "late")
    assert code == 2, out
    assert says in out["error"] and "engines/late.yaml: field 'serve'" in out["error"] and marker in out["error"]
    assert ("error: weights not found" if "SystemExit" in script else "still loading") in out["error"]
    assert not running(marker)  # stopped, not left behind
    assert not (ws / "ledger" / "evidence.db").exists() or ledger(ws).evaluations() == []


def test_one_command_for_both_sides_of_prefix_cache_without_a_switch_is_exit_2(workspace, run_cli):
    ws = served_ws(workspace, one=f"adapter: http\nserve: {{command: {json.dumps([sys.executable, '-c', 'pass', '{port}'])}}}\n")
    code, out = evaluate(run_cli, ws, "one")
    assert code == 2 and "'serve_on'" in out["error"] and "cache_switch" in out["error"], out


def test_a_change_of_serve_on_alone_never_reaches_the_flag_on_side(workspace, run_cli):
    ws = served_ws(workspace, srv=f"adapter: http\nserve: {{command: {json.dumps([sys.executable, '-c', 'pass', '{port}'])}}}\n")
    (ws / "policies" / "upgrade.yaml").write_text(
        "flag: upgrade\ngate: byte_equivalence\nchange: {profile: {serve_on: {command: 'new-server --port {port}'}}}\n")
    code, out, _ = run_cli("--workspace", ws, "evaluate", "--flag", "upgrade", "--engine", "srv", "--json")
    out = json.loads(out)
    assert code == 2 and "field 'change.profile.serve_on'" in out["error"] and "{profile: {serve:" in out["error"], out


@pytest.mark.slow
def test_a_started_llama_server_is_evaluated_then_stopped_and_its_port_is_no_part_of_the_identity(workspace, run_cli):
    marker = f"gk-{uuid.uuid4().hex}"
    ws = served_ws(workspace, started=llama_serve(marker))
    results = []
    for _ in range(2):  # one case: the subject is the server's life and identity, not the battery
        code, out = evaluate(run_cli, ws, "started", "--limit", "1")
        assert code == 0 and out["verdict"] == "PASS", out
        assert not running(marker)  # stopped once the run is over
        results.append(out)
    assert out["tokens"]["cached_on"] > 0
    with ledger(ws) as lg:
        assert lg.verify().ok
        first, second = (lg.evaluation(o["evaluation_id"]) for o in results)
    ident = second["identity"]["off"]
    assert ident["engine"]["servers"]["off"]["url"] == "serve" and ident["reaches"] == ["serve"]
    assert ident["profile"]["serve"]["command"][-2:] == ["--alias", marker]
    assert ident == first["identity"]["off"]  # a new port each run, the same identity: the evidence stays fresh
    ports = {o["reached"]["off"][0] for o in results}
    assert len(ports) == 2 and all(p.startswith("http://127.0.0.1:") for p in ports)
    code, out, _ = run_cli("--workspace", ws, "status", "--json")
    assert code == 0 and not running(marker), out


@pytest.mark.slow
def test_two_started_servers_are_the_two_sides_of_a_declared_change(workspace, run_cli):
    """The flag-on side started from another command (here the same build at another RoPE scale, a server that
    answers differently): both started, compared, a FAIL, both stopped."""
    marker = f"gk-{uuid.uuid4().hex}"
    ws = served_ws(workspace, started=llama_serve(marker))
    changed = llama_command(marker, "--rope-freq-scale", "0.5")
    (ws / "policies" / "upgrade.yaml").write_text(
        f"flag: upgrade\ngate: byte_equivalence\nprobes: off\ndistance: false\n"
        f"change: {{profile: {{serve: {{command: {changed}, ready: /health}}}}}}\n")
    code, out, _ = run_cli("--workspace", ws, "evaluate", "--flag", "upgrade", "--engine", "started", "--limit", "2",
                           "--json")
    out = json.loads(out)
    assert code == 1 and out["verdict"] == "FAIL" and out["differing_cases"], out
    assert out["reached"]["off"] != out["reached"]["on"] and not running(marker)
    with ledger(ws) as lg:
        ident = lg.evaluation(out["evaluation_id"])["identity"]
    assert "--rope-freq-scale" in ident["on"]["profile"]["serve"]["command"]
    assert "--rope-freq-scale" not in ident["off"]["profile"]["serve"]["command"]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL])
def test_an_interrupted_run_stops_its_server_and_leaves_the_ledger_valid(workspace, sig):
    marker = f"gk-{uuid.uuid4().hex}"
    ws = served_ws(workspace, started=llama_serve(marker))
    wide_suite(ws, 40)
    proc = subprocess.Popen(
        [sys.executable, "-m", "gatekeeper.cli", "--workspace", str(ws), "evaluate", "--flag", "prefix_cache",
         "--engine", "started", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env=child_env(PYTHONPATH=str(TESTS)),
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # a background job's child ignores SIGINT
    try:
        eid = wait_for_case_results(ws, 2, timeout=300)
        assert running(marker)
        proc.send_signal(sig)
        assert proc.wait(timeout=60) != 0
    finally:
        proc.kill()
    deadline = time.monotonic() + 20  # SIGKILL: the server is told by the kernel (parent death signal)
    while running(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not running(marker)
    with ledger(ws) as lg:
        assert lg.evaluation(eid)["status"] == "aborted" and lg.verify().ok
