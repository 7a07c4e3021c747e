"""gatekeeper: decide, with evidence, whether an LLM inference optimization may be switched on.

The package by concern (docs/layout.md walks one evaluation through it): the command line (``cli/``), the user's
files as typed records (``workspace``), suites as the gate runs them (``battery/``) with JavaScript's meaning as
promptfoo gives it (``js/``), engine adapters (``engines/``), caches of model state (``cache/``), what decides
(``gate/``), the hash-chained evidence (``ledger/``), its records (``evidence``), the verdict's summaries
(``summaries``) and the guard's records (``shadows``), what reviewers read (``reports/``, ``review/``), flag states for OpenFeature (``openfeature/``), live traffic (``traffic/``), third-party
parts installed once (``setup/``), what a pipeline imports at run time (``runtime``), and the foundations: error types
(``errors``), canonical JSON and digests (``identity``), SSH signatures (``signing``), the servers' listening socket
(``listen``).
"""

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
