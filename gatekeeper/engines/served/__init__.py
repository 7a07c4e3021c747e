"""Served engines: a model behind a server's OpenAI-compatible API (llama-server, vLLM, mlx_lm.server, ...), read by
the ``http`` adapter, spoken to in each server's own dialect (``dialects``), with what a call cost as the server
reports it (``telemetry``), and the servers gatekeeper starts for a run (``serve``).

Imports: gatekeeper (the version), errors, evidence, identity, summaries, workspace, setup, engines.base,
engines.sampler, engines.hf_tokenizer.
"""
