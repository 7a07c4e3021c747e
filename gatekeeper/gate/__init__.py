"""The gate: what decides. What each flag switches (``switches``), an evaluation's plan (``plans``), its cases
run on sessions (``runs``) and the evaluation itself (``evaluator``), the cache probes every run ends with
(``probes``), crashes as evidence (``crashes``), which server each side reaches (``sides``), the comparison and
decision of each gate kind (``kinds``) with paired bounds for changes that are not exact (``paired``) and the
teacher-forced distance (``distance``, ``forced``), the cases a margin needs (``sizing``), the anytime-valid rule
of a sequential evaluation (``sequential``), the production load a
served evaluation runs under (``production``), cases run on Ray actors (``ray_executor``), the graders of
model-graded assertions (``graders``), planted-fault calibration (``calibrate``), the pipeline in force and its
version hash (``pipeline``), flag states (``flags``), whether evidence is current (``current``), the looks at one
change that spend its alpha (``looks``), approvals and flips (``flip``) and their signed records (``attestation``).
It is handed a ledger and never opens one.

Imports: errors, identity, evidence, signing, workspace, battery, engines.
"""
