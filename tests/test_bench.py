"""Every bench script imports: a renamed name in gatekeeper breaks a test, not a benchmark run."""

import importlib
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
SCRIPTS = sorted(p.stem for p in BENCH.glob("*.py"))


@pytest.fixture
def bench_path(monkeypatch):
    """``bench/`` first on sys.path (scripts import each other by name); path and modules put back after."""
    monkeypatch.setattr(sys, "path", [str(BENCH), *sys.path])
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        module = sys.modules[name]
        if Path(getattr(module, "__file__", None) or "/").parent == BENCH:
            del sys.modules[name]


def test_there_are_bench_scripts():
    assert "engine_cache" in SCRIPTS and len(SCRIPTS) >= 5


@pytest.mark.parametrize("name", SCRIPTS)
def test_bench_script_imports(bench_path, name):
    module = importlib.import_module(name)  # not run as __main__: only its imports and constants
    assert Path(module.__file__).parent == BENCH and module.__name__ == name
