"""Turning a flag on: whether an evaluation is still evidence for it (``current``), approvals and flips
(``flip``) and the signed records that vouch for them (``attestation``).

Imports: errors, identity, evidence, summaries, signing, workspace, engines, gate.stats, gate.run, gate.state, gate.planning.
"""
