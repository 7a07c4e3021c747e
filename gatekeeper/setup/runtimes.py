"""Python environments for runtime upgrades: ``gatekeeper runtime prepare NAME 'transformers==X' ...`` makes one
under ``$GATEKEEPER_HOME/runtimes/NAME/`` from the package registry, once, and an engine profile's ``python: NAME``
then runs its adapter there in a worker process (``engines/worker.py``).

torch is installed first at the project's pin (so no multi-GB CUDA build is pulled) unless a package given names
torch itself; then the packages given, and what the worker imports besides the runtime (``WORKER_NEEDS``).
gatekeeper itself is not installed there: the worker imports this checkout's package. An environment is proven
before it is recorded as made: its python imports the worker and prints the versions it holds.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Callable

from ..errors import GatekeeperError
from ..identity import child_env
from .models import home

TORCH = "torch==2.13.0"  # the Makefile's pin
STEPS = 5  # the venv, pip, torch, the packages, the proof
WORKER_NEEDS = ("pydantic>=2.5", "pyyaml>=6", "platformdirs>=4", "safetensors>=0.4", "numpy")
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
PACKAGE_ROOT = Path(__file__).resolve().parent.parent.parent


def folder(name: str) -> Path:
    return home() / "runtimes" / name


def environment(name: str) -> str | None:
    """The python of the environment ``name`` once made, else None."""
    if not NAME.fullmatch(name):
        return None
    exe = folder(name) / "venv" / "bin" / "python"
    return str(exe) if (folder(name) / "installed.json").is_file() and exe.is_file() else None


def installed(name: str) -> dict | None:
    path = folder(name) / "installed.json"
    return json.loads(path.read_text()) if path.is_file() else None


def prepare(name: str, packages: list[str], torch: bool = True, step: Callable[[str], None] = lambda label: None) -> dict:
    """Make the environment ``name`` with ``packages`` (pip requirement specifiers), or return the one made before
    with the same packages; what it holds: ``{"name", "python", "packages", "versions"}``. ``torch`` False: an
    environment whose runtime needs no torch (llama-cpp-python) gets none. ``step`` hears each step as it starts
    (``STEPS`` of them at most)."""
    if not NAME.fullmatch(name):
        raise GatekeeperError(f"NAME {name!r}: use letters, digits, '.', '_' and '-' (e.g. transformers-4.52.1)")
    if not packages:
        raise GatekeeperError("name the packages the environment holds, e.g. 'transformers==4.52.1'")
    made = installed(name)
    if made is not None:
        if sorted(made["packages"]) != sorted(packages):
            raise GatekeeperError(f"the environment {name} exists with {' '.join(made['packages'])}; pick another NAME, "
                                  f"or remove {folder(name)} to make it again")
        return made
    venv = folder(name) / "venv"
    _run([sys.executable, "-m", "venv", "--clear", str(venv)], "creating the virtual environment", step)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    _run(pip + ["--upgrade", "pip"], "upgrading pip", step)
    if torch and not any(re.match(r"torch\b", p) for p in packages):
        _run(pip + [TORCH], f"installing {TORCH}", step)
    _run(pip + [*packages, *WORKER_NEEDS], f"installing {' '.join(packages)}", step)
    step("proving the environment runs gatekeeper's worker")
    versions = prove(str(venv / "bin" / "python"))
    made = {"name": name, "python": str(venv / "bin" / "python"), "packages": packages, "versions": versions}
    (folder(name) / "installed.json").write_text(json.dumps(made, indent=2) + "\n")
    return made


def prove(python: str) -> dict[str, str]:
    """The environment's python imports the worker; returns the versions of the runtimes it holds."""
    code = ("import json, importlib.metadata as m\nimport gatekeeper.engines.worker_main\nout = {}\n"
            "for d in ('torch', 'transformers', 'mlx', 'mlx-lm', 'llama-cpp-python', 'tokenizers'):\n"
            "    try:\n        out[d] = m.version(d)\n    except m.PackageNotFoundError:\n        pass\n"
            "print(json.dumps(out))")
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, env=child_env(PYTHONPATH=str(PACKAGE_ROOT)))
    if done.returncode != 0:
        raise GatekeeperError(f"the environment at {python} cannot run gatekeeper's worker: "
                              f"{(done.stderr.strip().splitlines() or ['?'])[-1]}")
    return json.loads(done.stdout)


def _run(cmd: list[str], what: str, step: Callable[[str], None]) -> None:
    step(what)
    if subprocess.run(cmd, stdout=sys.stderr).returncode != 0:  # stdout is for the result alone
        raise GatekeeperError(f"making the environment failed while {what} ({' '.join(cmd[:5])} ...); see the output above")
