"""The gate: what decides. An evaluation's plan (``plans``), its sessions and runs (``evaluator``), the cache
probes every run ends with (``probes``), crashes as evidence (``crashes``), which server each side reaches
(``sides``), the comparison and decision of each gate kind (``kinds``), the production load a served evaluation runs under (``load``), cases
run on Ray actors (``ray_executor``), the graders of model-graded assertions (``graders``), planted-fault
calibration (``calibrate``), the pipeline in force and its version hash (``pipeline``), approvals and flips
(``flags``) and their signed records (``attestation``).
It is handed a ledger and never opens one.

Imports: errors, identity, evidence, signing, workspace, battery, engines.
"""
