import os
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    """A fresh workspace laid out by the real ``init`` code."""
    from gatekeeper.scaffold import init_workspace

    ws = tmp_path / "ws"
    init_workspace(ws)
    return ws


@pytest.fixture
def run_cli(monkeypatch, tmp_path):
    """Invoke the real CLI in-process; returns (exit_code, stdout, stderr)."""
    from typer.testing import CliRunner

    from gatekeeper.cli import app

    monkeypatch.delenv("GATEKEEPER_WORKSPACE", raising=False)

    def run(*args: str):
        result = CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)
        return result.exit_code, result.stdout, result.stderr

    return run
