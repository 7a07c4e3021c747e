"""Live traffic and measurement, grouped by concern; each group imports only the groups listed before it:

- ``captures/``: prompt captures and what they show before anything is built: the capture format, the prefill tax per
  stage, what captured prompts could cache, the load they put on a server, the candidate suites they make, and a
  trace replayed under snapshot policies;
- ``logs/``: llama.cpp-family server logs (forensics), with reuse across requests and advice on server settings from
  a capture of the same traffic;
- ``live/``: in front of a running server: the pass-through proxy that captures calls with their telemetry, and the
  guard after a flip (one request seen twice, compared, recorded and acted on); the only group that imports the gate
  and the ledger.

Imports: errors, listen, summaries, shadows, workspace, cache, battery, engines, runtime, gate, ledger, signing.
"""
