"""llama.cpp built for the CPU it runs on: AMX left out of the native recipe, builds keyed by CPU target,
and a built tree proven (a greedy decode through its libraries, a one-request llama-server) before it is
installed. The refusals are shown on planted faults: a library patched to execute an illegal instruction,
a server that crashes, a library holding AMX instructions."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from gatekeeper.errors import GatekeeperError
from gatekeeper.setup import llama_build, llama_libs, llama_smoke, llama_target
from gatekeeper.setup.models import find_gguf, home

pytestmark = pytest.mark.slow
UD2 = b"\x0f\x0b"  # x86's guaranteed invalid opcode: SIGILL, as an AMX instruction is on a CPU that refuses it


def defines(*flags: str) -> set[str]:
    out = subprocess.run(["cc", *flags, "-dM", "-E", "-x", "c", "/dev/null"], capture_output=True, text=True, check=True)
    return {line.split()[1] for line in out.stdout.splitlines()}


def test_native_recipe_turns_amx_off_even_for_an_amx_cpu():
    flags = llama_target.NO_AMX.split()
    # -march=sapphirerapids stands for an AMX Xeon's -march=native; the -mno-* flags come first on
    # ggml's command line (CMAKE_C_FLAGS precede its -march=native) and must still win.
    assert {"__AMX_TILE__", "__AMX_INT8__"} <= defines("-march=sapphirerapids")
    assert not {d for d in defines(*flags, "-march=sapphirerapids") if d.startswith("__AMX")}
    assert "__AVX512F__" in defines(*flags, "-march=sapphirerapids")  # only AMX goes
    native = llama_target.cmake_flags()
    assert "-DGGML_NATIVE=ON" in native
    assert f"-DCMAKE_C_FLAGS={llama_target.NO_AMX}" in native and f"-DCMAKE_CXX_FLAGS={llama_target.NO_AMX}" in native


def test_builds_are_keyed_by_release_and_cpu_target(monkeypatch, tmp_path):
    monkeypatch.setenv("GATEKEEPER_HOME", str(tmp_path))
    here = llama_libs.root("0.3.36")
    assert here.parent == tmp_path / "llama.cpp" / "0.3.36" and here.name == llama_target.target()
    monkeypatch.setattr(llama_target, "cpu_features", lambda: ["avx2", "avx512f", "amx_tile", "amx_int8"])
    amx_cpu = llama_libs.root("0.3.36")
    assert amx_cpu != here and llama_libs.root("0.3.37") != amx_cpu
    monkeypatch.setenv("GATEKEEPER_LLAMA_CPU", "portable")
    portable = llama_libs.root("0.3.36")
    assert "-portable-" in portable.name
    monkeypatch.setattr(llama_target, "cpu_features", lambda: ["sse4_2"])
    assert llama_libs.root("0.3.36") == portable  # a portable build runs on any x86-64-v3 CPU
    assert "-DGGML_NATIVE=OFF" in llama_target.cmake_flags() and "-DGGML_AVX2=ON" in llama_target.cmake_flags()
    monkeypatch.setenv("GATEKEEPER_LLAMA_CPU", "fastest")
    with pytest.raises(GatekeeperError, match="GATEKEEPER_LLAMA_CPU='fastest'.*native or portable"):
        llama_libs.root("0.3.36")


def test_a_moved_home_does_not_load_another_cpus_build(monkeypatch):
    built = llama_libs.lib_dir()
    assert (built / llama_libs.LIBRARY).is_file()  # built by `make test`
    monkeypatch.setattr(llama_target, "cpu_features", lambda: ["another", "cpu"])
    assert llama_libs.lib_dir() != built and llama_build.server_binary() is None


def test_the_installed_build_holds_no_amx_and_passes_its_smoke_test():
    binary = llama_build.build_server()
    assert binary.is_relative_to(home() / "llama.cpp" / llama_build.version() / llama_target.target())
    assert (llama_build.source_dir() / "convert_hf_to_gguf.py").is_file()  # the vendored tree stays for converters
    assert llama_smoke.amx_instructions(llama_libs.lib_dir()) == 0
    proof = llama_smoke.prove(binary.parent.parent, find_gguf())
    assert proof["decode"]["tokens"] >= 1 and proof["server"]["tokens"] >= 1


def test_an_installed_build_is_reused(monkeypatch):
    first = llama_build.build_server()
    monkeypatch.setattr(llama_build, "compile_tree", lambda *a, **k: pytest.fail("rebuilt an installed build"))
    assert llama_build.build_server() == first == llama_build.server_binary()


def copy_tree(tmp_path: Path) -> Path:
    """A copy of the installed build (``bin/``, ``lib/``) to plant faults in."""
    tree = tmp_path / "tree"
    shutil.copytree(llama_libs.root(), tree, symlinks=True)
    return tree


def file_offset(lib: Path, symbol: str) -> int:
    """Where ``symbol``'s code lies in ``lib``'s file (its address mapped through the LOAD segments)."""
    nm = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True, check=True).stdout
    addr = next(int(line.split()[0], 16) for line in nm.splitlines() if line.split()[-1] == symbol)
    segments = subprocess.run(["readelf", "-lW", str(lib)], capture_output=True, text=True, check=True).stdout
    for line in segments.splitlines():
        parts = line.split()
        if parts and parts[0] == "LOAD":
            offset, vaddr, filesz = int(parts[1], 16), int(parts[2], 16), int(parts[4], 16)
            if vaddr <= addr < vaddr + filesz:
                return addr - vaddr + offset
    raise AssertionError(f"{symbol} not in a LOAD segment of {lib}")


def plant_trap(tree: Path) -> None:
    """Make the CPU backend's graph computation start with an illegal instruction."""
    lib = (tree / "lib" / "libggml-cpu.so").resolve()
    data = bytearray(lib.read_bytes())
    at = file_offset(lib, "ggml_graph_compute")
    data[at:at + 2] = UD2
    lib.write_bytes(bytes(data))


def crashing_server(tree: Path) -> None:
    server = tree / "bin" / "llama-server"
    server.unlink()
    server.write_text("#!/bin/sh\nkill -SEGV $$\n")
    server.chmod(0o755)


def test_smoke_decode_refuses_libraries_that_trap(tmp_path):
    tree = copy_tree(tmp_path)
    plant_trap(tree)
    with pytest.raises(GatekeeperError) as err:
        llama_smoke.decode(tree / "lib", find_gguf())
    msg = str(err.value)
    assert "greedy decode through its libraries died of SIGILL (illegal instruction" in msg
    assert "nothing was installed" in msg and "GATEKEEPER_LLAMA_CPU=portable" in msg and "\n" not in msg


def test_smoke_server_start_refuses_a_server_that_crashes(tmp_path):
    tree = copy_tree(tmp_path)
    crashing_server(tree)
    with pytest.raises(GatekeeperError, match=r"one-request llama-server start died of SIGSEGV \(segmentation fault\)"):
        llama_smoke.serve(tree / "bin" / "llama-server", find_gguf())


def test_amx_instructions_in_the_cpu_backend_are_refused(tmp_path):
    tree = copy_tree(tmp_path)
    src = tmp_path / "amx.c"
    src.write_text("#include <immintrin.h>\nvoid zero_tile(void) { _tile_zero(4); }\n")
    cpu_lib = (tree / "lib" / "libggml-cpu.so").resolve()
    cpu_lib.unlink()
    subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-mamx-tile", str(src), "-o", str(cpu_lib)], check=True)
    assert llama_smoke.amx_instructions(tree / "lib") == 1
    with pytest.raises(GatekeeperError, match="holds 1 AMX instructions.*nothing was installed"):
        llama_smoke.prove(tree, find_gguf())


@pytest.mark.parametrize("fault", [plant_trap, crashing_server])
def test_a_build_that_fails_its_smoke_test_installs_nothing(fault, monkeypatch, tmp_path):
    planted = copy_tree(tmp_path)
    fault(planted)
    monkeypatch.setenv("GATEKEEPER_HOME", str(tmp_path / "home"))

    def compiled(src: Path, build: Path, jobs=None) -> Path:
        # The compiler's neighbour: a build tree laid out as cmake leaves it, holding the planted fault.
        (build / "bin").mkdir(parents=True)
        for f in [*planted.glob("lib/*"), planted / "bin" / "llama-server"]:
            shutil.copy2(f, build / "bin" / f.name, follow_symlinks=False)
        return build

    monkeypatch.setattr(llama_build, "source_dir", lambda ver=None: tmp_path / "src")
    monkeypatch.setattr(llama_build, "compile_tree", compiled)
    with pytest.raises(GatekeeperError, match="failed its smoke test.*nothing was installed"):
        llama_build.build_server()
    assert llama_build.server_binary() is None
    root = llama_libs.root()
    assert sorted(p.name for p in root.iterdir()) == []  # no lib/, bin/, stage or build tree left behind
    assert llama_build.main([]) == 2  # the CLI entry point reports it as one line, exit 2
