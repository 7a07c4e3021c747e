"""The kinds of failure the CLI maps to exit codes."""


class GatekeeperError(Exception):
    """Bad input or configuration: the CLI prints the message and exits 2, having written nothing."""


class LedgerIntegrityError(GatekeeperError):
    """The ledger's chain or rows do not match: someone edited it."""


class LedgerReadError(Exception):
    """The database failed while the ledger was read without SQLAlchemy (``ledger.reader``); ``orig`` holds the
    driver's error, as SQLAlchemy's DBAPIError does, so a damaged file is reported the same either way."""

    def __init__(self, orig: Exception):
        super().__init__(str(orig))
        self.orig = orig
