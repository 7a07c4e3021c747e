"""The two kinds of failure the CLI maps to exit codes."""


class GatekeeperError(Exception):
    """Bad input or configuration: the CLI prints the message and exits 2, having written nothing."""


class LedgerIntegrityError(GatekeeperError):
    """The ledger's chain or rows do not match: someone edited it."""
