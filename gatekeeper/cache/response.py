"""The response cache: answers keyed by (pipeline-version hash, stage, rendered-prompt digest).

The hash covers flag states and model/adapter identity, so an answer made under one
enablement state is never served under another. It is a cache, not evidence: plain SQLite
in the user cache, rows may be purged.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

_SCHEMA = """
CREATE TABLE IF NOT EXISTS response (
    pipeline_hash TEXT NOT NULL, stage TEXT NOT NULL, prompt_digest TEXT NOT NULL,
    model_digest TEXT, adapter_digest TEXT, result TEXT NOT NULL,
    PRIMARY KEY (pipeline_hash, stage, prompt_digest));
CREATE TABLE IF NOT EXISTS seen (
    workspace TEXT PRIMARY KEY, model_digest TEXT, adapter_digest TEXT);
"""


class ResponseCache:
    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(path, timeout=30, isolation_level=None)
        self.db.execute("PRAGMA journal_mode = WAL")
        self.db.executescript(_SCHEMA)

    def get(self, pipeline_hash: str, stage: str, prompt_digest: str) -> dict[str, Any] | None:
        row = self.db.execute("SELECT result FROM response WHERE pipeline_hash=? AND stage=? AND prompt_digest=?",
                              (pipeline_hash, stage, prompt_digest)).fetchone()
        return json.loads(row[0]) if row else None

    def put(self, pipeline_hash: str, stage: str, prompt_digest: str, result: dict[str, Any],
            model_digest: str | None, adapter_digest: str | None) -> None:
        self.db.execute("INSERT OR REPLACE INTO response VALUES (?, ?, ?, ?, ?, ?)",
                        (pipeline_hash, stage, prompt_digest, model_digest, adapter_digest, json.dumps(result)))

    def last_seen(self, workspace: str) -> tuple[str | None, str | None] | None:
        row = self.db.execute("SELECT model_digest, adapter_digest FROM seen WHERE workspace=?", (workspace,)).fetchone()
        return (row[0], row[1]) if row else None

    def mark_seen(self, workspace: str, model_digest: str | None, adapter_digest: str | None) -> None:
        self.db.execute("INSERT OR REPLACE INTO seen VALUES (?, ?, ?)", (workspace, model_digest, adapter_digest))

    def purge(self, model_digest: str | None, adapter_digest: str | None) -> int:
        """Drop every answer made with this model/adapter pair; returns how many."""
        cur = self.db.execute("DELETE FROM response WHERE model_digest IS ? AND adapter_digest IS ?",
                              (model_digest, adapter_digest))
        return cur.rowcount

    def close(self) -> None:
        self.db.close()
