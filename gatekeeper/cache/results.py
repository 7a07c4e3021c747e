"""The result layer: pinned prefix states saved on this machine, so a restart skips their prefill.

A saved state is keyed by the content hash of its prefix tokens and the identity that computed it
(model and adapter digests, engine, libraries, dtype, device, prefill plan) together with the
plan's cuts: any change there misses the key and the state is recomputed. Each state is a safetensors
file beside a small JSON record holding the file's SHA-256; a file that no longer matches it was
altered and is recomputed. It is a cache, not evidence: anything here may be deleted.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Sequence

from safetensors import SafetensorError

from ..identity import digest, file_digest


def content_hash(tokens: Sequence[int]) -> str:
    """The prefix's identity in the recipe and in result keys: a digest of its token ids."""
    return digest([int(t) for t in tokens])


class ResultLayer:
    def __init__(self, root: Path, identity: dict[str, Any]):
        self.root = root
        self.identity = identity

    def _paths(self, tokens: Sequence[int], edges: Sequence[int] | None) -> tuple[Path, Path]:
        key = digest({"content": content_hash(tokens), "identity": self.identity,
                      "edges": list(edges) if edges is not None else None})
        return self.root / f"{key}.safetensors", self.root / f"{key}.json"

    def load(self, tokens: Sequence[int], edges: Sequence[int] | None,
             read: Callable[[Path], Any]) -> tuple[Any | None, str]:
        """The saved state and ``"loaded"``, or None and why not (``"missing"``, ``"tampered"``)."""
        data, meta = self._paths(tokens, edges)
        if not meta.exists() or not data.exists():
            return None, "missing"
        try:
            record = json.loads(meta.read_text())
        except (OSError, ValueError):  # unreadable, not UTF-8, not JSON: as good as altered
            return None, "tampered"
        if not isinstance(record, dict) or not isinstance(record.get("sha256"), str):
            return None, "tampered"
        if file_digest(data, memo=False) != record["sha256"]:
            return None, "tampered"
        # A file its reader cannot parse is recomputed; a bug in the reader surfaces. Parse failures:
        # a key the file lacks, safetensors' own error on a header or buffer, and mlx's loader errors
        # (mx.load, under load_prompt_cache, raises RuntimeError named by its C++ source:
        # "[load_safetensors] ...", "[read] ...", "[json.exception.parse_error.101] ...").
        try:
            return read(data), "loaded"
        except (KeyError, SafetensorError):
            return None, "tampered"
        except RuntimeError as e:
            if type(e) is RuntimeError and str(e).startswith("["):
                return None, "tampered"
            raise

    def save(self, tokens: Sequence[int], edges: Sequence[int] | None, state: Any,
             write: Callable[[Any, Path], None]) -> Path:
        data, meta = self._paths(tokens, edges)
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = data.with_name(f"{data.stem}.tmp{os.getpid()}.safetensors")
        write(state, tmp)
        os.replace(tmp, data)  # readers never see half a file
        record = {"content_hash": content_hash(tokens), "tokens": len(tokens), "sha256": file_digest(data, memo=False),
                  "model_digest": self.identity.get("model_digest"),
                  "adapter_digest": self.identity.get("adapter_digest"), "identity": self.identity}
        meta.write_text(json.dumps(record, sort_keys=True, indent=1))
        return data


def purge(root: Path, model_digest: str | None, adapter_digest: str | None) -> int:
    """Delete every saved state made with this model/adapter pair; returns how many."""
    gone = 0
    for meta in sorted(root.glob("*.json")) if root.is_dir() else []:
        try:
            record = json.loads(meta.read_text())
        except ValueError:
            record = {}
        if record.get("model_digest") == model_digest and record.get("adapter_digest") == adapter_digest:
            meta.with_suffix(".safetensors").unlink(missing_ok=True)
            meta.unlink(missing_ok=True)
            gone += 1
    return gone
