"""A workspace whose ledger real evaluations made, for the review app's tests: a PASS, a planted FAIL (the cache
restores one position short), an INCONCLUSIVE (a baseline that disagrees with itself), a FAIL whose outputs, case
id, operator and reasons carry hostile markup, a change that is not exact (bfloat16, non_inferiority, its paired
bound and teacher-forced distance), a calibration, a signed flip and an attestation; and the running
app over it (``gatekeeper review`` as a real server process on a free loopback port)."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from conftest import SUITE, profile, wide_suite
from fault_engines import HOSTILE  # noqa: F401  (what the flag-on side's answers end with)
from trust import allowed_line

HOSTILE_SUITE = f"""suite: hostile
stage: hostile
prompt:
  - {{role: system, static: true, text: "Answer briefly. {'Keep to the point. ' * 20}"}}
  - {{role: user, static: false, text: "{{query}}"}}
decoding: {{max_tokens: 6}}
cases:
  - id: "x<script>alert(1)</script>"
    vars: {{query: "Say <b onmouseover=alert(1)>hi</b>"}}
    assert: [{{type: max-length, value: 10000, name: "<img src=x onerror=alert(2)>"}}]
"""
OPERATOR = "<img src=x onerror=alert('op')>"
REASON = "<script>alert('reason')</script> reviewed"


def cli(ws: Path, *args, ledger: str | None = None) -> tuple[int, dict]:
    from typer.testing import CliRunner

    from gatekeeper.cli import app

    where = ["--workspace", str(ws), *(["--ledger", ledger] if ledger else [])]
    result = CliRunner().invoke(app, [*where, *map(str, args), "--json"], catch_exceptions=False)
    return result.exit_code, json.loads(result.stdout)


def build(root: Path, tiny_llama: Path, key: Path) -> dict[str, int]:
    """The workspace at ``root``; returns the evaluation ids by what they are."""
    from gatekeeper.setup.scaffold import init_workspace

    init_workspace(root)
    (root / "assertions" / "assistant.yaml").unlink()
    (root / "assertions" / "tiny.yaml").write_text(SUITE)
    for name, adapter in (("tiny", "torch"), ("short", "fault_engines:ShortRestore"),
                          ("unstable", "fault_engines:Unstable"), ("hostile", "fault_engines:HostileText")):
        (root / "engines" / f"{name}.yaml").write_text(profile(adapter, tiny_llama))
    policy = root / "policies" / "prefix_cache.yaml"
    policy.write_text("".join(line for line in policy.read_text().splitlines(keepends=True) if not line.startswith("min_power:"))
                      + "probes: off\ndistance: false\n")
    (root / "policies" / "allowed_signers").write_text(allowed_line("ana", key))
    ids = {}
    for name, engine, verdict, extra in (("pass", "tiny", "PASS", ()), ("fail", "short", "FAIL", ()),
                                         ("inconclusive", "unstable", "INCONCLUSIVE", ())):
        code, out = cli(root, "evaluate", "--flag", "prefix_cache", "--engine", engine, "--operator", "ci", *extra)
        assert out["verdict"] == verdict, out
        ids[name] = out["evaluation_id"]
    (root / "assertions" / "hostile.yaml").write_text(HOSTILE_SUITE)
    code, out = cli(root, "evaluate", "--flag", "prefix_cache", "--engine", "hostile", "--suite", "hostile",
                    "--operator", OPERATOR)
    assert out["verdict"] == "FAIL", out
    ids["hostile"] = out["evaluation_id"]
    (root / "assertions" / "hostile.yaml").unlink()  # the PASS stays current evidence for the flag
    # a change that is not exact: bfloat16 against float32, judged on paired outcomes with its distance read
    wide_suite(root, 30)
    (root / "policies" / "bf16.yaml").write_text("flag: bf16\ngate: non_inferiority\nmargin: 0.2\ndistance: true\n"
                                                 "change: {profile: {dtype: bfloat16}}\n")
    code, out = cli(root, "evaluate", "--flag", "bf16", "--engine", "tiny", "--suite", "wide", "--operator", "ci")
    assert out["verdict"] in ("PASS", "INCONCLUSIVE", "FAIL") and out.get("distance"), out
    ids["bf16"] = out["evaluation_id"]
    for made in ("assertions/wide.yaml", "policies/bf16.yaml"):  # the battery and flags the PASS was judged on
        (root / made).unlink()
    code, out = cli(root, "calibrate", "--evaluation", ids["pass"], "--operator", "cal")
    assert code == 0, out
    code, out = cli(root, "flip", "prefix_cache", "on", "--evaluation", ids["pass"], "--operator", "ana",
                    "--reason", REASON, "--sign", key)
    assert code == 0 and out["state"] == "on", out
    code, out = cli(root, "ledger", "attest", ids["pass"], "--sign", key, "--output", root / "pass.intoto.json")
    assert code == 0, out
    return ids


@contextmanager
def review(ws: Path, *extra: str, ledger: str | None = None) -> Iterator[str]:
    """``gatekeeper review`` over ``ws`` as a real server process; yields its URL, stops it after."""
    cmd = [sys.executable, "-m", "gatekeeper.cli", "--workspace", str(ws), *(["--ledger", ledger] if ledger else []),
           "review", "--listen", "127.0.0.1:0", "--engine", "tiny", "--json", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        if not line:
            raise AssertionError(f"gatekeeper review did not start: {proc.stderr.read() if proc.stderr else ''}")
        yield json.loads(line)["url"]
    finally:
        proc.terminate()
        proc.wait(20)


def get(url: str, headers: dict[str, str] | None = None, method: str = "GET") -> tuple[int, dict[str, str], str]:
    """(status, headers, body) of one request; redirects are not followed."""

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args, **kwargs):
            return None

    request = urllib.request.Request(url, headers=headers or {}, method=method)
    try:
        with urllib.request.build_opener(NoRedirect).open(request, timeout=60) as r:
            return r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read().decode()
