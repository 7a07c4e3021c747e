"""The gate's statistics, a leaf layer: arithmetic on outcomes, draws and distributions that imports nothing else of
the gate, so each bound can be read and tested alone. Paired bounds on a loss in pass rate (``paired``) over each
case's outcomes paired in their clusters (``pairs``), the anytime-valid sequential rule (``sequential``), the looks at
one change that spend its alpha (``looks``), what coupled sampled draws certify (``coupling``), each side's draws
against the declared decoding (``pit``), the teacher-forced distribution distance (``distance``) and sides compared
by their distributions where draws do not follow their keys (``unpaired``), and the guard's e-values on live
mismatch counts with the requests a rate needs to breach them (``evalues``).

Imports: identity, evidence, summaries, battery, engines.
"""
