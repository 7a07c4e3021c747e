"""gatekeeper: decide, with evidence, whether an LLM inference optimization may be switched on."""

__version__ = "0.1.0"

# Before anything imports llama_cpp: point llama-cpp-python at the llama.cpp libraries that
# `make llama-server` (gatekeeper.setup.llama_build) builds, unless LLAMA_CPP_LIB_PATH is set already.
from .setup.llama_libs import use_built_libraries as _use_built_libraries  # noqa: E402

_use_built_libraries()


def __getattr__(name: str):
    # ``from gatekeeper import Runtime`` without importing torch at CLI start-up
    if name == "Runtime":
        from .runtime import Runtime

        return Runtime
    raise AttributeError(name)
