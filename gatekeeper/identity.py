"""Canonical JSON, content digests and (later) the pipeline-version hash.

Everything that names "what produced this output" goes through here, so two
machines that agree on the inputs agree on the bytes and therefore on the hash.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Any, Mapping

_CHUNK = 1 << 20  # stream files 1 MiB at a time: weights never sit in memory whole


def canonical_json(obj: Any) -> bytes:
    """Sorted keys, no whitespace, UTF-8: the one serialisation that gets hashed. A lone surrogate (a promptfoo
    needle may hold one, as JavaScript strings can) has no UTF-8: it is written as its JSON escape."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode(
        "utf-8", "backslashreplace")


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


def cache_home() -> Path:
    """$GATEKEEPER_HOME, else the user cache directory: where every set-up part is installed and found."""
    if os.environ.get("GATEKEEPER_HOME"):
        return Path(os.environ["GATEKEEPER_HOME"])
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("gatekeeper"))


def child_env(**overrides: str) -> dict[str, str]:
    """The environment for a process gatekeeper starts: this one's (``GATEKEEPER_HOME`` and the package clients'
    settings with it) plus ``overrides``; never one built from scratch, whose child would look in another home."""
    return {**os.environ, **overrides}


class Memo:
    """A small JSON map in the user cache that every process shares: read once per process, written
    whole (to a temporary file, then renamed) when something is added. Losing it costs a recomputation."""

    def __init__(self, name: str, keep: int = 4096):
        self.name, self.keep = name, keep
        self._data: dict[str, Any] | None = None
        self._where: Path | None = None

    @property
    def path(self) -> Path:
        return cache_home() / self.name

    def _loaded(self) -> dict[str, Any]:
        if self._data is None or self._where != self.path:
            self._where = self.path
            try:
                data = json.loads(self._where.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                data = {}
            self._data = data if isinstance(data, dict) else {}
        return self._data

    def get(self, key: str) -> Any:
        return self._loaded().get(key)

    def put(self, key: str, value: Any, stale=lambda key, value: False) -> None:
        """Add ``key``, dropping entries ``stale`` says are of no more use (and the oldest beyond ``keep``)."""
        self._data = None  # take in what other processes wrote since this one read it
        data = {k: v for k, v in self._loaded().items() if k != key and not stale(k, v)}
        data[key] = value
        self._data = data = dict(list(data.items())[-self.keep:])
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{self.name}.{os.getpid()}.{threading.get_ident()}")
            tmp.write_text(json.dumps(data), encoding="utf-8")
            os.replace(tmp, self.path)
        except OSError:
            pass  # a read-only cache: every process recomputes


_file_memo: dict[tuple[str, int, int, int], str] = {}
_DIGESTS = Memo("digests.json")


def _stat_key(p: Path) -> tuple[str, int, int, int]:
    # mtime can be set back by anyone (touch -d); ctime cannot, so a rewritten file is never taken for the old one
    st = p.stat()
    return str(p), st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _sha256_file(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def file_digest(path: str | os.PathLike, *, memo: bool = True) -> str:
    """Streaming SHA-256 of one file, memoized by (path, size, mtime, ctime) unless ``memo=False``
    (a check against tampering must read the bytes). Files of a MiB or more are remembered across
    processes too (``digests.json`` in the user cache), so a command that names a model does not
    re-read its weights."""
    p = Path(path).resolve()
    key = _stat_key(p)
    if memo and key not in _file_memo:
        known = _DIGESTS.get(key[0])
        if isinstance(known, list) and tuple(known[:3]) == key[1:]:
            _file_memo[key] = known[3]
    if not memo or key not in _file_memo:
        _file_memo[key] = _sha256_file(p)
        if key[1] >= _CHUNK:  # hashing a small file costs less than remembering it
            _DIGESTS.put(key[0], [*key[1:], _file_memo[key]], stale=lambda k, v: not os.path.exists(k))
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


def pipeline_parts(flags: Mapping[str, Any], engine: dict[str, Any], render: str, decoding: dict[str, Any]) -> dict[str, Any]:
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
