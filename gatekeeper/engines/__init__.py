"""Engine adapters: one contract (``base``: a model loaded once, a session per configuration), built-ins
registered by name (``registry``) and plugins by import path.

In process: ``torch`` (its own greedy loop over a ``DynamicCache`` whose state ops are ``torch_kv``, or transformers'
``generate`` with a cache class: ``torch_generate``), ``mlx`` and ``llamacpp``, sharing one greedy loop
(``greedy``), Hugging Face tokenizers (``hf_tokenizer``) and the sampler a sampled suite draws through (``sampler``);
``sim``, the same loop over token counts with no model; transformers' cache-free read of any weights (``reader``);
any in-process adapter in another Python environment (``worker``, its child ``worker_main``). Served (``served/``):
the ``http`` adapter with each server's dialects and telemetry, and the servers gatekeeper starts. Session options: the
prefill plan (``prefill``: where a prompt's prefill is cut into forward passes) and planted faults (``faults``).

Imports: gatekeeper (the version), errors, identity, evidence, summaries, workspace, cache, setup.
"""
