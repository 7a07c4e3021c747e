"""Build llama.cpp's ``llama-server`` once, CPU-only, from the sources vendored in the
llama-cpp-python source distribution, into the user cache; reuse the build afterwards.

    python -m gatekeeper.llama_build            # prints the binary's path (builds it if missing)
    python -m gatekeeper.llama_build --source   # prints the unpacked llama.cpp tree (convert_hf_to_gguf.py, gguf-py)

The version is the installed llama-cpp-python's (so the served and the in-process engine run the
same llama.cpp), else ``DEFAULT_VERSION``; ``$GATEKEEPER_LLAMA_VERSION`` overrides both. Everything
lives under ``$GATEKEEPER_HOME/llama.cpp/VERSION/``: ``src/`` (the vendored tree) and
``bin/llama-server``. Only the package registry is contacted (``pip download``), and only when the
source is not unpacked yet.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from importlib import metadata
from pathlib import Path

from .errors import GatekeeperError
from .models import home

DEFAULT_VERSION = "0.3.36"

# CPU only, static, nothing fetched at build time (no prebuilt web UI, no curl, no OpenSSL).
CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DGGML_NATIVE=ON",
    "-DGGML_CUDA=OFF", "-DGGML_METAL=OFF", "-DGGML_VULKAN=OFF", "-DGGML_BLAS=OFF",
    "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON",
]


def version() -> str:
    if os.environ.get("GATEKEEPER_LLAMA_VERSION"):
        return os.environ["GATEKEEPER_LLAMA_VERSION"]
    try:
        return metadata.version("llama-cpp-python")
    except metadata.PackageNotFoundError:
        return DEFAULT_VERSION


def root(ver: str | None = None) -> Path:
    return home() / "llama.cpp" / (ver or version())


def server_binary(ver: str | None = None) -> Path | None:
    """The built ``llama-server``, or None if it is not built yet."""
    path = root(ver) / "bin" / "llama-server"
    return path if path.is_file() and os.access(path, os.X_OK) else None


def source_dir(ver: str | None = None) -> Path:
    """The vendored llama.cpp tree, unpacked once from the source distribution."""
    ver = ver or version()
    target = root(ver) / "src"
    if (target / "CMakeLists.txt").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".sdist-", dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
               f"llama-cpp-python=={ver}", "-d", tmp]
        if subprocess.run(cmd, stdout=sys.stderr).returncode != 0:
            raise GatekeeperError(f"could not download the llama-cpp-python {ver} source distribution; "
                                  "check the package registry is reachable or set GATEKEEPER_LLAMA_VERSION")
        (archive,) = Path(tmp).glob("*.tar.gz")
        with tarfile.open(archive) as tar:
            if hasattr(tarfile, "data_filter"):  # refuses links and paths that leave the folder
                tar.extractall(tmp, filter="data")
            else:  # Python releases before the filter existed
                tar.extractall(tmp)
        vendored = next(Path(tmp).glob("*/vendor/llama.cpp"))
        # Rename into place at the end, so an interrupted unpack leaves nothing half-done.
        if target.exists():
            shutil.rmtree(target)
        vendored.rename(target)
    return target


def build_server(ver: str | None = None, jobs: int | None = None) -> Path:
    """``llama-server`` for this machine's CPU, built once (several minutes on two cores)."""
    ver = ver or version()
    found = server_binary(ver)
    if found:
        return found
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise GatekeeperError(f"building llama-server needs {tool}; install it (Debian: apt-get install cmake g++)")
    src = source_dir(ver)
    build = root(ver) / "build"
    jobs = jobs or os.cpu_count() or 2
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    for cmd in (["cmake", "-S", str(src), "-B", str(build), *gen, *CMAKE_FLAGS],
                ["cmake", "--build", str(build), "--target", "llama-server", "-j", str(jobs)]):
        if subprocess.run(cmd, stdout=sys.stderr).returncode != 0:  # stdout is for the path alone
            raise GatekeeperError(f"llama-server build failed ({' '.join(cmd[:3])} ...); see the output above")
    binary = next(build.rglob("bin/llama-server"))
    target = root(ver) / "bin" / "llama-server"
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".tmp")
    shutil.copy2(binary, tmp)
    tmp.rename(target)
    shutil.rmtree(build, ignore_errors=True)  # the binary is static: the build tree is not needed
    return target


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    try:
        print(source_dir() if "--source" in args else build_server())
    except GatekeeperError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
