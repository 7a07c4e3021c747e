"""Profile -> engine: built-ins, plugins by import path, ``auto``, and build-time refusals."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

import pytest
from tiny_models import tiny_llama  # noqa: F401  (fixture)

from gatekeeper.engines.base import Engine, Generation, Session
from gatekeeper.engines.registry import build_engine, engine_class, resolve_adapter, resolve_profile
from gatekeeper.errors import GatekeeperError
from gatekeeper.workspace import EngineProfile


class EchoSession(Session):
    def generate(self, prompt, *, max_tokens, stop=(), top2=False) -> Generation:
        toks = [prompt[-1]] * max_tokens
        g = Generation(toks, self.model.detokenize(toks), len(prompt), 0, 0.0, 0.0, 0.0)
        self.stats.add(g)
        return g


class EchoEngine(Engine):
    """A plugin as a user would write one: it repeats the prompt's last token."""

    name = "echo"
    session_class = EchoSession

    def __init__(self, profile):  # a plugin that does not ask for the workspace root
        super().__init__(profile)

    def render(self, messages: Sequence[dict[str, str]]) -> str:
        return "".join(m["content"] for m in messages)

    def tokenize(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def detokenize(self, tokens: Sequence[int]) -> str:
        return "".join(chr(t) for t in tokens)

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
    eng = build_engine(EngineProfile(adapter=f"{__name__}:EchoEngine", model="anything"), workspace_root=Path("."))
    assert isinstance(eng, EchoEngine) and eng.profile.model == "anything"
    with eng.session(cache=True) as on, eng.session(cache=False) as off:
        assert isinstance(on, EchoSession) and on.model is eng and on.cache and not off.cache
        assert on.generate([1, 2, 3], max_tokens=2).tokens == [3, 3]
        assert on.stats.calls == 1 and off.stats.calls == 0  # sessions keep their own figures
        assert on.held() == (None, None) and on.snapshot_stats() is None  # the contract's defaults
    eng.close()


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
        build_engine(EngineProfile(adapter=adapter))


def test_both_prefill_plans_build(tiny_llama):
    for plan in ("aligned", "monolithic"):
        with build_engine(EngineProfile(adapter="torch", model=str(tiny_llama), prefill=plan)) as eng:
            assert eng.identity()["prefill"] == plan


def test_missing_model_directory_is_a_config_error(tmp_path):
    with pytest.raises(GatekeeperError, match="no config.json"):
        build_engine(EngineProfile(adapter="torch", model=str(tmp_path)))


def test_relative_model_path_resolves_against_the_workspace(tiny_llama):
    eng = build_engine(
        EngineProfile(adapter="torch", model=tiny_llama.name, device="cpu"), workspace_root=tiny_llama.parent
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
        build_engine(profile)


def test_missing_lora_directory_is_a_config_error(tiny_llama, tmp_path):
    profile = EngineProfile(adapter="torch", model=str(tiny_llama), adapter_path=str(tmp_path / "nope"))
    with pytest.raises(GatekeeperError, match="adapter_path"):
        build_engine(profile)


def test_registry_import_stays_light():
    code = (
        "import sys, gatekeeper.engines.registry\n"
        "heavy = [m for m in ('torch', 'mlx', 'transformers', 'mlx_lm') if m in sys.modules]\n"
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
