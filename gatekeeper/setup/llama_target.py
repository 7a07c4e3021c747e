"""What a llama.cpp build is for: the CPU target, and the CMake recipe that compiles for it.

``native`` (the default) tunes ggml for the CPU it is built on, with AMX left out; ``portable``
(``$GATEKEEPER_LLAMA_CPU=portable``) compiles for x86-64-v3 (AVX2, FMA, F16C) instead, for a CPU
whose native build fails its smoke test. The target names a digest of the CPU's advertised features
and the recipe, so each CPU gets its own build and a changed recipe a new one.
"""

from __future__ import annotations

import hashlib
import os
import platform
from pathlib import Path

from ..errors import GatekeeperError

# CPU only, nothing fetched at build time (no prebuilt web UI, no curl, no OpenSSL). Shared libraries,
# so that llama-cpp-python loads the very build llama-server runs; every binary and library finds the
# others through RPATH $ORIGIN/../lib, set at link time, so the build tree needs no install step (whose
# rules cover every tool, and only llama-server is built).
COMMON = [
    "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=ON",
    "-DGGML_CUDA=OFF", "-DGGML_METAL=OFF", "-DGGML_VULKAN=OFF", "-DGGML_BLAS=OFF",
    "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON",
    "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON", "-DCMAKE_INSTALL_RPATH=$ORIGIN/../lib",
]
# -march=native turns on every extension the CPU advertises, AMX included, and ggml's AMX kernels then
# trap on AMX Xeons (`tilezero`: invalid opcode; Linux grants AMX state per request, and upstream's
# request covers the main thread only). AMX speeds up quantized matmuls alone, so it is left out; GCC
# and Clang let an explicit -mno-* win over -march=native whatever the order on the command line.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
NATIVE_X86 = ["-DGGML_NATIVE=ON", f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"]
PORTABLE_X86 = ["-DGGML_NATIVE=OFF", "-DGGML_SSE42=ON", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
                "-DGGML_F16C=ON", "-DGGML_BMI2=ON"]


def cpu() -> str:
    """``native`` or ``portable``, from ``$GATEKEEPER_LLAMA_CPU`` (default native)."""
    mode = os.environ.get("GATEKEEPER_LLAMA_CPU", "native")
    if mode not in ("native", "portable"):
        raise GatekeeperError(f"GATEKEEPER_LLAMA_CPU={mode!r} is not a llama.cpp CPU target; use native or portable")
    return mode


def x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")


def cmake_flags() -> list[str]:
    """The CMake arguments of this target's build."""
    if cpu() == "native":
        return [*COMMON, *(NATIVE_X86 if x86() else ["-DGGML_NATIVE=ON"])]
    return [*COMMON, *(PORTABLE_X86 if x86() else ["-DGGML_NATIVE=OFF"])]


def cpu_features() -> list[str]:
    """The ISA features this CPU advertises (Linux: /proc/cpuinfo's flags; elsewhere the processor's name)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("flags", "Features"):  # x86, arm64
                return sorted(set(value.split()))
    except OSError:
        pass
    return [platform.processor() or "unknown"]


def target() -> str:
    """The build's name, e.g. ``x86_64-native-3f09a1c2e4``: machine, mode, and a digest of the recipe and
    (for a native build) the CPU's features: what the compiled code depends on."""
    mode = cpu()
    key = "\n".join([*cmake_flags(), *(cpu_features() if mode == "native" else [])])
    return f"{platform.machine()}-{mode}-{hashlib.sha256(key.encode()).hexdigest()[:10]}"
