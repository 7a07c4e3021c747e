"""Build llama.cpp once, CPU-only, from the sources vendored in the llama-cpp-python source
distribution, into the user cache, for both of its users; reuse the build afterwards.

    python -m gatekeeper.setup.llama_build            # prints llama-server's path (builds llama.cpp if missing)
    python -m gatekeeper.setup.llama_build --lib      # prints the folder of libllama.so and libggml*.so (the same)
    python -m gatekeeper.setup.llama_build --source   # prints the unpacked llama.cpp tree (convert_hf_to_gguf.py, gguf-py)

One compile gives shared libraries and ``llama-server`` linked to them: the http adapter's tests
start that server, and llama-cpp-python (installed with ``CMAKE_ARGS=-DLLAMA_BUILD=OFF``, so pip
compiles nothing) loads the same libraries, through ``$LLAMA_CPP_LIB_PATH``, which
``gatekeeper.setup.llama_libs`` sets when gatekeeper is imported. The version is the installed
llama-cpp-python's (so the served and the in-process engine run the same llama.cpp), else
``DEFAULT_VERSION``; ``$GATEKEEPER_LLAMA_VERSION`` overrides both. Everything lives under
``$GATEKEEPER_HOME/llama.cpp/VERSION/``: ``src/`` (the vendored tree) and, per CPU target
(``llama_target``), ``TARGET/lib/`` (the libraries) and ``TARGET/bin/llama-server`` (RPATH
``$ORIGIN/../lib``). A build is proven by a smoke decode and a one-request server start
(``llama_smoke``) before it is installed. Only the package registry is contacted (``pip
download``), and only when the source is not unpacked yet.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from ..errors import GatekeeperError
from . import llama_smoke
from .llama_libs import DEFAULT_VERSION, LIBRARY, import_llama_cpp, lib_dir, root, use_built_libraries, version, version_dir  # noqa: F401
from .llama_target import cmake_flags


def server_binary(ver: str | None = None) -> Path | None:
    """The built ``llama-server``, or None if it is not built yet (or is an older static build, with
    no libraries beside it)."""
    path = root(ver) / "bin" / "llama-server"
    built = path.is_file() and os.access(path, os.X_OK) and (lib_dir(ver) / LIBRARY).is_file()
    return path if built else None


def source_dir(ver: str | None = None) -> Path:
    """The vendored llama.cpp tree, unpacked once from the source distribution."""
    ver = ver or version()
    target = version_dir(ver) / "src"
    if (target / "CMakeLists.txt").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".sdist-", dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
               f"llama-cpp-python=={ver}", "-d", tmp]
        if subprocess.run(cmd, stdout=sys.stderr).returncode != 0:
            raise GatekeeperError(f"could not download the llama-cpp-python {ver} source distribution; "
                                  "check the package registry is reachable or set GATEKEEPER_LLAMA_VERSION")
        import tarfile

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
    """``llama-server`` for this machine's CPU, and the libraries it and llama-cpp-python load,
    built once (about 5-9 minutes on two cores) and proven before they are installed."""
    ver = ver or version()
    found = server_binary(ver)
    if found:
        return found
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise GatekeeperError(f"building llama-server needs {tool}; install it (Debian: apt-get install cmake g++)")
    from .models import find_gguf

    gguf = find_gguf()  # the smoke test's model; checked before minutes of compiling
    build = compile_tree(source_dir(ver), root(ver) / "build", jobs)
    # Stage bin/ and lib/ beside the final ones, prove them, then rename them into place: an
    # interrupted or refused build leaves no half-copied or untested tree (server_binary() wants both).
    stage = Path(tempfile.mkdtemp(prefix=".stage-", dir=root(ver)))
    try:
        (stage / "bin").mkdir()
        (stage / "lib").mkdir()
        shutil.copy2(build / "bin" / "llama-server", stage / "bin" / "llama-server")
        for lib in (build / "bin").glob("lib*.so*" if sys.platform != "darwin" else "lib*.dylib"):  # llama.cpp puts them there
            shutil.copy2(lib, stage / "lib" / lib.name, follow_symlinks=False)  # keeps the libllama.so -> .so.0 links
        if not (stage / "lib" / LIBRARY).exists():
            raise GatekeeperError(f"llama.cpp build left no {LIBRARY} in {build}; see the output above")
        print(f"proving the build: a greedy decode and a one-request llama-server start ({gguf.name})", file=sys.stderr)
        llama_smoke.prove(stage, gguf, bindings(ver))
        for part in ("lib", "bin"):
            final = root(ver) / part
            if final.exists():  # a half-installed tree from an older run
                shutil.rmtree(final)
            (stage / part).rename(final)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
        shutil.rmtree(build, ignore_errors=True)  # the binaries find lib/ by RPATH: the build tree is not needed
    return root(ver) / "bin" / "llama-server"


def bindings(ver: str) -> str:
    """A python whose llama-cpp-python is release ``ver`` (the one of its libraries' API): this one for the installed
    release, else the environment ``llama-cpp-python-VER`` (made once, pip compiling nothing; its server extra too, so
    a profile's ``serve`` command can start that release's ``llama_cpp.server``)."""
    from importlib import metadata

    from . import runtimes

    try:
        if metadata.version("llama-cpp-python") == ver:
            return sys.executable
    except metadata.PackageNotFoundError:
        pass
    name = f"llama-cpp-python-{ver}"
    found = runtimes.environment(name)
    if found:
        return found
    # LLAMA_BUILD=OFF: bindings alone; past pip's wheel cache, whose key ignores CMAKE_ARGS (see the Makefile)
    saved = dict(os.environ)
    os.environ.update({"CMAKE_ARGS": "-DLLAMA_BUILD=OFF", "PIP_NO_CACHE_DIR": "1"})
    try:
        return runtimes.prepare(name, [f"llama-cpp-python[server]=={ver}"], torch=False)["python"]
    finally:
        os.environ.clear()
        os.environ.update(saved)


def compile_tree(src: Path, build: Path, jobs: int | None = None) -> Path:
    """Configure and compile ``llama-server`` (and the libraries) from ``src`` into ``build``."""
    jobs = jobs or os.cpu_count() or 2
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    for cmd in (["cmake", "-S", str(src), "-B", str(build), *gen, *cmake_flags()],
                ["cmake", "--build", str(build), "--target", "llama-server", "-j", str(jobs)]):
        if subprocess.run(cmd, stdout=sys.stderr).returncode != 0:  # stdout is for the path alone
            raise GatekeeperError(f"llama-server build failed ({' '.join(cmd[:3])} ...); see the output above")
    return build


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    try:
        if "--source" in args:
            print(source_dir())
        elif "--lib" in args:
            build_server()
            print(lib_dir())
        else:
            print(build_server())
    except GatekeeperError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
