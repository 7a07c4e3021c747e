"""Profile -> engine: built-ins, plugins by import path, ``auto``, and build-time refusals."""

from __future__ import annotations

import subprocess
import sys
from typing import Any, Sequence

import pytest
from tiny_models import tiny_llama  # noqa: F401  (fixture)

from gatekeeper.engines.base import Engine, Generation
from gatekeeper.engines.registry import build_engine, engine_class, resolve_adapter, resolve_profile
from gatekeeper.errors import GatekeeperError
from gatekeeper.workspace import EngineProfile


class EchoEngine(Engine):
    """A plugin as a user would write one: it repeats the prompt's last token."""

    name = "echo"

    def render(self, messages: Sequence[dict[str, str]]) -> str:
        return "".join(m["content"] for m in messages)

    def tokenize(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def detokenize(self, tokens: Sequence[int]) -> str:
        return "".join(chr(t) for t in tokens)

    def generate(self, prompt, *, max_tokens, stop=(), top2=False) -> Generation:
        toks = [prompt[-1]] * max_tokens
        return Generation(toks, self.detokenize(toks), len(prompt), 0, 0.0, 0.0, 0.0)

    def identity(self) -> dict[str, Any]:
        return {"engine": self.name}


class NotAnEngine:
    pass


def test_auto_resolves_by_platform():
    assert resolve_adapter("auto", system="darwin", machine="arm64") == "mlx"
    assert resolve_adapter("auto", system="darwin", machine="x86_64") == "torch"
    assert resolve_adapter("auto", system="linux", machine="aarch64") == "torch"
    assert resolve_adapter("torch", system="darwin", machine="arm64") == "torch"
    resolved = resolve_profile(EngineProfile(adapter="auto"))
    assert resolved.adapter in ("mlx", "torch")


def test_builtins_and_plugins_resolve_to_engine_classes():
    assert engine_class("torch").__name__ == "TorchEngine"
    assert engine_class("mlx").__name__ == "MLXEngine"
    assert engine_class(f"{__name__}:EchoEngine") is EchoEngine


def test_plugin_builds_and_runs():
    eng = build_engine(EngineProfile(adapter=f"{__name__}:EchoEngine", model="anything"), cache=True)
    assert isinstance(eng, EchoEngine) and eng.cache_enabled
    assert eng.generate([1, 2, 3], max_tokens=2).tokens == [3, 3]


@pytest.mark.parametrize(
    "adapter, words",
    [
        ("vllm", "unknown engine adapter"),
        ("no_such_package.module:Engine", "cannot import no_such_package.module"),
        (f"{__name__}:Missing", "has no Missing"),
        (f"{__name__}:NotAnEngine", "is not a subclass"),
    ],
)
def test_bad_adapters_are_clear_config_errors(adapter, words):
    with pytest.raises(GatekeeperError, match=words):
        build_engine(EngineProfile(adapter=adapter), cache=False)


def test_both_prefill_plans_build(tiny_llama):
    for plan in ("aligned", "monolithic"):
        eng = build_engine(EngineProfile(adapter="torch", model=str(tiny_llama), prefill=plan), cache=True)
        assert eng.identity()["prefill"] == plan


def test_missing_model_directory_is_a_config_error(tmp_path):
    with pytest.raises(GatekeeperError, match="no config.json"):
        build_engine(EngineProfile(adapter="torch", model=str(tmp_path)), cache=False)


def test_relative_model_path_resolves_against_the_workspace(tiny_llama):
    eng = build_engine(
        EngineProfile(adapter="torch", model=tiny_llama.name, device="cpu"), cache=False, workspace_root=tiny_llama.parent
    )
    assert eng.model_dir == tiny_llama
    ident = eng.identity()
    assert ident["engine"] == "torch" and ident["dtype"] == "float32" and ident["device"] == "cpu"
    assert set(ident["libraries"]) == {"torch", "transformers"} and ident["adapter_digest"] is None
    assert (ident["prefill"], ident["chunk"]) == ("aligned", 256) and len(ident["model_digest"]) == 64


def test_lora_without_peft_says_how_to_fix(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # an import of peft now fails, as when not installed
    (tmp_path / "lora").mkdir()
    profile = EngineProfile(adapter="torch", model=str(tiny_llama), adapter_path=str(tmp_path / "lora"))
    with pytest.raises(GatekeeperError, match="pip install peft"):
        build_engine(profile, cache=False)


def test_missing_lora_directory_is_a_config_error(tiny_llama, tmp_path):
    profile = EngineProfile(adapter="torch", model=str(tiny_llama), adapter_path=str(tmp_path / "nope"))
    with pytest.raises(GatekeeperError, match="adapter_path"):
        build_engine(profile, cache=False)


def test_registry_import_stays_light():
    code = (
        "import sys, gatekeeper.engines.registry\n"
        "heavy = [m for m in ('torch', 'mlx', 'transformers', 'mlx_lm') if m in sys.modules]\n"
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
