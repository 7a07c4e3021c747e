"""Server logs: what a llama.cpp-family server did with its prompt cache, from its log alone (``forensics``), and, with
a capture of the same traffic beside the log, reuse across requests and its losses by cause (``reuse``) and what each
server setting would have re-used on that traffic (``advice``).

Imports: errors, workspace, cache, engines, traffic.captures.
"""
