"""How tests/data/old_ledger was made, kept for the record: run by main at commit 4f939c7 (before the typed
evidence records), from tests/ with PYTHONPATH=., into a scratch workspace; its ledger/ and the outputs of
``ledger verify``, ``ledger export`` (every format), ``ledger diff 1 2`` and ``ledger list`` were copied here
(the database and JSON exports gzipped). tests/test_old_ledger.py reads them back with today's code."""
import shutil
import sys
from pathlib import Path

sys.path.insert(0, "tests")
from conftest import SUITE, profile
from tiny_models import build_tiny_llama
from typer.testing import CliRunner

from gatekeeper.cli import app
from gatekeeper.setup.scaffold import init_workspace

ws = Path(sys.argv[1])
shutil.rmtree(ws, ignore_errors=True)
init_workspace(ws)
(ws / "assertions" / "assistant.yaml").unlink()
(ws / "assertions" / "tiny.yaml").write_text(SUITE)
build_tiny_llama(ws / "models" / "tiny")
for name, adapter in [("tiny", "torch"), ("short", "fault_engines:ShortRestore")]:
    (ws / "engines" / f"{name}.yaml").write_text(profile(adapter, Path("models/tiny")))

def run(*args):
    r = CliRunner().invoke(app, ["--workspace", str(ws), *args], catch_exceptions=False)
    print(args, r.exit_code, r.stdout[:300], r.stderr[:300])
    return r
run("evaluate", "--flag", "prefix_cache", "--engine", "tiny", "--operator", "ci", "--json")
run("evaluate", "--flag", "prefix_cache", "--engine", "short", "--operator", "ci", "--json")
run("evaluate", "--flag", "static_first", "--engine", "tiny", "--operator", "ci", "--json")
run("flip", "prefix_cache", "on", "--operator", "ci", "--json")
(ws / "policies" / "half_precision.yaml").write_text(
    "flag: half_precision\ngate: non_inferiority\nmargin: 0.05\nchange: {profile: {dtype: bfloat16}}\nprobes: off\n")
(ws / "policies" / "prefix_cache.yaml").write_text(
    (ws / "policies" / "prefix_cache.yaml").read_text().replace("evaluator_may_approve: false", "evaluator_may_approve: true"))
run("evaluate", "--flag", "half_precision", "--engine", "tiny", "--operator", "ci", "--json")
run("evaluate", "--flag", "prefix_cache", "--engine", "tiny", "--operator", "ci", "--json")
run("calibrate", "--flag", "prefix_cache", "--evaluation", "4", "--operator", "ci", "--json")

run("flip", "prefix_cache", "on", "--operator", "ci", "--reason", "refund the prefill tax", "--evaluation", "4", "--json")
