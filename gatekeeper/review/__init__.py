"""``gatekeeper review``: the evidence in a browser, for the people who decide a flip. A local web app over the
workspace's ledger, read-only by construction (the database refuses writes; no route changes anything).

``source`` reads the ledger (one integrity check and flag view per change of the ledger or workspace, and the
SQL that pages the evaluations list), ``pages`` turns it into each page's data (what ``PAGE.json`` returns) and
``flags`` the flags page's (each flag's state, what is stale and what a flip still needs),
``charts`` draws that data as server-rendered SVG, and ``app`` serves both behind the workstation's safeguards
(loopback, a Host allow-list, Origin checks, a strict Content-Security-Policy). Templates and the stylesheet sit
beside them; there is no script. Only ``gatekeeper review`` imports this package.

Imports: errors, evidence, summaries, identity, listen, signing, workspace, cache, engines, gate, ledger, reports.
"""
