"""`make check` holds the lines it promises: on a copy of the package, a module-level `import torch` in a CLI module
fails the linter, and a type error in a typed record's reader fails the type checker; the copy as it is passes."""

from __future__ import annotations

import contextlib
import os
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


def seeded_cache(cache: Path) -> Path:
    """A mypy cache dir for a copy of the package, seeded from `make check`'s (``$MYPY_CACHE_DIR``, which the Makefile
    sets) or the repository's own ``.mypy_cache``, when there is one.

    `make test` runs `make check` (mypy on the package, at the root) before the slow tests, so that cache holds every
    module the copy imports, torch and transformers included, under the same relative paths and options: mypy then
    rechecks only what differs from it (the planted file and whatever depends on it), as `make check` does on a
    developer's machine. mypy validates every entry it reads (its options, its source's size and hash) and recomputes
    the ones that do not match, so the seed changes how long the run takes, never what it reports. The files are
    hard-linked where they can be (mypy replaces a cache file, never writes into it, so the repository's copy is
    never touched; the one exception, missing_stubs, is left out), else copied; with no cache at the root the run starts cold."""
    seed = Path(os.environ.get("MYPY_CACHE_DIR") or ROOT / ".mypy_cache")
    if seed.is_dir():

        def link(src: str, dst: str) -> None:
            try:
                os.link(src, dst)
            except FileNotFoundError:  # replaced or removed by a mypy run at the root since it was listed: not needed
                pass
            except OSError:  # another file system
                with contextlib.suppress(FileNotFoundError):
                    shutil.copy2(src, dst)

        # missing_stubs is the one file mypy rewrites in place (for --install-types): left out, not linked
        shutil.copytree(seed, cache, copy_function=link, ignore=shutil.ignore_patterns("missing_stubs"))
    return cache


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
    done = run(tree, "mypy", "--cache-dir", str(seeded_cache(tmp_path / "cache")))
    assert done.returncode == 1 and "gate/kinds.py" in done.stdout and "[return-value]" in done.stdout, done.stdout
