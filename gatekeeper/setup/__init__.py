"""Set-up of third-party parts, each installed once under ``$GATEKEEPER_HOME`` and reused: the default model
(``models``), llama.cpp built for this CPU and proven before it is installed (``llama_target``,
``llama_build``, ``llama_smoke``, ``llama_libs``), vLLM for CPUs (``vllm``), promptfoo (``promptfoo``), OpenFeature's
JavaScript SDK and OFREP provider for the conformance test (``openfeature_js``),
Python environments for runtime upgrades (``runtimes``), the tiny hybrid model (``tiny_hybrid``) and a new
workspace (``scaffold``).

Imports: errors, identity.
"""
