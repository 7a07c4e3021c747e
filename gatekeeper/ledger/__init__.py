"""The evidence ledger: append-only, hash-chained records in SQLite or PostgreSQL (any SQLAlchemy URL):
tables, migrations, the chain, verify, signed checkpoints, in-toto attestations in DSSE envelopes (intoto, dsse),
and the review export (which reads the gate's near-tie thresholds).

Imports: errors, identity, signing, cache, engines, gate.
"""

from gatekeeper.ledger.migrations import CURRENT_VERSION, migrate
from gatekeeper.ledger.store import Ledger, copy_ledger, open_ledger
from gatekeeper.ledger.verify import VerifyReport

__all__ = ["CURRENT_VERSION", "Ledger", "VerifyReport", "copy_ledger", "migrate", "open_ledger"]
