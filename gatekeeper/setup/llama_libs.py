"""Where llama-cpp-python finds llama.cpp: the shared libraries ``gatekeeper.setup.llama_build`` builds
once into ``$GATEKEEPER_HOME/llama.cpp/VERSION/TARGET/lib/`` (the same build as its ``llama-server``).

A build is keyed by what it depends on, the llama-cpp-python release and the CPU target
(``llama_target``), so a home moved to, or shared with, another CPU never loads a build made for another.

Imported by the ``gatekeeper`` package itself, before anything imports ``llama_cpp``, so it stays
light: nothing here builds, downloads or imports llama_cpp until asked to.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ..errors import GatekeeperError
from .llama_target import target
from .models import home

DEFAULT_VERSION = "0.3.36"
LIBRARY = "libllama.so" if sys.platform != "darwin" else "libllama.dylib"


def version() -> str:
    """The installed llama-cpp-python's release (``$GATEKEEPER_LLAMA_VERSION`` overrides it)."""
    if os.environ.get("GATEKEEPER_LLAMA_VERSION"):
        return os.environ["GATEKEEPER_LLAMA_VERSION"]
    from importlib import metadata

    try:
        return metadata.version("llama-cpp-python")
    except metadata.PackageNotFoundError:
        return DEFAULT_VERSION


def version_dir(ver: str | None = None) -> Path:
    """``$GATEKEEPER_HOME/llama.cpp/VERSION``: the unpacked sources (``src/``) and one build per target."""
    return home() / "llama.cpp" / (ver or version())


def root(ver: str | None = None) -> Path:
    """Where this CPU's build of release ``ver`` lives (``bin/``, ``lib/``)."""
    return version_dir(ver) / target()


def lib_dir(ver: str | None = None) -> Path:
    """Where the built libllama.so and libggml*.so are (or will be)."""
    return root(ver) / "lib"


def _bundled_library() -> bool:
    """Whether the installed llama-cpp-python carries a llama.cpp build of its own (a wheel built
    without ``-DLLAMA_BUILD=OFF``). Looks the package up without importing it."""
    from importlib.util import find_spec

    try:
        spec = find_spec("llama_cpp")
    except (ImportError, ValueError):
        return False
    return bool(spec and spec.submodule_search_locations and
                any((Path(d) / "lib" / LIBRARY).is_file() for d in spec.submodule_search_locations))


def use_built_libraries() -> None:
    """Point llama-cpp-python at the libraries ``llama_build.build_server()`` builds: ``$LLAMA_CPP_LIB_PATH``,
    read by ``llama_cpp`` when it is imported (and inherited by ``python -m llama_cpp.server``
    children). Called once, when the ``gatekeeper`` package is imported; a value already set wins.
    Left unset only while those libraries are missing and llama-cpp-python has its own."""
    if "LLAMA_CPP_LIB_PATH" in os.environ:
        return
    lib = lib_dir()
    if (lib / LIBRARY).is_file() or not _bundled_library():
        os.environ.setdefault("LLAMA_CPP_LIB_PATH", str(lib))


def import_llama_cpp():
    """``import llama_cpp``, with a message naming the fix when llama.cpp's libraries are missing.
    An ImportError (llama-cpp-python not installed) is the caller's to word."""
    try:
        import llama_cpp
    except (OSError, RuntimeError) as e:  # FileNotFoundError: no libllama.so where it looked
        where = os.environ.get("LLAMA_CPP_LIB_PATH") or "llama-cpp-python's own lib/"
        raise GatekeeperError(f"llama-cpp-python could not load llama.cpp's library from {where} ({e}); "
                              "build llama.cpp once: make llama-server (or: python -m gatekeeper.setup.llama_build)") from None
    return llama_cpp
