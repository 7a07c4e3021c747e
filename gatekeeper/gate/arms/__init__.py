"""The arms that add evidence beside the battery's own comparison: the cache probes every run ends with (``probes``),
crashes as evidence (``crashes``), the controls that show a sampled evaluation can say no (``controls``), the
reference arm, each side read again with no cache object (``reference``), and its independent second reader
(``independent``), and the teacher-forced distance between the sides (``forced``).

Imports: errors, identity, evidence, summaries, workspace, battery, engines, gate.stats, gate.kinds, gate.run.
"""
