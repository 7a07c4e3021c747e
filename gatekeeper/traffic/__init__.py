"""Live traffic and measurement: the capture format (``capture``), the prefill tax per stage (``measure``),
what captured prompts could cache (``analyze``), the load they put on a server (``load``) and the candidate
suites they make (``cases``), a
pass-through proxy that captures calls with their telemetry (``proxy``), llama.cpp-family server logs
(``forensics``), with reuse across requests (``reuse``) and advice on server settings (``advice``),
replaying a trace under snapshot policies (``replay``), and the guard after a flip: live requests seen twice
(``shadow``) and compared, recorded and acted on in the proxy (``guarded``).

Imports: errors, listen, workspace, cache, battery, engines, runtime, gate, ledger, signing.
"""
