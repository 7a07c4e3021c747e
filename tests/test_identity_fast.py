"""Identity without loading: ``registry.identity`` equals what the loaded engine reports, byte for byte,
changes when a weight file changes, survives the process (digests and what a load taught are remembered in
the user cache), and ``status``, ``hash`` and ``flip`` compute it without importing torch; ``status`` and
``hash`` read a SQLite ledger without importing SQLAlchemy or numpy either."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import profile
from tiny_models import tiny_hybrid  # noqa: F401  (fixture)

from gatekeeper import identity
from gatekeeper.engines import registry
from gatekeeper.engines.llamacpp import LlamaCppEngine
from gatekeeper.engines.torch import TorchEngine
from gatekeeper.identity import canonical_json, child_env
from gatekeeper.workspace import EngineProfile


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """A user cache of its own: nothing remembered from other tests."""
    monkeypatch.setenv("GATEKEEPER_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(identity, "_file_memo", {})
    return tmp_path / "home"


def torch_profile(model: Path, **extra) -> EngineProfile:
    return EngineProfile(adapter="torch", model=str(model), dtype="auto", device="auto", prefill="aligned", chunk=64, **extra)


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_hybrid"])
def test_torch_identity_without_loading_is_the_loaded_one(model, request, home):
    prof = torch_profile(request.getfixturevalue(model), options={"attn_implementation": "eager"})
    assert TorchEngine.identity_of(prof) is None  # dtype, device, hybrid: nothing learned yet, so nothing claimed
    with registry.build_engine(prof) as engine:
        loaded = engine.identity()
    fast = TorchEngine.identity_of(prof)
    assert canonical_json(fast) == canonical_json(loaded) == canonical_json(registry.identity(prof))
    assert ("snapshots" in fast) == (model == "tiny_hybrid")  # learned from the load: the hybrid's state cannot be cut


def test_llamacpp_identity_without_loading_is_the_loaded_one():
    prof = EngineProfile(adapter="llamacpp", model="default", prefill="aligned", options={"n_ctx": 1024})
    fast = LlamaCppEngine.identity_of(prof)
    with registry.build_engine(prof) as engine:
        loaded = engine.identity()
    assert canonical_json(fast) == canonical_json(loaded)
    assert fast["dtype"].startswith("gguf:file_type=") and fast["dtype"] != "gguf:file_type=?"


def test_a_changed_weight_file_changes_the_identity_without_loading(tiny_llama, tmp_path, home):
    import shutil

    model = Path(shutil.copytree(tiny_llama, tmp_path / "model"))
    prof = torch_profile(model)
    with registry.build_engine(prof) as engine:
        before = engine.identity()
    weights = model / "model.safetensors"
    st = weights.stat()
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))  # same size, and the old mtime put back: only the bytes differ
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert weights.stat().st_size == st.st_size and weights.stat().st_mtime_ns == st.st_mtime_ns
    flipped = registry.identity(prof)
    assert flipped["model_digest"] != before["model_digest"]
    with open(weights, "ab") as f:  # a size change
        f.write(b"\0")
    grown = registry.identity(prof)
    assert len({before["model_digest"], flipped["model_digest"], grown["model_digest"]}) == 3
    assert {k: v for k, v in grown.items() if k != "model_digest"} == {k: v for k, v in before.items() if k != "model_digest"}


def test_digests_of_large_files_are_remembered_across_processes(tmp_path, home, monkeypatch):
    big = tmp_path / "weights.bin"
    big.write_bytes(os.urandom(3 << 20))
    first = identity.file_digest(big)
    reads = []
    real = identity._sha256_file
    monkeypatch.setattr(identity, "_sha256_file", lambda p: reads.append(p) or real(p))
    monkeypatch.setattr(identity, "_file_memo", {})  # a new process: only digests.json remembers
    monkeypatch.setattr(identity, "_DIGESTS", identity.Memo("digests.json"))
    assert identity.file_digest(big) == first and reads == []
    assert identity.file_digest(big, memo=False) == first and len(reads) == 1  # a tamper check reads the bytes
    assert json.loads((home / "digests.json").read_text())[str(big.resolve())][-1] == first


class Relabelled(TorchEngine):
    """A plugin that changes the identity it inherits: only loading it can tell what it reports."""

    def identity(self):
        return {**super().identity(), "relabelled": True}


def test_a_plugin_that_redefines_identity_is_loaded(tiny_llama, home):
    prof = torch_profile(tiny_llama).model_copy(update={"adapter": "test_identity_fast:Relabelled"})
    with registry.build_engine(prof) as engine:
        assert engine.identity()["relabelled"] is True  # and what its load taught is remembered
    assert Relabelled.identity_of(prof) is not None  # the inherited computation would answer, without the change
    assert registry.identity(prof)["relabelled"] is True


class Elsewhere(TorchEngine):
    """Loads the model from ``options.actor_model`` instead of the profile's (as tests/fault_engines.py's Ray actors do)."""

    options = {**TorchEngine.options, "actor_model": "a model directory"}

    def _locate(self, workspace_root):
        super()._locate(workspace_root)
        self.model_dir = self.weights = Path(self.profile.options["actor_model"])


def test_an_adapter_that_finds_its_files_elsewhere_reports_what_it_loaded(tiny_llama, tmp_path, home):
    from tiny_models import build_tiny_llama

    other = build_tiny_llama(tmp_path / "other", seed=1)
    prof = torch_profile(tiny_llama).model_copy(update={"adapter": "test_identity_fast:Elsewhere",
                                                        "options": {"actor_model": str(other)}})
    with registry.build_engine(prof) as engine:
        loaded = engine.identity()
    assert loaded["model_digest"] == identity.directory_digest(other) != identity.directory_digest(tiny_llama)
    assert registry.identity(prof) == loaded  # loaded, not computed from the profile's model


PROBE = """
import json, sys
from typer.testing import CliRunner
from gatekeeper.cli import app
r = CliRunner().invoke(app, sys.argv[1:], catch_exceptions=False)
print(json.dumps({"code": r.exit_code, "out": r.stdout, "heavy": sorted(m for m in HEAVY if m in sys.modules)}))
"""
HEAVY = ("numpy", "sqlalchemy", "torch", "transformers")  # what a command that only reads should not import


def probe(*args: str, path: Path | None = None) -> dict:
    """A CLI command in a fresh process: its exit code, output, and which of HEAVY got imported.
    ``path``: a folder to import plugin adapters from."""
    env = child_env(PYTHONPATH=os.pathsep.join(filter(None, [str(path or ""), os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-c", f"HEAVY = {HEAVY!r}" + PROBE, *map(str, args)], capture_output=True,
                          text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


# A plugin adapter whose identity its profile tells and whose module imports nothing heavy.
LIGHT = """
from gatekeeper.engines.base import Engine


class Light(Engine):
    name = "light"

    @classmethod
    def identity_of(cls, profile, *, workspace_root=None):
        return {"engine": cls.name, "model": profile.model, "dtype": profile.dtype, "device": profile.device}

    def identity(self):
        return self.identity_of(self.profile)
"""


def test_status_and_hash_read_a_sqlite_ledger_without_sqlalchemy(workspace, run_cli, home, tmp_path):
    from gatekeeper.ledger import Ledger

    (tmp_path / "light_engine.py").write_text(LIGHT)
    (workspace / "engines" / "auto.yaml").write_text("adapter: light_engine:Light\nmodel: m\ndtype: float32\ndevice: cpu\n")
    for args in (["status", "--json"], ["hash", "--json"], ["status"]):  # no ledger yet, then one with flips
        assert probe("--workspace", workspace, *args, path=tmp_path)["heavy"] == []
    with Ledger(f"sqlite:///{workspace / 'ledger' / 'evidence.db'}") as ledger:
        ledger.add_flip("prefix_cache", "on", "ana", "first")
        ledger.add_flip("prefix_cache", "off", "bo", "second")
        ledger.add_flip("prefix_cache", "on", "cy", "third")
        latest = ledger.flag_states()["prefix_cache"]
    status = probe("--workspace", workspace, "status", "--json", path=tmp_path)
    assert status["heavy"] == [] and status["code"] == 0, status
    (row,) = json.loads(status["out"])["flags"]
    assert (row["state"], row["operator"], row["since"]) == ("on", "cy", latest["at"])
    hashed = probe("--workspace", workspace, "hash", "--json", path=tmp_path)
    assert hashed["heavy"] == [] and hashed["code"] == 0, hashed
    assert json.loads(hashed["out"])["parts"]["flags"] == {"prefix_cache": "on"}
    assert json.loads(hashed["out"])["parts"]["engine"]["engine"] == "light"
    human = probe("--workspace", workspace, "hash", path=tmp_path)
    assert human["heavy"] == [] and json.loads(hashed["out"])["pipeline_hash"] in human["out"]


@pytest.mark.slow
def test_status_hash_and_flip_never_import_torch(tiny_ws, tiny_llama, run_cli, home, tmp_path):
    import shutil

    from conftest import evaluate

    model = Path(shutil.copytree(tiny_llama, tmp_path / "model"))  # its weights change below
    (tiny_ws / "engines" / "tiny.yaml").write_text(profile("torch", model))
    code, out = evaluate(run_cli, tiny_ws, "tiny", "--limit", "1")
    assert code == 0, out
    eid = out["evaluation_id"]
    code, _, _ = run_cli("--workspace", tiny_ws, "flip", "prefix_cache", "on", "--evaluation", eid, "--operator", "bob",
                         "--reason", "r", "--json")
    assert code == 0
    status = probe("--workspace", tiny_ws, "status", "--json")
    (row,) = json.loads(status["out"])["flags"]
    assert status["heavy"] == [] and row["state"] == "on" and row["evidence_current"] is True, status
    hashed = probe("--workspace", tiny_ws, "hash", "--engine", "tiny", "--json")
    code, out, _ = run_cli("--workspace", tiny_ws, "hash", "--engine", "tiny", "--json")
    assert hashed["heavy"] == [] and json.loads(hashed["out"]) == json.loads(out)
    flip = probe("--workspace", tiny_ws, "flip", "prefix_cache", "on", "--evaluation", eid, "--operator", "carol",
                 "--reason", "again", "--json")
    assert set(flip["heavy"]) <= {"sqlalchemy"} and json.loads(flip["out"])["action"] == "flipped", flip

    # the evidence goes stale when the weights change, and status says so, still without torch
    with open(model / "model.safetensors", "ab") as f:
        f.write(b"\0")
    status = probe("--workspace", tiny_ws, "status", "--json")
    (row,) = json.loads(status["out"])["flags"]
    # numpy comes only with deepdiff, which describes what changed in the identity
    assert set(status["heavy"]) <= {"numpy"} and row["evidence_current"] is False
    assert any(p.startswith("stale:") and "model_digest" in p for p in row["evidence_problems"]), row
