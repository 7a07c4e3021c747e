"""What is in force: each flag's state and the power of its evidence, read from the ledger (``flags``), what each
flag switches (``switches``), the pipeline those states make with its version hash (``pipeline``), and which
requests a flag rolled out by steps serves on at the step in force (``rollout``).

Imports: errors, identity, summaries, shadows, workspace, battery, gate.run.
"""
