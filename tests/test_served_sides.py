"""The two sides of a served evaluation are the servers the flag says, checked before anything is written;
a server that crashes mid-request is a crash on its side, never "cannot connect" and never a PASS; figures
and logprob shapes a server gets wrong are named. Real llama-servers on loopback, with a front where a
server must misbehave."""

from __future__ import annotations

import json

import pytest
from cache_fronts import cache_front
from conftest import ledger
from served import llama_server, served_ws

from gatekeeper.setup.models import find_gguf

pytestmark = pytest.mark.slow

EXACT = ("-fa", "off")


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="module")
def server(logs):
    with llama_server(find_gguf(), *EXACT, log=logs / "off.log") as url:
        yield url


@pytest.fixture(scope="module")
def release(logs):
    """Another deployment of the same model (a different RoPE scale: it answers differently), with its own log."""
    with llama_server(find_gguf(), *EXACT, "--rope-freq-scale", "0.5", log=logs / "on.log") as url:
        yield url


def cli(run_cli, ws, flag, engine="served"):
    code, out, _ = run_cli("--workspace", ws, "evaluate", "--flag", flag, "--engine", engine, "--operator", "ci", "--json")
    return code, json.loads(out)


def upgrade(ws, change: str) -> None:
    # which server each side reaches is the subject here; the distance is tested in test_engine_http.py
    (ws / "policies" / "upgrade.yaml").write_text(f"flag: upgrade\ngate: byte_equivalence\nprobes: off\ndistance: false\n"
                                                  f"change: {change}\n")


def requests_in(log) -> int:
    """Completions a llama-server ran, as its own log tells (a slot launched per completion)."""
    return log.read_text(errors="replace").count("launch_slot_")


def test_a_change_written_as_url_on_is_refused_and_writes_nothing(server, release, workspace, run_cli):
    ws = served_ws(workspace, served=f"adapter: http\nurl: {server}\ntimeout: 600\n")
    upgrade(ws, f"{{profile: {{url_on: {release}}}}}")
    code, out = cli(run_cli, ws, "upgrade")
    assert code == 2, out
    assert "policies/upgrade.yaml: field 'change.profile.url_on'" in out["error"]
    assert f"change: {{profile: {{url: {release}}}}}" in out["error"]  # the form that works
    assert not (ws / "ledger" / "evidence.db").exists()


def test_a_change_to_the_same_server_by_another_name_is_refused(server, workspace, run_cli):
    ws = served_ws(workspace, served=f"adapter: http\nurl: {server}\ntimeout: 600\n")
    upgrade(ws, f"{{profile: {{url: {server.replace('127.0.0.1', 'localhost')}/}}}}")
    code, out = cli(run_cli, ws, "upgrade")
    assert code == 2 and "field 'change.profile.url'" in out["error"] and "compare that server with itself" in out["error"]
    assert not (ws / "ledger" / "evidence.db").exists()


def test_the_documented_change_reaches_the_flag_on_server(server, release, logs, workspace, run_cli):
    ws = served_ws(workspace, served=f"adapter: http\nurl: {server}\ntimeout: 600\n")  # no url_on, no cache_switch
    upgrade(ws, f"{{profile: {{url: {release}}}}}")
    before = requests_in(logs / "on.log")
    code, out = cli(run_cli, ws, "upgrade")
    assert (code, out["verdict"]) == (1, "FAIL"), out  # another RoPE scale answers differently
    assert requests_in(logs / "on.log") - before >= out["cases"]  # the flag-on server's own log saw the cases
    assert out["reached"] == {"off": [server], "on": [release]}
    with ledger(ws) as lg:
        ev = lg.evaluation(out["evaluation_id"])
    assert ev["identity"]["off"]["reaches"] == [server] and ev["identity"]["on"]["reaches"] == [release]
    turns = {r["config"]: {t["replica"] for t in r["result"]["turns"]} for r in ev["case_results"]}
    assert turns == {"off": {server}, "on": {release}}


def test_prefix_cache_on_one_server_without_a_switch_is_refused(server, workspace, run_cli):
    ws = served_ws(workspace, served=f"adapter: http\nurl: {server}\n")
    code, out = cli(run_cli, ws, "prefix_cache")
    assert code == 2 and "engines/served.yaml" in out["error"] and "'url_on'" in out["error"] and "'cache_switch'" in out["error"]


def test_a_dropped_connection_on_the_flag_on_side_is_a_named_crash(server, workspace, run_cli):
    with cache_front(server, "drop") as (front, _):
        ws = served_ws(workspace, served=f"adapter: http\nurl: {server}\nurl_on: {front}\ncache_switch: cache_prompt\ntimeout: 600\n")
        code, out = cli(run_cli, ws, "prefix_cache")
    assert (code, out["verdict"]) == (1, "FAIL"), out
    assert out["reasons"][0].startswith("crashed: tiny/a on the flag-on side (on#0, turn 1): ")
    assert f"{front}/v1/completions" in out["reasons"][0] and "closed the connection without an answer" in out["reasons"][0]
    assert "cannot connect" not in json.dumps(out)
    with ledger(ws) as lg:
        assert lg.verify().ok
        ev = lg.evaluation(out["evaluation_id"])
    crashed = [r for r in ev["case_results"] if r["result"].get("crash")]
    assert crashed and {r["config"] for r in crashed} == {"on"}
    assert crashed[0]["result"]["crash"]["request"]["prompt_tokens"] > 0


def test_a_dropped_connection_on_the_flag_off_side_is_inconclusive(server, workspace, run_cli):
    with cache_front(server, "drop") as (front, _):
        ws = served_ws(workspace, served=f"adapter: http\nurl: {front}\nurl_on: {server}\ncache_switch: cache_prompt\ntimeout: 600\n")
        code, out = cli(run_cli, ws, "prefix_cache")
    assert (code, out["verdict"]) == (1, "INCONCLUSIVE"), out
    assert out["reasons"][0].startswith("crashed: tiny/a on the flag-off side")
    assert any("it is no baseline" in r for r in out["reasons"])


def test_figures_a_server_gets_wrong_are_named(server, workspace, run_cli):
    with cache_front(server, "suffix_count") as (front, _):
        ws = served_ws(workspace, served=f"adapter: http\nurl: {server}\nurl_on: {front}\ncache_switch: cache_prompt\ntimeout: 600\n")
        code, out = cli(run_cli, ws, "prefix_cache")
    suspect = [r for r in out["reasons"] if r.startswith("telemetry_suspect:")]
    assert suspect and front in suspect[0], out["reasons"]
    assert code == 0 and out["verdict"] == "PASS"  # the outputs are right; the count is not taken as the prompt size
    with ledger(ws) as lg:
        ev = lg.evaluation(out["evaluation_id"])
    sizes = {r["config"]: [t["prompt_tokens"] for t in r["result"]["turns"]] for r in ev["case_results"] if r["repeat"] == 0}
    assert sizes["on"] == sizes["off"]

    with cache_front(server, "odd_logprobs") as (front, _):
        (ws / "engines" / "served.yaml").write_text(
            f"adapter: http\nurl: {server}\nurl_on: {front}\ncache_switch: cache_prompt\ntimeout: 600\n")
        code, out = cli(run_cli, ws, "prefix_cache")
    odd = [r for r in out["reasons"] if r.startswith("not_observable: top-2 logprobs")]
    assert odd and "dialect llamacpp" in odd[0] and front in odd[0], out["reasons"]


@pytest.mark.parametrize("warm_up", [True, False])
def test_warm_ups_end_as_the_cases_do_or_are_left_out(server, workspace, run_cli, warm_up):
    with cache_front(server, "none") as (front, history):
        ws = served_ws(workspace, served=f"adapter: http\nurl: {server}\nurl_on: {front}\ncache_switch: cache_prompt\n"
                                         f"timeout: 600\nwarm_up: {str(warm_up).lower()}\n")
        code, out = cli(run_cli, ws, "prefix_cache")
    assert code in (0, 1), out
    turns = 1 + 1 + 1 + 3  # the tiny suite's cases: a, b, c, and loop's three turns
    assert len(history.seen) == turns + (1 if warm_up else 0)  # one stage: one warm-up of its static prefix
    assert set(history.max_tokens) == {12}  # the suite's max_tokens, the warm-up's too (never cut at one token)
