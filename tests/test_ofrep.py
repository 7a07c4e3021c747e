"""`gatekeeper flags serve` against OpenFeature's own clients: the Python SDK with its OFREP provider, the
JavaScript server SDK with its OFREP provider (and ofrep-core's bulk poll), and a plain HTTP client for the
protocol's edges. One real server, started once, over a workspace whose ledger holds a real PASS on a tiny
model; each test sets the flag state it needs through the real CLI."""

from __future__ import annotations

import http.client
import json
import select
import socket
import sqlite3
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import SUITE, profile
from typer.testing import CliRunner

from gatekeeper.cli import app
from gatekeeper.identity import child_env

DATA = Path(__file__).parent / "data"
GATEKEEPER = Path(sys.executable).with_name("gatekeeper")
OTHER = "kv_small"  # a declared flag that is never flipped: the policy's default


def cli(*args) -> tuple[int, str]:
    result = CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)
    return result.exit_code, result.stdout


def make_workspace(root: Path, model: Path) -> Path:
    """A workspace on the tiny model (its ``auto`` profile too, so serving needs no --engine) with a second flag."""
    from gatekeeper.setup.scaffold import init_workspace

    init_workspace(root)
    policy = root / "policies" / "prefix_cache.yaml"
    policy.write_text("".join(l for l in policy.read_text().splitlines(keepends=True) if not l.startswith("min_power:")))
    (root / "policies" / f"{OTHER}.yaml").write_text(
        f"flag: {OTHER}\ngate: byte_equivalence\nchange: {{profile: {{cache: {{max_entries: 8}}}}}}\n")
    (root / "assertions" / "assistant.yaml").unlink()
    (root / "assertions" / "tiny.yaml").write_text(SUITE)
    for name in ("auto", "tiny"):
        (root / "engines" / f"{name}.yaml").write_text(profile("torch", model))
    return root


def passing(ws: Path) -> int:
    code, out = cli("--workspace", ws, "evaluate", "--flag", "prefix_cache", "--limit", "1", "--operator", "ci", "--json")
    result = json.loads(out)
    assert result["verdict"] == "PASS", result
    return result["evaluation_id"]


def set_state(ws: Path, state: str, evaluation: int) -> None:
    """The flag in ``state``, flipped through the CLI if it is not there already."""
    code, out = cli("--workspace", ws, "status", "--json")
    now = next(f for f in json.loads(out)["flags"] if f["flag"] == "prefix_cache")["state"]
    if now != state:
        extra = ["--evaluation", evaluation] if state == "on" else []
        code, out = cli("--workspace", ws, "flip", "prefix_cache", state, *extra, "--operator", "ops", "--reason", "test", "--json")
        assert code == 0, out


def pipeline_hash(ws: Path) -> str:
    code, out = cli("--workspace", ws, "hash", "--json")
    assert code == 0, out
    return json.loads(out)["pipeline_hash"]


@contextmanager
def tampered(db: Path, sql: str):
    """``sql`` run on the ledger as anyone holding the file can: triggers dropped, the edit made, triggers put back
    as they were. Undone on leaving with ``undo`` the same way, so the ledger verifies again."""
    def edit(statement: str) -> None:
        conn = sqlite3.connect(db, isolation_level=None)
        triggers = conn.execute("SELECT name, sql FROM sqlite_master WHERE type = 'trigger'").fetchall()
        for name, _ in triggers:
            conn.execute(f"DROP TRIGGER {name}")
        conn.execute(statement)
        for _, create in triggers:
            conn.execute(create)
        conn.close()

    before = sqlite3.connect(db).execute("SELECT id, state FROM flip ORDER BY id DESC LIMIT 1").fetchone()
    edit(sql)
    try:
        yield
    finally:
        edit(f"UPDATE flip SET state = '{before[1]}' WHERE id = {before[0]}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``gatekeeper flags serve --json`` as its own process; ``info`` is the JSON line it prints when it listens."""

    def __init__(self, ws: Path, timeout: float = 180):
        port = free_port()
        self.proc = subprocess.Popen([str(GATEKEEPER), "--workspace", str(ws), "flags", "serve", "--listen",
                                      f"127.0.0.1:{port}", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
        deadline = time.time() + timeout
        while not select.select([self.proc.stdout], [], [], 1)[0]:
            if self.proc.poll() is not None or time.time() > deadline:
                self.proc.kill()
                pytest.fail(f"flags serve did not start: {self.proc.stderr.read()}")
        self.info = json.loads(self.proc.stdout.readline())
        self.url, self.port = self.info["url"], port

    def post(self, path: str, body: dict | None = None, headers: dict | None = None):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        conn.request("POST", path, json.dumps(body if body is not None else {}),
                     {"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        data = r.read()
        conn.close()
        return r.status, dict(r.getheaders()), (json.loads(data) if data else None)

    def stop(self) -> int:
        self.proc.terminate()  # SIGTERM: a clean stop
        try:
            return self.proc.wait(30)
        finally:
            self.proc.stdout.close()
            self.proc.stderr.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_llama):
    ws = make_workspace(tmp_path_factory.mktemp("ofrep") / "ws", tiny_llama)
    eid = passing(ws)
    set_state(ws, "on", eid)
    server = Server(ws)
    yield {"ws": ws, "eid": eid, "server": server, "db": ws / "ledger" / "evidence.db"}
    assert server.stop() == 0, "flags serve did not exit cleanly on SIGTERM"


@pytest.fixture
def client(served):
    from openfeature import api
    from openfeature.contrib.provider.ofrep import OFREPProvider

    api.set_provider_and_wait(OFREPProvider(served["server"].url), "ofrep-test")
    yield api.get_client("ofrep-test")
    api.clear_providers()


def js(served, *flags: str) -> dict:
    """tests/data/ofrep_client.cjs under node, with the packages `make openfeature-js` installs."""
    from gatekeeper.setup import openfeature_js

    assert openfeature_js.installed(), "the OpenFeature JavaScript clients are not installed: run 'make openfeature-js'"
    env = child_env(NODE_PATH=str(openfeature_js.root() / "node_modules"))
    out = subprocess.run([str(openfeature_js.node()), str(DATA / "ofrep_client.cjs"), served["server"].url, *flags],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_python_client_reads_values_reasons_and_metadata(served, client):
    ws, eid = served["ws"], served["eid"]
    set_state(ws, "on", eid)
    on = client.get_boolean_details("prefix_cache", False)
    assert (on.value, on.variant, on.reason, on.error_code) == (True, "on", "STATIC", None)
    assert on.flag_metadata["evaluationId"] == eid and on.flag_metadata["pipelineHash"] == pipeline_hash(ws)
    other = client.get_boolean_details(OTHER, True)
    assert (other.value, other.variant, other.reason, other.error_code) == (False, "off", "DEFAULT", None)
    assert "evaluationId" not in other.flag_metadata and other.flag_metadata["pipelineHash"] == pipeline_hash(ws)
    assert served["server"].info["flags"] == sorted(["prefix_cache", OTHER]) and served["server"].info["error"] is None


def test_unknown_flag_and_other_types(served, client):
    missing = client.get_boolean_details("no_such_flag", True)
    assert (missing.value, missing.error_code, missing.reason) == (True, "FLAG_NOT_FOUND", "ERROR")
    assert "no_such_flag" in missing.error_message
    status, _, body = served["server"].post("/ofrep/v1/evaluate/flags/no_such_flag")
    assert status == 404 and body["errorCode"] == "FLAG_NOT_FOUND" and body["key"] == "no_such_flag"
    as_string = client.get_string_details("prefix_cache", "fallback")  # OFREP has no types: the client checks
    assert (as_string.value, as_string.error_code) == ("fallback", "TYPE_MISMATCH")


def test_bad_requests_get_protocol_errors(served):
    server = served["server"]
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("POST", "/ofrep/v1/evaluate/flags/prefix_cache", "{not json", {"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 400 and json.loads(r.read())["errorCode"] == "PARSE_ERROR"
    status, _, body = server.post("/ofrep/v1/evaluate/flags", {"context": ["not", "an", "object"]})
    assert status == 400 and body["errorCode"] == "INVALID_CONTEXT"
    status, _, body = server.post("/ofrep/v1/evaluate/flags/prefix_cache", {"context": {"targetingKey": "a", "tier": 3}})
    assert status == 200 and body["key"] == "prefix_cache"


def test_bulk_poll_is_304_until_a_flip_changes_it(served, client):
    ws, eid, server = served["ws"], served["eid"], served["server"]
    set_state(ws, "on", eid)
    status, headers, body = server.post("/ofrep/v1/evaluate/flags")
    etag = headers["ETag"]
    assert status == 200 and {f["key"]: f["value"] for f in body["flags"]} == {"prefix_cache": True, OTHER: False}
    for tag in (etag, f"W/{etag}", f'"other", {etag}'):
        status, headers, body = server.post("/ofrep/v1/evaluate/flags", headers={"If-None-Match": tag})
        assert (status, headers["ETag"], body) == (304, etag, None)
    on_hash = client.get_boolean_details("prefix_cache", False).flag_metadata["pipelineHash"]

    set_state(ws, "off", eid)  # while the server runs
    status, headers, body = server.post("/ofrep/v1/evaluate/flags", headers={"If-None-Match": etag})
    assert status == 200 and headers["ETag"] != etag
    assert {f["key"]: (f["value"], f["reason"]) for f in body["flags"]} == {"prefix_cache": (False, "STATIC"),
                                                                           OTHER: (False, "DEFAULT")}
    off = client.get_boolean_details("prefix_cache", True)
    assert (off.value, off.variant, off.reason) == (False, "off", "STATIC")
    assert off.flag_metadata["pipelineHash"] != on_hash  # the pipeline-version hash changes on every flip

    set_state(ws, "on", eid)
    assert client.get_boolean_details("prefix_cache", False).value is True


def test_javascript_clients(served):
    ws, eid = served["ws"], served["eid"]
    set_state(ws, "on", eid)
    out = js(served, "prefix_cache", OTHER, "no_such_flag")
    on = out["flags"]["prefix_cache"]["boolean"]
    assert (on["value"], on["variant"], on["reason"], on.get("errorCode")) == (True, "on", "STATIC", None)
    assert on["flagMetadata"] == {"evaluationId": eid, "pipelineHash": pipeline_hash(ws),
                                  "flippedAt": on["flagMetadata"]["flippedAt"]}
    other = out["flags"][OTHER]["boolean"]
    assert (other["value"], other["variant"], other["reason"]) == (False, "off", "DEFAULT")
    missing = out["flags"]["no_such_flag"]["boolean"]
    assert (missing["value"], missing["errorCode"]) == (False, "FLAG_NOT_FOUND")
    assert out["flags"]["prefix_cache"]["string"]["errorCode"] == "TYPE_MISMATCH"
    bulk = out["bulk"]
    assert (bulk["first"], bulk["second"]) == (200, 304) and bulk["etag"]
    assert {f["key"]: f["value"] for f in bulk["flags"]["flags"]} == {"prefix_cache": True, OTHER: False}

    set_state(ws, "off", eid)  # flipped while the server runs: the JavaScript client sees it
    after = js(served, "prefix_cache")
    assert (after["flags"]["prefix_cache"]["boolean"]["value"], after["flags"]["prefix_cache"]["boolean"]["variant"]) == (False, "off")
    assert after["bulk"]["etag"] != bulk["etag"]


def test_tampered_ledger_is_an_error_for_every_client_never_on(served, client):
    ws, eid, server = served["ws"], served["eid"], served["server"]
    set_state(ws, "off", eid)
    _, headers, _ = server.post("/ofrep/v1/evaluate/flags")
    etag = headers["ETag"]
    # The attack: the latest flip, "off", edited to "on" in place.
    with tampered(served["db"], "UPDATE flip SET state = 'on' WHERE id = (SELECT max(id) FROM flip)"):
        details = client.get_boolean_details("prefix_cache", False)
        assert (details.value, details.error_code, details.reason) == (False, "GENERAL", "ERROR")
        assert "does not verify" in details.error_message
        status, _, body = server.post("/ofrep/v1/evaluate/flags/prefix_cache")
        assert status == 500 and body["errorCode"] == "GENERAL" and "ledger verify" in body["errorDetails"]
        status, _, body = server.post("/ofrep/v1/evaluate/flags", headers={"If-None-Match": etag})  # never a 304
        assert status == 500 and body["errorCode"] == "GENERAL" and "value" not in json.dumps(body)
        out = js(served, "prefix_cache", OTHER)
        for flag in ("prefix_cache", OTHER):
            d = out["flags"][flag]["boolean"]
            assert (d["value"], d["errorCode"], d["reason"]) == (False, "GENERAL", "ERROR")
        assert out["bulk"]["first"] == 500 and out["bulk"]["second"] == 500
    # Put back as it was, the ledger verifies and is served again.
    restored = client.get_boolean_details("prefix_cache", True)
    assert (restored.value, restored.error_code) == (False, None)


def test_in_process_provider_answers_as_the_server(served, client):
    from openfeature import api

    from gatekeeper.openfeature import GatekeeperProvider

    ws, eid = served["ws"], served["eid"]
    set_state(ws, "on", eid)
    api.set_provider_and_wait(GatekeeperProvider(workspace=ws), "in-process")
    local = api.get_client("in-process")
    for flag in ("prefix_cache", OTHER, "no_such_flag"):
        remote, here = client.get_boolean_details(flag, False), local.get_boolean_details(flag, False)
        assert (here.value, here.variant, here.reason, here.error_code, dict(here.flag_metadata)) == \
               (remote.value, remote.variant, remote.reason, remote.error_code, dict(remote.flag_metadata)), flag


def test_serve_refuses_a_port_in_use_and_a_missing_workspace(served, tmp_path):
    code, out = cli("--workspace", served["ws"], "flags", "serve", "--listen", f"127.0.0.1:{served['server'].port}", "--json")
    assert code == 2 and "cannot listen" in json.loads(out)["error"]
    code, out = cli("--workspace", tmp_path / "nowhere", "flags", "serve", "--json")
    assert code == 2 and "not a directory" in json.loads(out)["error"]
    code, out = cli("--workspace", served["ws"], "flags", "serve", "--listen", "nope", "--json")
    assert code == 2 and "--listen" in json.loads(out)["error"]
