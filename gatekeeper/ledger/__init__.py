"""The evidence ledger: append-only, hash-chained records in SQLite or PostgreSQL (any SQLAlchemy URL). The
one object that writes and reads it (``store``), its ``tables`` and numbered ``migrations``, the database
connections and write lock (``database``), appending to the hash ``chain``, proving nothing was edited
(``verify``), the ``mark`` of where the last good verify got to (the next checks only what came after), signed
``checkpoint`` files of its head, everything ``ledger verify`` checks as one result
(``audit``), an evaluation's status derived from its records (``status``), a cheap ``stamp`` of its state so
readers re-verify only on change, and in-toto attestations (``intoto``) in DSSE envelopes (``dsse``). What rows
hold (``records``) and the SQLite reader that ``status`` and ``hash`` use (``reader``) import no SQLAlchemy. It
stores and checks the evidence and decides nothing; the reports that read it are ``gatekeeper.reports``.

Imports: errors, evidence, summaries, shadows, identity, signing.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gatekeeper.ledger.audit import LedgerAudit, audit_ledger
    from gatekeeper.ledger.migrations import migrate
    from gatekeeper.ledger.records import CURRENT_VERSION
    from gatekeeper.ledger.store import Ledger, copy_ledger, open_ledger
    from gatekeeper.ledger.verify import VerifyReport

# Name -> the module that defines it, imported when the name is first used: importing the package
# (for ``records`` or ``reader``) must not import SQLAlchemy, which alone takes about 0.2 s.
_WHERE = {"CURRENT_VERSION": "records", "Ledger": "store", "LedgerAudit": "audit", "VerifyReport": "verify",
          "audit_ledger": "audit", "copy_ledger": "store", "migrate": "migrations", "open_ledger": "store"}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)


__all__ = ["CURRENT_VERSION", "Ledger", "LedgerAudit", "VerifyReport", "audit_ledger", "copy_ledger", "migrate",
           "open_ledger"]
