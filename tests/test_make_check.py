"""`make check` holds the lines it promises: on a copy of the package, a module-level `import torch` in a CLI module
fails the linter, and a type error in a typed record's reader fails the type checker; the copy as it is passes."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def copy(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "gatekeeper", tmp_path / "gatekeeper", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def plant(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))


def run(tree: Path, *cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *cmd], cwd=tree, capture_output=True, text=True)


def test_lint_refuses_a_module_level_torch_import_in_a_cli_module(tmp_path):
    tree = copy(tmp_path)
    assert run(tree, "ruff", "check", "gatekeeper").returncode == 0
    plant(tree / "gatekeeper" / "cli" / "common.py", "from __future__ import annotations\n",
          "from __future__ import annotations\n\nimport torch  # noqa: F401\n")
    done = run(tree, "ruff", "check", "gatekeeper")
    assert done.returncode == 1 and "TID253" in done.stdout and "cli/common.py" in done.stdout, done.stdout


@pytest.mark.slow
def test_types_refuse_a_type_error_in_a_typed_record_reader(tmp_path):
    tree = copy(tmp_path)
    plant(tree / "gatekeeper" / "gate" / "kinds.py", "return f\"bit_exact: top-2 logits identical at all {self.steps} generated steps",
          "return self.steps\n        return f\"bit_exact: top-2 logits identical at all {self.steps} generated steps")
    done = run(tree, "mypy", "--cache-dir", str(tmp_path / "cache"))
    assert done.returncode == 1 and "gate/kinds.py" in done.stdout and "[return-value]" in done.stdout, done.stdout
