"""``gatekeeper review``: every page and its JSON on a ledger real evaluations made (SQLite and a real PostgreSQL
server), the workstation safeguards (Host, Origin, methods, CSP, loopback), hostile text shown as text, a tampered
ledger in red on every page, and nothing under the workspace changed while it runs."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import sqlite3
import subprocess
import sys
import time
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import quote

import pytest
from review_ledger import HOSTILE, OPERATOR, REASON, build, cli, get, review
from trust import keys  # noqa: F401  (fixture)

from gatekeeper.review.app import CSP

pytest_plugins = ["postgres"]


@pytest.fixture(scope="module")
def made(tmp_path_factory, tiny_llama, keys):  # noqa: F811
    root = tmp_path_factory.mktemp("review") / "ws"
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("GATEKEEPER_WORKSPACE", raising=False)
        mp.delenv("GATEKEEPER_SIGNING_KEY", raising=False)
        ids = build(root, tiny_llama, keys["ana"])
    return root, ids


@pytest.fixture(scope="module")
def url(made):
    with review(made[0]) as u:
        yield u


def page(url: str, path: str) -> str:
    status, headers, body = get(url + path)
    assert status == 200, (path, body[:500])
    assert headers["Content-Security-Policy"] == CSP
    return body


def data(url: str, path: str) -> dict:
    status, headers, body = get(url + path)
    assert status == 200 and headers["Content-Type"].startswith("application/json"), (path, body[:500])
    return json.loads(body)


def differing(record: dict) -> dict:
    """A case whose outputs part after a few shared steps, so it has drift to draw."""
    parted = [c for c in record["cases"] if c["status"] == "differs" and c["where"].startswith("turn")]
    return max(parted, key=lambda c: int(re.search(r"position (\d+)", c["where"]).group(1)))


def test_every_page_and_its_json_on_a_real_ledger(made, url):
    ws, ids = made
    with_ledger = lambda *a: cli(ws, *a)[1]  # noqa: E731

    flags = data(url, "/flags.json")
    (flag,) = flags["flags"]
    assert flag["flag"] == "prefix_cache" and flag["state"] == "on" and flag["evaluation_id"] == ids["pass"]
    assert flag["safely_on"] and flag["evidence_current"] and flags["integrity"]["ok"]
    assert flag["pipeline_hash"] == with_ledger("hash", "--engine", "tiny")["pipeline_hash"]
    assert "ON" in page(url, "/flags") and f'href="/evaluations/{ids["pass"]}"' in page(url, "/flags")

    listed = data(url, "/evaluations.json")
    assert [r["id"] for r in listed["rows"]] == sorted(ids.values(), reverse=True) and listed["total"] == 5
    assert {r["id"]: r["status"] for r in listed["rows"] if r["flag"] == "prefix_cache"} == {
        ids["pass"]: "PASS", ids["fail"]: "FAIL", ids["inconclusive"]: "INCONCLUSIVE", ids["hostile"]: "FAIL"}
    power = next(r for r in listed["rows"] if r["id"] == ids["pass"])["power"]
    assert power["calibrations"] == 1 and 0 <= power["share"] <= 1
    assert [r["id"] for r in data(url, "/evaluations.json?verdict=FAIL&flag=prefix_cache")["rows"]] == [ids["hostile"], ids["fail"]]
    assert data(url, "/evaluations.json?flag=static_first")["rows"] == []
    assert data(url, "/evaluations.json?since=2999-01-01")["total"] == 0

    # One evaluation: the planted FAIL, its cases under each filter, its differing case's first divergence as recorded.
    with_record = with_ledger("ledger", "show", ids["fail"])
    ev = data(url, f"/evaluations/{ids['fail']}.json")
    assert ev["verdict"] == "FAIL" and ev["reasons"] == with_record["reasons"]
    recorded = [c for c in with_record["comparisons"] if not c["equal"]]
    assert ev["case_counts"]["differs"] == len({c["case_id"] for c in recorded}) > 0
    assert {c["case_id"] for c in data(url, f"/evaluations/{ids['fail']}.json?cases=differs")["cases"]} == \
        {c["case_id"] for c in recorded}
    assert get(url + f"/evaluations/{ids['fail']}?cases=bogus")[0] == 400
    html = page(url, f"/evaluations/{ids['fail']}")
    assert "<svg" in html and "Tokens per stage" in html and "FAIL" in html

    case = differing(ev)
    detail = next(c["detail"] for c in recorded if c["case_id"] == case["case_id"])
    shown = data(url, case["href"] + ".json")
    (where,) = shown["divergences"]
    assert (where["turn"], where["first_divergent_position"]) == (detail["turn"], detail["first_divergent_position"])
    assert (where["a"]["token"], where["b"]["token"]) == (detail["a"]["token"], detail["b"]["token"])
    turn = shown["turns"][detail["turn"] - 1]
    first = next(r for r in turn["tokens"] if r["differs"])
    assert first["position"] == detail["first_divergent_position"]
    assert (first["off"], first["on"]) == (detail["a"]["token"], detail["b"]["token"])
    assert (first["off_piece"], first["on_piece"]) == (detail["a"]["piece"], detail["b"]["piece"])  # the model's tokenizer
    assert shown["drift"] and all(p["drift"] >= 0 for p in shown["drift"])
    case_html = page(url, case["href"])
    assert f'<strong class="position">{detail["first_divergent_position"]}</strong>' in case_html
    assert "Drift per step" in case_html and "<polyline" in case_html

    # The PASS: its calibration's detection curve, and the signed flip with the signer's fingerprint.
    passed = data(url, f"/evaluations/{ids['pass']}.json")
    assert len(passed["calibrations"]) == 1 and passed["calibrations"][0]["faults"]
    (flip,) = passed["flips"]
    assert flip["signer"] == "ana" and flip["state"] == "on"  # its fingerprint: test_signed_flip_fingerprint...
    assert "Detection curve" in page(url, f"/evaluations/{ids['pass']}")

    # Compare, with the first as reference; ledger diff computes the same.
    compared = data(url, f"/compare/{ids['pass']}/{ids['fail']}.json")
    assert compared["changed_cases"] == with_ledger("ledger", "diff", ids["pass"], ids["fail"])["changed_cases"]
    assert "changed" in page(url, f"/compare/{ids['pass']}/{ids['fail']}")
    assert get(url + f"/compare?a={ids['pass']}&b={ids['fail']}")[1]["Location"] == f"/compare/{ids['pass']}/{ids['fail']}"

    integrity = data(url, "/integrity.json")
    # the same findings; how much of the chain each checked differs (the review's verify recorded where the next starts)
    assert {**integrity["verify"], "coverage": None} == {**with_ledger("ledger", "verify"), "coverage": None}
    assert integrity["verify"]["ok"]
    assert "ledger verifies" in page(url, "/integrity")

    # Permalinks name entries by hash, and lead where the id does.
    assert re.fullmatch(r"/evaluations/[0-9a-f]{64}", ev["permalink"])
    assert data(url, ev["permalink"] + ".json")["id"] == ids["fail"]
    assert get(url + "/entries/" + ev["permalink"].rsplit("/", 1)[1][:16])[1]["Location"] == f"/evaluations/{ids['fail']}"
    assert get(url + "/evaluations/999.json")[0] == 404 and get(url + "/entries/" + "0" * 64)[0] == 404


def test_a_change_that_is_not_exact_shows_its_bound_flips_and_distance(made, url):
    ws, ids = made
    recorded = cli(ws, "ledger", "show", ids["bf16"])[1]["verdict_record"]["summary"]
    ev = data(url, f"/evaluations/{ids['bf16']}.json")
    assert ev["gate"] == "non_inferiority" and ev["paired"] and ev["distance"]["rows"][0][0] == "off~on"
    paired = recorded["paired"]
    assert ev["paired"][0][3:5] == [str(paired["harmful"]), str(paired["beneficial"])]
    assert sum(s["harmful"] for s in ev["flips_by_suite"]) == paired["harmful"]
    (row,) = [r for r in data(url, "/evaluations.json?flag=bf16")["rows"]]
    assert row["strength"] == f"loss ≤ {paired['upper']:.3f} (margin {paired['margin']:g})"
    html = page(url, f"/evaluations/{ids['bf16']}")
    assert "Paired outcomes and distances" in html and 'aria-label="KLD quantiles, log scale"' in html
    assert f"{recorded['distance']['distance']['kld']['max']:.2g}</text>" in html


def test_the_case_page_shows_where_an_arm_parts_from_the_reference_arm(made, url):
    """The planted restore fault (the FAIL): the reference arm reads the flag-on arm's answers as tokens it would not
    pick, and the case page lists those departures as the ledger keeps them; a PASS's case has none."""
    ws, ids = made
    arms = cli(ws, "ledger", "show", ids["fail"])[1]["verdict_record"]["summary"]["reference"]["arms"]
    kept = arms["on"]["departures"]
    assert kept and not arms["off"]["departures"], arms
    case_id = kept[0]["case"]
    shown = data(url, f"/evaluations/{ids['fail']}/cases/{quote(case_id, safe='')}.json")["departures"]
    assert [(d["arm"], d["turn"], d["position"], d["emitted"], d["reference"]) for d in shown] == [
        ("on", d["turn"], d["position"], d["emitted"], d["reference"]) for d in kept if d["case"] == case_id]
    assert all(d["emitted_piece"] is not None for d in shown)  # the tiny model's tokenizer is on this machine
    assert "Where an arm parts from the reference arm" in page(url, f"/evaluations/{ids['fail']}/cases/{quote(case_id, safe='')}")
    assert "Where an arm parts from the reference arm" not in page(url, f"/evaluations/{ids['pass']}/cases/{quote(case_id, safe='')}")


def test_signed_flip_fingerprint_is_the_one_ssh_keygen_prints(made, url, keys):  # noqa: F811
    ws, ids = made
    passed = data(url, f"/evaluations/{ids['pass']}.json")
    (flip,) = passed["flips"]
    printed = subprocess.run(["ssh-keygen", "-l", "-f", f"{keys['ana']}.pub"], capture_output=True, text=True, check=True)
    assert flip["fingerprint"] == printed.stdout.split()[1]
    assert flip["fingerprint"] in page(url, f"/evaluations/{ids['pass']}")
    (attested,) = passed["attestations"]  # ledger attest's envelope in the workspace, checked as verify-attestation does
    assert attested["ok"] and attested["file"] == "pass.intoto.json" and attested["signer"]["keyid"] == flip["fingerprint"]
    by_cli = cli(ws, "ledger", "verify-attestation", ws / "pass.intoto.json")[1]
    assert [attested[k] for k in ("signer", "statement", "problems")] == [by_cli[k] for k in ("signer", "statement", "problems")]
    assert attested["ledger"]["checked"] and by_cli["ledger"]["checked"]
    assert data(url, f"/evaluations/{ids['fail']}.json")["attestations"] == []


class Tags(HTMLParser):
    """Every element and attribute of a page, to show no markup from the ledger became an element."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.attributes: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.attributes += [name for name, _ in attrs]


def test_hostile_text_is_shown_as_text(made, url):
    ws, ids = made
    ev = data(url, f"/evaluations/{ids['hostile']}.json")
    (case,) = ev["cases"]
    assert "<script>" in case["case_id"] and ev["operator"] == OPERATOR
    paths = ["/flags", "/evaluations", f"/evaluations/{ids['hostile']}", case["href"], f"/evaluations/{ids['pass']}",
             f"/compare/{ids['hostile']}/{ids['pass']}"]
    for path in paths:
        body = page(url, path)
        tags = Tags()
        tags.feed(body)
        assert "script" not in tags.tags and "img" not in tags.tags, path
        assert not [a for a in tags.attributes if a.startswith("on")], path
    case_page = page(url, case["href"])
    assert "&lt;script&gt;alert(&#39;output&#39;)&lt;/script&gt;" in case_page  # the model's output, as text
    assert json.loads(get(url + case["href"] + ".json")[2])["turns"][0]["on"]["text"].endswith(HOSTILE)
    assert "&lt;img src=x onerror=alert(&#39;op&#39;)&gt;" in page(url, f"/evaluations/{ids['hostile']}")
    assert "&lt;script&gt;alert(&#39;reason&#39;)&lt;/script&gt; reviewed" in page(url, f"/evaluations/{ids['pass']}")
    assert REASON in json.dumps(data(url, f"/evaluations/{ids['pass']}.json")["flips"])


def test_only_this_servers_pages_may_ask_it(url):
    host = url.removeprefix("http://")
    status, headers, body = get(url + "/flags.json", {"Host": f"evil.example:{host.rsplit(':', 1)[1]}"})
    assert status == 403 and "not served here" in body and headers["Content-Security-Policy"] == CSP
    assert get(url + "/flags.json", {"Host": host.replace("127.0.0.1", "localhost")})[0] == 200
    assert get(url + "/flags.json", {"Origin": "http://evil.example"})[0] == 403
    assert get(url + "/flags.json", {"Origin": url})[0] == 200
    assert get(url + "/flags.json", {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "cors"})[0] == 403
    assert get(url + "/flags", {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "navigate"})[0] == 200  # a link
    for method in ("POST", "PUT", "DELETE", "PATCH"):
        status, headers, body = get(url + "/flags", method=method)
        assert status == 405 and "only reads" in body, method
    for path in ("/flags", "/evaluations.json", "/static/review.css", "/nope", "/evaluations/999"):
        headers = get(url + path)[1]
        assert headers["Content-Security-Policy"] == CSP and headers["X-Frame-Options"] == "DENY", path
        assert headers["X-Content-Type-Options"] == "nosniff"


def test_a_non_loopback_bind_needs_the_option(made, run_cli):
    code, out, err = run_cli("--workspace", made[0], "review", "--listen", "0.0.0.0:0", "--json")
    assert code == 2 and "not a loopback address" in json.loads(out)["error"] and "--allow-remote" in json.loads(out)["error"]
    code, out, _ = run_cli("--workspace", made[0], "review", "--listen", "127.0.0.1:nope", "--json")
    assert code == 2 and "HOST:PORT" in json.loads(out)["error"]


def digests(ws: Path) -> dict[str, str]:
    """Every file under the workspace by content; SQLite's -wal and -shm beside a read-only reader are left out
    (they hold no data: see test_nothing_under_the_workspace_changes)."""
    return {str(p.relative_to(ws)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(ws.rglob("*"))
            if p.is_file() and not p.name.endswith(("-wal", "-shm"))}


def test_nothing_under_the_workspace_changes(made, tmp_path):
    ws = tmp_path / "ws"
    shutil.copytree(made[0], ws)
    for extra in ("evidence.db-wal", "evidence.db-shm"):
        (ws / "ledger" / extra).unlink(missing_ok=True)
    before = digests(ws)
    ids = made[1]
    with review(ws) as u:
        for path in ("/flags", "/evaluations", "/integrity", f"/evaluations/{ids['fail']}", f"/compare/1/{ids['fail']}",
                     f"/evaluations/{ids['fail']}/cases/{quote('tiny/loop', safe='')}", "/flags.json"):
            assert get(u + path)[0] == 200, path
        assert get(u + "/flags", method="POST")[0] == 405
    assert digests(ws) == before
    wal = ws / "ledger" / "evidence.db-wal"
    assert not wal.exists() or wal.stat().st_size == 0  # a read-only reader wrote no page of the database


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_the_apps_connection_cannot_write(made, tmp_path, backend, request):
    from gatekeeper.ledger import Ledger

    ws = tmp_path / "ws"
    shutil.copytree(made[0], ws)
    url = f"sqlite:///{ws / 'ledger' / 'evidence.db'}"
    if backend == "postgresql":
        pg = request.getfixturevalue("pg_url")
        assert cli(ws, "ledger", "copy", url, pg)[0] == 0
        url = pg
    with Ledger(url, read_only=True) as ledger:
        entries = ledger.head()["entries"]
        with pytest.raises(Exception, match="readonly|read-only"):
            ledger.add_flush("model", {}, {})
    with Ledger(url) as ledger:
        assert ledger.head()["entries"] == entries


def tamper(db: Path) -> None:
    """Edit one case's recorded text behind the ledger's back (dropping the trigger that forbids it)."""
    conn = sqlite3.connect(db)
    triggers = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'trigger' AND tbl_name = 'case_result'")]
    for name in triggers:
        conn.execute(f"DROP TRIGGER {name}")
    conn.execute("UPDATE case_result SET result = replace(result, '\"text\"', '\"text \"') WHERE id = 1")
    conn.commit()
    conn.close()


def test_a_tampered_ledger_is_red_on_every_page_and_no_flag_is_safely_on(made, tmp_path):
    ws = tmp_path / "ws"
    shutil.copytree(made[0], ws)
    tamper(ws / "ledger" / "evidence.db")
    (ws / "ledger" / "evidence.db.verified.json").unlink(missing_ok=True)  # an old case edited: found by a full verify
    ids = made[1]
    with review(ws) as u:
        for path in ("/flags", "/evaluations", "/integrity", f"/evaluations/{ids['pass']}", f"/compare/1/{ids['fail']}",
                     f"/evaluations/{ids['fail']}/cases/{quote('tiny/loop', safe='')}", "/evaluations/999"):
            body = get(u + path)[2]
            assert 'class="badge bad"' in body and "LEDGER DOES NOT VERIFY" in body, path
            assert "ledger verifies" not in body, path
        flags = data(u, "/flags.json")
        assert not flags["integrity"]["ok"] and "seq" in flags["integrity"]["problem"]
        assert all(not f.get("safely_on") for f in flags["flags"])
        assert ">ON<" not in page(u, "/flags")


def test_every_page_on_a_real_postgresql_server(made, url, pg_url, tmp_path):
    ids = made[1]
    ws = tmp_path / "ws"
    shutil.copytree(made[0], ws)
    for recorded in ws.glob("ledger/checkpoint*"):  # they name the SQLite ledger: the copy is another one
        recorded.unlink()
    code, out = cli(ws, "ledger", "copy", f"sqlite:///{ws / 'ledger' / 'evidence.db'}", pg_url)
    assert code == 0 and out["ok"], out
    assert cli(ws, "ledger", "checkpoint", "--record", ledger=pg_url)[0] == 0  # the policy's checkpoint_after_flip
    paths = ["/evaluations.json", "/evaluations.json?verdict=FAIL", f"/evaluations/{ids['fail']}.json",
             f"/compare/{ids['pass']}/{ids['fail']}.json", f"/evaluations/{ids['fail']}/cases/{quote('tiny/loop', safe='')}.json"]
    with review(ws, ledger=pg_url) as u:
        for path in paths:
            assert data(u, path) == data(url, path), path
        assert data(u, "/integrity.json")["verify"]["ok"]
        flags = data(u, "/flags.json")["flags"]
        assert [f["safely_on"] for f in flags] == [True]
        for path in ("/flags", "/evaluations", f"/evaluations/{ids['pass']}"):
            assert 'class="badge ok"' in page(u, path)


def test_pages_walk_a_long_ledger_once_each(made, tmp_path):
    """Paging by id: following 'older' from the newest page visits every evaluation once, newest first, under a
    filter too, and the totals are the ledger's (230 evaluations appended to a real chain)."""
    from gatekeeper.ledger import Ledger
    from gatekeeper.ledger.chain import append
    from gatekeeper.ledger.database import write

    ws = tmp_path / "ws"
    shutil.copytree(made[0], ws)
    with Ledger(f"sqlite:///{ws / 'ledger' / 'evidence.db'}") as ledger:
        template = ledger.evaluation(made[1]["fail"])
        with write(ledger.engine) as conn:
            for n in range(230):
                eid = append(conn, "evaluation", {k: template[k] for k in ("flag", "operator", "pid", "host", "gate",
                                                                          "identity", "config")})
                append(conn, "verdict", {"evaluation_id": eid, "verdict": ("PASS", "FAIL", "INCONCLUSIVE")[n % 3],
                                         "reasons": [], "summary": {}})
        expected = [e["id"] for e in ledger.evaluations()]
        failed = [e["id"] for e in ledger.evaluations() if e["verdict"] == "FAIL"]
    with review(ws) as u:
        for query, ids in (("", expected), ("verdict=FAIL", failed)):
            seen, path = [], f"/evaluations.json?{query}"
            while path:
                d = data(u, path.replace("/evaluations?", "/evaluations.json?"))
                assert d["total"] == len(ids) and len(d["rows"]) <= 50
                seen += [r["id"] for r in d["rows"]]
                path = d["next"]
            assert seen == ids, query
        assert get(u + "/evaluations.json?before=x")[0] == 400 and get(u + "/evaluations.json?verdict=MAYBE")[0] == 400
        assert data(u, "/integrity.json")["verify"]["ok"]


def test_the_cli_never_imports_the_review_app(made):
    """Like the OpenFeature server, the app is imported only by 'gatekeeper review'."""
    code = ("import sys\nfrom typer.testing import CliRunner\nfrom gatekeeper.cli import app\n"
            f"for args in (['--help'], ['--workspace', {str(made[0])!r}, 'status', '--json']):\n"
            "    assert CliRunner().invoke(app, args).exit_code == 0\n"
            "print(sorted(m for m in sys.modules if m.startswith(('gatekeeper.review', 'aiohttp'))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_the_flags_page_says_what_a_flip_needs_and_what_went_stale(made, tmp_path):
    ws, ids = tmp_path / "ws", made[1]
    shutil.copytree(made[0], ws)
    assert cli(ws, "flip", "prefix_cache", "off", "--operator", "ana", "--reason", "pause")[0] == 0
    with review(ws) as u:
        (flag,) = data(u, "/flags.json")["flags"]
        assert flag["state"] == "off" and not flag["safely_on"]
        needs = flag["next"]
        assert needs["evaluation_id"] == ids["pass"] and needs["approvals"] == {"recorded": 0, "required": 1,
                                                                               "signed": False, "by": []}
        assert needs["needs"] == ["1 more approval by distinct operators, not ci who ran it"]
        assert any(f"flip prefix_cache on --evaluation {ids['pass']}" in c for c in needs["commands"])
        assert f"flip prefix_cache on --evaluation {ids['pass']}" in page(u, "/flags")
        # the battery changes: the PASS no longer speaks for the pipeline, and the page says so and what to run
        suite = ws / "assertions" / "tiny.yaml"
        suite.write_text(suite.read_text().replace("max_tokens: 12", "max_tokens: 11"))
        time.sleep(1.1)  # the workspace's files are looked at once a second
        (flag,) = data(u, "/flags.json")["flags"]
        assert any(p.startswith("stale:") and "max_tokens" in p for p in flag["next"]["needs"]), flag["next"]
        assert flag["next"]["commands"][0].endswith("evaluate --flag prefix_cache")


def test_with_every_engine_down_the_pages_and_status_show_what_the_ledger_holds(made, tmp_path):
    """An audit happens when the servers are down: the flags, their states and live evidence come from the ledger;
    only whether the evidence is current needs the engine, and the page says that beside the facts (issue #61)."""
    from served import free_port

    ws, ids = tmp_path / "ws", made[1]
    shutil.copytree(made[0], ws)
    # the engine the PASS was made on is now a server that is not running
    off, on = (f"http://127.0.0.1:{free_port()}" for _ in range(2))
    (ws / "engines" / "tiny.yaml").write_text(f"adapter: http\nurl: {off}\nurl_on: {on}\ntimeout: 2\n")
    with review(ws) as u:
        flags = data(u, "/flags.json")
        assert not flags.get("flags_error"), flags["flags_error"]
        by = {f["flag"]: f for f in flags["flags"]}
        on = by["prefix_cache"]
        assert on["state"] == "on" and on["evaluation_id"] == ids["pass"] and not on["safely_on"]
        assert on["evidence_current"] is None and "127.0.0.1" in on["currency_error"], on
        assert "cannot be worked out now" in page(u, "/flags") and "ON, NOT SAFELY" in page(u, "/flags")
        assert not data(u, "/live.json").get("flags_error")
    code, out = cli(ws, "status")
    (row,) = [r for r in out["flags"] if r["flag"] == "prefix_cache"]
    assert code == 0 and row["state"] == "on" and "127.0.0.1" in row["currency_error"], row


def test_a_workspace_with_nothing_recorded_yet(workspace):
    """No ledger yet: every page answers, nothing is created, and the flags page says a flip needs an evaluation."""
    with review(workspace) as u:
        (flag,) = data(u, "/flags.json")["flags"]
        assert flag["state"] == "off" and flag["next"]["needs"][0].startswith("a passing evaluation")
        assert data(u, "/evaluations.json")["total"] == 0 and data(u, "/integrity.json")["verify"]["ok"]
        assert get(u + "/evaluations/1")[0] == 404 and 'class="badge ok"' in page(u, "/integrity")
    assert not (workspace / "ledger" / "evidence.db").exists()


def test_a_reader_refuses_an_older_ledger_and_leaves_it_as_it_was(tmp_path, workspace):
    """Opening an older ledger would migrate it: the review app and flags serve read it only at the current version."""
    from gatekeeper.errors import GatekeeperError
    from gatekeeper.ledger import Ledger
    from gatekeeper.ledger.database import make_engine
    from gatekeeper.ledger.migrations import migrate
    from gatekeeper.openfeature.resolve import Resolver

    db = workspace / "ledger" / "evidence.db"
    engine = make_engine(f"sqlite:///{db}")
    migrate(engine, 3)
    engine.dispose()
    before = hashlib.sha256(db.read_bytes()).hexdigest()
    with pytest.raises(GatekeeperError, match="schema version 3, not this gatekeeper's 5.*ledger verify"):
        Ledger(f"sqlite:///{db}", read_only=True)
    with Resolver(workspace) as resolver:
        assert "schema version 3" in (resolver.snapshot().error or "")
    with review(workspace) as u:
        assert "schema version 3" in data(u, "/integrity.json")["integrity"]["problem"]
    assert hashlib.sha256(db.read_bytes()).hexdigest() == before
