"""Every example policy in policies/examples/ runs for real: copied into a workspace with the tiny
suite (two cases), evaluated on the default model (torch) and its GGUF (llamacpp) through the CLI."""

import json
import shutil

import pytest
from conftest import ROOT, SHORT, ledger, suite

from gatekeeper.setup.llama_libs import import_llama_cpp

import_llama_cpp()  # the llamacpp extra and make llama-server's libraries (make test does both)
pytestmark = pytest.mark.slow

EXAMPLES = ROOT / "policies" / "examples"
TORCH = "adapter: torch\nmodel: default\ndtype: float32\ndevice: cpu\n"
LLAMACPP = "adapter: llamacpp\nmodel: default\noptions: {n_ctx: 2048, n_threads: 1}\n"


@pytest.fixture
def examples_ws(workspace):
    (workspace / "assertions" / "assistant.yaml").unlink()
    (workspace / "assertions" / "tiny.yaml").write_text(suite(SHORT))
    (workspace / "engines" / "torch.yaml").write_text(TORCH)
    (workspace / "engines" / "llamacpp.yaml").write_text(LLAMACPP)
    return workspace


def run_example(run_cli, ws, flag, engine):
    shutil.copy(EXAMPLES / f"{flag}.yaml", ws / "policies" / f"{flag}.yaml")
    with open(ws / "policies" / f"{flag}.yaml", "a") as f:
        f.write("probes: off\n")  # the examples' changes on the battery alone; the probes are tested in test_probes.py
    code, out, _ = run_cli("--workspace", ws, "evaluate", "--flag", flag, "--engine", engine, "--limit", "2",
                           "--operator", "ci", "--json")
    out = json.loads(out)
    assert "error" not in out, out
    assert code == (0 if out["verdict"] == "PASS" else 1)
    with ledger(ws) as lg:
        ev = lg.evaluation(out["evaluation_id"])
        assert lg.verify().ok
    assert ev["status"] == out["verdict"] and len(ev["case_results"]) == 3 * 2
    return out, ev["identity"]


def never_a_pass_on_two_cases(out):
    """A non_inferiority example on the tests' two cases: the paired bound cannot rule its margin out, so it is
    underpowered (INCONCLUSIVE) unless the loss already shows (FAIL)."""
    kind = next(r.split(":")[0] for r in out["reasons"] if r.split(":")[0] in ("non_inferior", "inferior", "underpowered"))
    assert out["verdict"] == {"underpowered": "INCONCLUSIVE", "inferior": "FAIL"}[kind], out["reasons"]


def test_every_example_is_tested():
    assert {p.stem for p in EXAMPLES.glob("*.yaml")} == {"kv_q8", "speculative", "flash_attn", "runtime"}


def test_kv_q8(run_cli, examples_ws):
    out, identity = run_example(run_cli, examples_ws, "kv_q8", "llamacpp")
    assert identity["off"]["engine"]["kv_cache"] == {"type_k": "f16", "type_v": "f16"}
    assert identity["on"]["engine"]["kv_cache"] == {"type_k": "q8_0", "type_v": "q8_0"}
    assert identity["on"]["engine"]["flash_attn"] is True and identity["on"]["engine"]["n_threads"] == 1  # merged
    never_a_pass_on_two_cases(out)


def test_flash_attn(run_cli, examples_ws):
    out, identity = run_example(run_cli, examples_ws, "flash_attn", "llamacpp")
    assert (identity["off"]["engine"]["flash_attn"], identity["on"]["engine"]["flash_attn"]) == (False, True)
    assert out["verdict"] in ("PASS", "FAIL")
    assert (out["verdict"] == "FAIL") == bool(out["differing_cases"])


def test_speculative(run_cli, examples_ws):
    out, identity = run_example(run_cli, examples_ws, "speculative", "torch")
    assert "draft" not in identity["off"]["engine"]
    assert identity["on"]["engine"]["draft"] == {"model_digest": identity["on"]["engine"]["model_digest"], "tokens": 4}
    assert out["verdict"] in ("PASS", "FAIL") and (out["verdict"] == "FAIL") == bool(out["differing_cases"])


def test_runtime_migration(run_cli, examples_ws):
    out, identity = run_example(run_cli, examples_ws, "runtime", "torch")
    assert (identity["off"]["engine"]["engine"], identity["on"]["engine"]["engine"]) == ("torch", "llamacpp")
    assert identity["on"]["change"] == {"engine": "llamacpp"}
    tel = out["telemetry"]
    assert tel["off"]["tiny"]["calls"] == tel["on"]["tiny"]["calls"] == 2
    assert tel["off"]["tiny"]["prompt_tokens"] > 0 and tel["on"]["tiny"]["prompt_tokens"] > 0
    assert not any(r.startswith("telemetry_blind:") for r in out["reasons"])  # both engines report their figures
    never_a_pass_on_two_cases(out)
