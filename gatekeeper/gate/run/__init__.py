"""Running an evaluation's cases: the plan as a record (``plans``), cases run turn by turn on a session (``runs``)
or on Ray actors (``ray_executor``), the graders of model-graded assertions (``graders``), which server each side
reaches (``sides``) and the production load a served evaluation runs under (``production``).

Imports: errors, identity, evidence, workspace, battery, engines, gate.stats, gate.kinds.
"""
