"""The reports: what a reviewer or a CI job reads of the evidence. One recorded evaluation exported as
Markdown, a self-contained HTML page, JSON or JUnit XML (``export``), two evaluations side by side case by case
(``diff``), each case's part in an evaluation as the table data both read (``outcomes``), and the JUnit XML and
CI summary (``junit``). Each takes the plain records the ledger returns and never opens a ledger; it sits above
both the gate (whose near-tie thresholds and divergence labels it reads) and the ledger.

Imports: evidence, summaries, identity, cache, engines, gate.
"""
