"""gatekeeper: decide, with evidence, whether an LLM inference optimization may be switched on."""

__version__ = "0.1.0"


def __getattr__(name: str):
    # ``from gatekeeper import Runtime`` without importing torch at CLI start-up
    if name == "Runtime":
        from .runtime import Runtime

        return Runtime
    raise AttributeError(name)
