"""The gate: what decides, grouped by concern; each part below imports only parts listed before it:

- ``stats/``: the statistics, a leaf layer (paired bounds, the sequential rule, looks, coupling, PIT, distance,
  the guard's e-values);
- ``kinds``: the comparison and decision of each gate kind;
- ``run/``: the plan as a record and its cases run (sessions, Ray actors, graders, sides, production load);
- ``arms/``: the evidence beside the battery (cache probes, crashes, controls, reference arms, the forced distance);
- ``state/``: what is in force (flag states, what each flag switches, the pipeline and its hash);
- ``planning``: an evaluation's plan, made and checked before anything loads, and its configurations' identity;
- ``enable/``: turning a flag on (whether evidence is current, approvals and flips, their signed records);
- ``power/``: whether the gate can say no (calibration, a served engine's twin, mining, sizing);
- ``decide``: the decision, an ordered list of judges folded by a precedence stated in one place;
- ``evaluator``: the orchestrator, which runs a plan, compares and records, and has ``decide`` decide; no group
  imports it;
- ``guard``: the guard's rule on live comparisons after a flip (its statistics: ``stats/evalues.py``).

It is handed a ledger and never opens one.

Imports: errors, identity, evidence, summaries, shadows, signing, workspace, battery, engines.
"""
