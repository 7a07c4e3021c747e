"""``calibrate --twin``: a served evaluation (a real llama-server on loopback, the default model's GGUF)
calibrated through an in-process engine on the same weights, checked by digest; refused, with nothing
written, when the twin's weights are another model's."""

from __future__ import annotations

import json

import pytest
from conftest import ledger
from served import evaluate, llama_server, served_ws

from gatekeeper.gate.state import flags
from gatekeeper.identity import file_digest
from gatekeeper.setup.models import find_gguf, prepare_default_model
from gatekeeper.workspace import MinPower

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # Flash attention off, as in test_engine_http: the cache hit is then exact on this battery.
    with llama_server(find_gguf(), "-fa", "off", log=tmp_path_factory.mktemp("logs") / "server.log") as url:
        yield url


@pytest.fixture
def served(server, workspace, tiny_llama):
    prepare_default_model()
    ws = served_ws(workspace,
                   served=f"adapter: http\nurl: {server}\ncache_switch: cache_prompt\ntimeout: 600\n",
                   gguf="adapter: llamacpp\nmodel: default\noptions: {n_threads: 1}\n",
                   hf="adapter: torch\nmodel: default\ndtype: float32\ndevice: cpu\n",
                   other=f"adapter: torch\nmodel: {tiny_llama}\ndtype: float32\ndevice: cpu\n")
    return ws


def calibrate(run_cli, ws, *extra):
    code, out, _ = run_cli("--workspace", ws, "calibrate", *extra, "--operator", "cal", "--json")
    return code, json.loads(out)


def served_evaluation(run_cli, ws) -> int:
    code, out = evaluate(run_cli, ws, "served", "--limit", "1")
    assert code == 0 and out["verdict"] == "PASS", out
    return out["evaluation_id"]


def test_a_served_evaluation_is_calibrated_through_its_twins(run_cli, served):
    eid = served_evaluation(run_cli, served)
    gguf = file_digest(find_gguf())
    # The llamacpp twin loads the very GGUF the server does.
    code, result = calibrate(run_cli, served, "--evaluation", eid, "--twin", "gguf")
    assert code == 0, result
    assert result["twin"]["engine"] == "gguf" and result["twin"]["served"][0]["digest"] == gguf
    rows = {r["spec"]: r for r in result["faults"]}
    assert rows["shift"]["supported"] and rows["shift"]["flagged"] == 1 and not rows["noise:0.1"]["supported"]
    # The torch twin loads the folder `models prepare` converted from that GGUF: it counts as the same weights.
    code, result = calibrate(run_cli, served, "--evaluation", eid, "--twin", "hf")
    assert code == 0, result
    assert gguf in result["twin"]["digests"] and result["engine"] == "hf"
    rows = {r["spec"]: r for r in result["faults"]}
    assert rows["noise:0"]["flagged"] == 0 and rows["noise:0.1"]["share"] == 1.0
    with ledger(served) as lg:
        cals = lg.calibrations(eid)
        assert [c["result"]["twin"]["engine"] for c in cals] == ["gguf", "hf"] and lg.verify().ok
    # min_power takes a twin's calibration as the served evaluation's, and the review says where it was measured.
    assert flags.power_problems(MinPower(noise=0.1, share=1.0), "prefix_cache", eid, cals) == []
    code, md, _ = run_cli("--workspace", served, "ledger", "export", eid, "--format", "md")
    assert md.count("measured on the twin") == 2


def test_a_twin_on_other_weights_is_refused_and_nothing_is_written(run_cli, served):
    eid = served_evaluation(run_cli, served)
    code, out = calibrate(run_cli, served, "--evaluation", eid, "--twin", "other")
    assert code == 2, out
    msg = out["error"]
    assert msg.startswith("--twin other: its weights") and "are not the served deployment's" in msg
    assert file_digest(find_gguf())[:16] in msg and str(find_gguf()) in msg
    code, out = calibrate(run_cli, served, "--twin", "gguf")
    assert code == 2 and "add --evaluation ID" in out["error"]
    with ledger(served) as lg:
        assert lg.calibrations(eid) == []
