"""Prompt captures and what they show before anything is built: the capture format, one request a line, written by
the runtime and the proxy (``capture``), the prefill tax per stage from the battery run through the runtime
(``measure``, which can write a capture as it runs), what captured prompts could cache (``analyze``), the load they put
on a server (``load``), the candidate suites they make (``cases``), and a trace replayed under snapshot policies
(``replay``).

Imports: errors, workspace, cache, battery, engines, runtime.
"""
