"""Whether the gate can say no, and what it needs to: planted-fault calibration (``calibrate``) on a served
engine's in-process twin (``twin``), a battery mined for the cases that detect the most per second (``mine``), and
the cases a margin needs (``sizing``).

Imports: errors, identity, evidence, summaries, workspace, battery, engines, gate.stats, gate.kinds, gate.run, gate.enable,
gate.planning.
"""
