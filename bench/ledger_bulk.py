"""Build a guarded flag's ledger of a million entries quickly, for bench/ledger.py: what the guard leaves after months.

A workspace whose ``prefix_cache`` flag is on (an evaluation PASSed, approved, flipped on, a checkpoint recorded), all
by the ledger's own appends, then one shadow batch appended the real way; the rest of the batches are copies of that
one (new id, seq, prev_hash and hash, computed as ``chain.append`` computes them) written in one transaction per
chunk, straight to SQLite. PostgreSQL gets the very same rows, ids and hashes, copied from that file with COPY. The
bench then verifies each with ``--full``: a bulk row that is not what the real append writes would fail it.
"""

from __future__ import annotations

import hashlib
import sqlite3
from pathlib import Path
from typing import Iterator

from gatekeeper.identity import canonical_json

FLAG = "prefix_cache"
SUMMARY = {"requests": 40, "shadowed": 4, "stages": {"router": {"compared": 3, "mismatches": 0, "unpaired": 0},
                                                    "answer": {"compared": 1, "mismatches": 0, "unpaired": 0}},
           "unpaired": {}, "dropped": {}, "shapes": {"chat": 4}, "proxy": "bench:1"}
CHUNK = 50_000


def workspace(root: Path, key_pub: str) -> None:
    """The workspace, with a guard section in the flag's policy and the guard's key allowed."""
    from gatekeeper.setup.scaffold import init_workspace

    init_workspace(root)
    policy = root / "policies" / f"{FLAG}.yaml"
    policy.write_text(policy.read_text() + "guard: {rate: 0.1, assertions: false}\n")
    (root / "policies" / "allowed_signers").write_text(f"guard {key_pub}\n")


def checkpoint(root: Path, url: str) -> None:
    """The ledger's head recorded in the workspace, as the policy's checkpoint_after_flip does."""
    from gatekeeper.ledger import Ledger
    from gatekeeper.ledger import checkpoint as cp
    from gatekeeper.workspace import Workspace

    with Ledger(url) as ledger:
        cp.record(cp.make(ledger, cp.location(url, root)), Workspace(root))


def flag_on(url: str) -> None:
    """The flag on, by the real appends: an evaluation that PASSed, an approval, the flip."""
    from gatekeeper.ledger import Ledger

    identity = {"off": {"model_digest": "m1", "flags": {FLAG: "off"}}, "on": {"model_digest": "m1", "flags": {FLAG: "on"}}}
    with Ledger(url) as ledger:
        ev = ledger.start_evaluation(FLAG, "ci", "byte_equivalence", identity, {"engine": "bench"})
        ledger.finish_evaluation(ev, "PASS", [], {"cases": 1})
        approval = ledger.add_approval(FLAG, ev, "bob", "reviewed")
        ledger.add_flip(FLAG, "on", "ana", "reviewed", evaluation_id=ev, approval_ids=[approval])


def add_batches(url: str, n: int) -> None:
    """``n`` shadow batches of the flag's flip to on, each by the real append."""
    from gatekeeper.ledger import Ledger

    with Ledger(url) as ledger:
        flip = ledger.flag_states()[FLAG]["id"]
        for _ in range(n):
            ledger.add_shadow(FLAG, flip, "guard", SUMMARY, [])  # type: ignore[arg-type]


def bulk(db: Path, n: int) -> None:
    """Append ``n`` copies of the newest shadow batch to the SQLite ledger ``db``, chained as ``chain.append`` does."""
    from gatekeeper.ledger.chain import entry_hash
    from gatekeeper.ledger.records import decode

    conn = sqlite3.connect(db, isolation_level=None)
    conn.row_factory = sqlite3.Row
    tpl = dict(conn.execute("SELECT * FROM shadow ORDER BY id DESC LIMIT 1").fetchone())
    last = conn.execute("SELECT seq, hash FROM entry ORDER BY seq DESC LIMIT 1").fetchone()
    payload = decode("shadow", tpl)
    # The payload's canonical text around its id, and the entry's around its own fields: one string per row, not a dump
    text = canonical_json(payload).decode()
    marker = f',"id":{tpl["id"]},'
    assert text.count(marker) == 1, "the template's id is not where canonical JSON puts it"
    head, tail = text.split(marker)
    columns = list(tpl)
    rid, seq, prev = tpl["id"], last["seq"], last["hash"]

    def rows(count: int) -> Iterator[tuple[tuple, tuple]]:
        nonlocal rid, seq, prev
        for _ in range(count):
            rid, seq = rid + 1, seq + 1
            ptext = f'{head},"id":{rid},{tail}'
            h = hashlib.sha256(f'{{"kind":"shadow","payload":{ptext},"prev_hash":"{prev}","record_id":{rid},"seq":{seq}}}'
                               .encode()).hexdigest()
            yield tuple(rid if c == "id" else tpl[c] for c in columns), (seq, prev, "shadow", rid, ptext, h)
            prev = h

    done = 0
    while done < n:
        chunk = list(rows(min(CHUNK, n - done)))
        if done == 0:  # the string-built hash is the one chain.entry_hash gives
            (_, e) = chunk[0]
            assert e[5] == entry_hash(e[0], e[1], "shadow", e[3], {**payload, "id": e[3]}), "bulk hash differs"
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany(f"INSERT INTO shadow ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})",
                         [r for r, _ in chunk])
        conn.executemany("INSERT INTO entry (seq, prev_hash, kind, record_id, payload, hash) VALUES (?, ?, ?, ?, ?, ?)",
                         [e for _, e in chunk])
        conn.execute("COMMIT")
        done += len(chunk)
    conn.close()


def to_postgres(db: Path, url: str) -> None:
    """Copy every row of the SQLite ledger ``db`` into the new PostgreSQL ledger at ``url`` (its migrations run by
    opening it), ids and hashes as they are, with COPY; then move the id sequences past them, as ``ledger copy`` does."""
    from sqlalchemy import Boolean

    from gatekeeper.ledger import Ledger
    from gatekeeper.ledger.tables import KINDS, Entry

    Ledger(url).close()  # the schema
    src = sqlite3.connect(db)
    with Ledger(url) as ledger:
        raw = ledger.engine.raw_connection()
        try:
            pg = raw.driver_connection
            with pg.cursor() as cur:  # type: ignore[union-attr]
                for table, model in (*KINDS.items(), ("entry", Entry)):
                    columns = [c.name for c in model.__table__.c]  # type: ignore[attr-defined]
                    flags = [isinstance(c.type, Boolean) for c in model.__table__.c]  # type: ignore[attr-defined]
                    with cur.copy(f"COPY {table} ({', '.join(columns)}) FROM STDIN") as copy:
                        for row in src.execute(f"SELECT {', '.join(columns)} FROM {table}"):
                            copy.write_row([bool(v) if f and v is not None else v for v, f in zip(row, flags)])
                for kind in KINDS:
                    cur.execute(f"SELECT setval(pg_get_serial_sequence('{kind}', 'id'), COALESCE(MAX(id), 1), "
                                f"MAX(id) IS NOT NULL) FROM {kind}")
            pg.commit()  # type: ignore[union-attr]
        finally:
            raw.close()
    src.close()
