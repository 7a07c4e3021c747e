"""Canonical JSON, content digests and (later) the pipeline-version hash.

Everything that names "what produced this output" goes through here, so two
machines that agree on the inputs agree on the bytes and therefore on the hash.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

_CHUNK = 1 << 20  # stream files 1 MiB at a time: weights never sit in memory whole


def canonical_json(obj: Any) -> bytes:
    """Sorted keys, no whitespace, UTF-8: the one serialisation that gets hashed."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    """Nested mappings as one level of dotted paths (``{"a": {"b": 1}}`` -> ``{"a.b": 1}``), for naming what differs."""
    if isinstance(d, dict) and d:
        return {k: v for key, value in d.items() for k, v in flatten(value, f"{prefix}{key}.").items()}
    return {prefix.rstrip("."): d}


def digest(obj: Any) -> str:
    """SHA-256 of the canonical JSON of ``obj``."""
    return sha256_hex(canonical_json(obj))


_file_memo: dict[tuple[str, int, int], str] = {}


def file_digest(path: str | os.PathLike, *, memo: bool = True) -> str:
    """Streaming SHA-256 of one file, memoized by (path, size, mtime) unless ``memo=False``
    (a check against tampering must read the bytes: size and mtime can be put back)."""
    p = Path(path).resolve()
    st = p.stat()
    key = (str(p), st.st_size, st.st_mtime_ns)
    if not memo or key not in _file_memo:
        h = hashlib.sha256()
        with open(p, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
        _file_memo[key] = h.hexdigest()
    return _file_memo[key]


# Files of a model or adapter directory that cannot change what the model says.
_IRRELEVANT = {"README.md", ".gitattributes", "LICENSE", "gatekeeper.json"}


def directory_digest(path: str | os.PathLike) -> str:
    """Digest of every output-relevant file in a model/adapter directory.

    Covers weights, config, tokenizer and chat template: the relative path and
    content digest of each file, so a rename counts as a change too.
    """
    root = Path(path)
    if root.is_file():
        return file_digest(root)
    files = {
        p.relative_to(root).as_posix(): file_digest(p)
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name not in _IRRELEVANT and not any(part.startswith(".") for part in p.relative_to(root).parts)
    }
    if not files:
        raise FileNotFoundError(f"{root}: no files to digest")
    return digest(files)


# --- the pipeline-version hash -----------------------------------------------------------------

ENGINE_KEYS = ("engine", "engine_version", "libraries", "dtype", "device")


def pipeline_parts(flags: dict[str, str], engine: dict[str, Any], render: str, decoding: dict[str, Any]) -> dict[str, Any]:
    """Everything that decides what the pipeline answers, split into the parts a policy may hash."""
    return {
        "flags": dict(sorted(flags.items())),
        "model": engine.get("model_digest"),
        "adapter": engine.get("adapter_digest"),
        "engine": {k: engine.get(k) for k in ENGINE_KEYS},
        "render": render,
        "prefill": {k: engine.get(k) for k in ("prefill", "chunk") if k in engine},
        "decoding": decoding,
    }


def pipeline_hash(parts: dict[str, Any], include: list[str]) -> str:
    """SHA-256 over the included parts: it keys the response cache, so any change re-keys it."""
    return digest({k: parts[k] for k in include})
