"""gatekeeper: decide, with evidence, whether an LLM inference optimization may be switched on."""

__version__ = "0.1.0"
