"""What is in force: each flag's state and the power of its evidence, read from the ledger (``flags``), what each
flag switches (``switches``), and the pipeline those states make with its version hash (``pipeline``).

Imports: errors, identity, workspace, battery, gate.run.
"""
