"""In front of a running server: the pass-through proxy that captures live calls with their telemetry (``proxy``), and
the guard after a flip: a live request seen twice (``shadow``), the two answers compared, recorded in the ledger and
acted on in the proxy (``guarded``), the comparisons an evaluation makes made on them too: a suite case's assertions,
the teacher-forced distance (``judge``), and the same guard inside a Runtime, its calls replayed on a background worker
(``in_process``). The one group of traffic that imports the gate and the ledger.

Imports: errors, listen, summaries, shadows, workspace, signing, battery, engines, gate, ledger, traffic.captures.
"""
