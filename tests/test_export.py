"""``ledger export``: a FAILED evaluation as a reviewer reads it, in Markdown, HTML (rendered by a real
headless Chromium, which must fetch nothing) and JSON."""

import html
import json
import shutil
import subprocess

import pytest
from conftest import SUITE, profile
from typer.testing import CliRunner

from gatekeeper.cli import app
from gatekeeper.ledger import Ledger
from gatekeeper.reports.export import CSP, render

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def failed(tmp_path_factory, tiny_llama):
    """A workspace whose ledger holds one FAILED evaluation (the cache restores one position short)."""
    from gatekeeper.setup.scaffold import init_workspace

    ws = tmp_path_factory.mktemp("export") / "ws"
    init_workspace(ws)
    (ws / "assertions" / "assistant.yaml").unlink()
    (ws / "assertions" / "tiny.yaml").write_text(SUITE)
    (ws / "engines" / "short.yaml").write_text(profile("fault_engines:ShortRestore", tiny_llama))
    result = CliRunner().invoke(app, ["--workspace", str(ws), "evaluate", "--flag", "prefix_cache", "--engine", "short",
                                      "--operator", "ci", "--json"], catch_exceptions=False)
    outcome = json.loads(result.stdout)
    assert outcome["verdict"] == "FAIL", outcome
    with Ledger(f"sqlite:///{ws / 'ledger' / 'evidence.db'}") as lg:
        record = lg.evaluation(outcome["evaluation_id"])
    differing = [c for c in record["comparisons"] if not c["equal"]]
    return ws, record, differing


def export(ws, *args):
    result = CliRunner().invoke(app, ["--workspace", str(ws), "ledger", "export", *map(str, args)], catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


def test_markdown_shows_verdict_identities_stages_and_divergence(failed):
    ws, record, differing = failed
    code, md, _ = export(ws, record["id"], "--format", "md")
    assert code == 0
    assert md.startswith(f"# Evaluation {record['id']}: prefix_cache — FAIL")
    for reason in record["reasons"]:
        assert html.escape(reason, quote=False).replace("|", "\\|") in md
    assert "| flags.prefix_cache | off | on | **differs** |" in md
    assert "| engine.model_digest |" in md
    off = [r for r in record["case_results"] if r["config"] == "off" and r["repeat"] == 0 and r["case_id"].startswith("tiny/")]
    prompt_off = sum(t["prompt_tokens"] for r in off for t in r["result"]["turns"])
    assert f"| tiny | off | {sum(len(r['result']['turns']) for r in off)} | {prompt_off} | 0 | {prompt_off} |" in md
    summary = record["verdict_record"]["summary"]
    assert "## Cache probes" in md and f"| repeat | {summary['probes']['repeat']} |" in md and "| probe:" not in md
    for c in differing:
        d = c["detail"]
        assert f"### {c['case_id']} (off#0~on#0, turn {d['turn']})" in md
        assert f"First divergent position: **{d['first_divergent_position']}**" in md
        assert f"token {d['a']['token']} " in md and f"margin {d['a']['margin']:.4g}" in md


def page_text(dom):
    import re

    return html.unescape(re.sub(r"<[^>]+>", " ", dom))


def chromium(page, tmp_path, name):
    """Render ``page`` headless; the rendered DOM and the URLs the page itself asked the network for."""
    if CHROMIUM is None:
        pytest.fail("chromium is not installed: 'make test' installs it (apt-get install chromium)")
    netlog = tmp_path / f"{name}.netlog.json"
    run = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                          "--disable-component-update", "--disable-sync", "--no-first-run",
                          f"--user-data-dir={tmp_path / (name + '-profile')}", f"--log-net-log={netlog}",
                          "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=90)
    assert run.returncode == 0, run.stderr[-2000:]
    log = json.loads(netlog.read_text())
    start = log["constants"]["logEventTypes"]["URL_REQUEST_START_JOB"]
    # the browser's own background requests are keyed to no site; a page's are keyed to file://
    fetched = [e["params"]["url"] for e in log["events"] if e["type"] == start
               and "file://" in str(e["params"].get("network_isolation_key", ""))]
    return run.stdout, fetched


def test_html_renders_in_chromium_and_fetches_nothing(failed, tmp_path):
    ws, record, differing = failed
    out = tmp_path / "report.html"
    code, _, _ = export(ws, record["id"], "--format", "html", "--output", out)
    assert code == 0
    text = out.read_text()
    assert f'<meta http-equiv="Content-Security-Policy" content="{CSP}">' in text
    assert CSP == "default-src 'none'; style-src 'unsafe-inline'; img-src data:"
    for forbidden in ("<script", "<link", "<iframe", "url(", "@import", 'src="http', "src='http", 'href="http', "href='http"):
        assert forbidden not in text.lower()

    dom, fetched = chromium(out, tmp_path, "report")
    assert fetched == []
    shown = " ".join(page_text(dom).split())
    assert "Evaluation" in shown and "FAIL" in shown and "<svg" in dom and "<mark" in dom
    for c in differing:
        assert c["case_id"] in shown
        assert f"First divergent position: {c['detail']['first_divergent_position']} " in shown

    # the detector is live: the same check catches a page that does fetch
    leaky = tmp_path / "leaky.html"
    leaky.write_text('<html><body><img src="http://127.0.0.1:9/pixel.png"><p>x</p></body></html>')
    _, fetched = chromium(leaky, tmp_path, "leaky")
    assert fetched == ["http://127.0.0.1:9/pixel.png"]


def test_model_output_is_escaped(failed):
    _, record, _ = failed
    hostile = "</pre><script>alert(1)</script><img src=x onerror=alert(2)> a | b ```"
    record = json.loads(json.dumps(record))
    bad = next(c for c in record["comparisons"] if not c["equal"])
    bad["detail"]["text_a"] = hostile
    bad["detail"]["a"]["piece"] = "<b>"
    page = render(record, "html")
    assert "<script" not in page and "<img" not in page and "<b>" not in page
    assert "&lt;/pre&gt;&lt;script&gt;alert(1)&lt;/script&gt;&lt;img src=x onerror=alert(2)&gt;" in page
    assert "<code>&quot;&lt;b&gt;&quot;</code>" in page
    md = render(record, "md")
    assert "````text\n" in md  # the fence outgrows the backticks inside the output


def test_json_export_and_bad_input(failed, tmp_path):
    ws, record, differing = failed
    code, out, _ = export(ws, record["id"], "--format", "json")
    doc = json.loads(out)
    assert code == 0 and doc["verdict"] == "FAIL" and doc["record"]["id"] == record["id"]
    assert [d["first_divergent_position"] for d in doc["differences"]] == [c["detail"]["first_divergent_position"] for c in differing]
    assert {s["config"] for s in doc["stages"]} == {"off", "on"}
    chart = doc["chart"][0]
    assert chart["stage"] == "tiny" and 0 < chart["computed_on"] < chart["prompt_off"]

    code, out, _ = export(ws, record["id"], "--format", "md", "--output", tmp_path / "r.md", "--json")
    assert code == 0 and json.loads(out)["output"] == str(tmp_path / "r.md") and (tmp_path / "r.md").exists()

    before = sorted(tmp_path.iterdir())
    for args, expected in [
        ([record["id"], "--format", "pdf", "--output", tmp_path / "x.pdf"], "--format must be one of md, html, json"),
        ([999, "--output", tmp_path / "x.md"], "no evaluation 999"),
        ([record["id"], "--output", tmp_path / "nowhere" / "x.md"], "existing folder"),
    ]:
        code, out, _ = export(ws, *args, "--json")
        assert code == 2 and expected in json.loads(out)["error"], out
    assert sorted(tmp_path.iterdir()) == before
