"""The battery: suites as the gate runs them. Reading them (gatekeeper YAML suites and promptfoo configs,
one home: ``suites``, with promptfoo's configs read as promptfoo reads them in ``promptfoo/``), rendering their
prompts as written or static-first (``partition``), and checking assertions on outputs (``checks``, with promptfoo's
meaning for the types both share; model-graded ones in ``graded``, embedding similarity in ``similar``, text metrics
in ``scored``, the suite's own code in ``scripted``, and a suite's ``transform`` of the output before its assertions;
every type each of these families evaluates declared once, in the registry ``types``).

Imports: errors, evidence, identity, workspace, js, cache, setup.
"""
