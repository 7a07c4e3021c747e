"""The evidence ledger: append-only, hash-chained records in SQLite or PostgreSQL (any SQLAlchemy URL):
tables, migrations, the chain, verify, signed checkpoints, in-toto attestations in DSSE envelopes (intoto, dsse),
and the review export (which reads the gate's near-tie thresholds). What rows hold (``records``) and the
SQLite reader that ``status`` and ``hash`` use (``reader``) import no SQLAlchemy.

Imports: errors, identity, signing, cache, engines, gate.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gatekeeper.ledger.migrations import migrate
    from gatekeeper.ledger.records import CURRENT_VERSION
    from gatekeeper.ledger.store import Ledger, copy_ledger, open_ledger
    from gatekeeper.ledger.verify import VerifyReport

# Name -> the module that defines it, imported when the name is first used: importing the package
# (for ``records`` or ``reader``) must not import SQLAlchemy, which alone takes about 0.2 s.
_WHERE = {"CURRENT_VERSION": "records", "Ledger": "store", "VerifyReport": "verify", "copy_ledger": "store",
          "migrate": "migrations", "open_ledger": "store"}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)


__all__ = ["CURRENT_VERSION", "Ledger", "VerifyReport", "copy_ledger", "migrate", "open_ledger"]
