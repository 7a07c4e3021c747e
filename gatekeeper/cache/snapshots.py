"""Snapshots: reuse for model states that cannot be cut back (recurrent, linear-attention layers).

A hybrid model's state after p tokens serves a later prompt only whole: restore it, then compute
the rest. So *where* snapshots are taken decides what can ever be reused. Placement policies (the
engine profile's ``snapshots``), each also keeping the state at the prompt's end (what a server
slot holds, and what the next turn of a conversation extends):

- ``tail``: the last few prefill steps before the end (``TAIL_STEPS``), like a server's checkpoints;
- ``interval:N``: every N tokens;
- ``boundaries``: at each registered stage boundary the prompt starts with, pinned (never evicted,
  never erased).

A ``+erase`` suffix adds the single-slot rule some servers follow: a request deletes every
unpinned snapshot above the position it re-entered at, so one unrelated request wipes a
conversation's snapshots. It is there to reproduce that behaviour and compare against it.

Backend-agnostic: this module works on positions and token keys; states stay opaque behind the
engine's ``StateOps`` (a model's cache, or the simulator's token count), held in a ``PrefixCache``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from time import perf_counter
from typing import Any, Sequence

from .prefix import Entry, Hit, PrefixCache

TAIL_STEPS = 3  # snapshots kept at the prompt's last few prefill steps under ``tail``
KINDS = ("tail", "interval", "boundaries")
HELP = "'tail', 'boundaries' or 'interval:N' (N > 0), optionally followed by '+erase'"


@dataclass(frozen=True)
class Policy:
    kind: str  # tail | interval | boundaries
    every: int | None = None  # interval only
    erase: bool = False  # the single-slot erase rule

    @property
    def spec(self) -> str:
        base = f"interval:{self.every}" if self.kind == "interval" else self.kind
        return base + ("+erase" if self.erase else "")

    def __str__(self) -> str:
        return self.spec


def parse(spec: str) -> Policy:
    """A policy from its spelling; ValueError saying what is accepted."""
    if not isinstance(spec, str):
        raise ValueError(f"must be {HELP}")
    base, plus, suffix = spec.strip().partition("+")
    if plus and suffix != "erase":
        raise ValueError(f"unknown suffix '+{suffix}' in {spec!r}; must be {HELP}")
    kind, colon, arg = base.partition(":")
    if kind in ("tail", "boundaries") and not colon:
        return Policy(kind, None, bool(plus))
    if kind == "interval" and arg.isdigit() and int(arg) > 0:
        return Policy("interval", int(arg), bool(plus))
    raise ValueError(f"{spec!r} is not a placement policy; must be {HELP}")


@dataclass(frozen=True)
class Layout:
    """Where one prompt's prefill is cut and where it keeps snapshots.

    ``cuts``: the cold plan's pass edges, the same with the cache on or off (None under the
    monolithic plan: one pass when the cache is off). ``snaps``: position -> pinned, in (0, n].
    """

    cuts: list[int] | None
    snaps: dict[int, bool]

    def passes(self, cache: bool) -> list[int]:
        """Pass edges inside (0, n) for a run with the cache on or off: snapshots need an edge."""
        edges = set(self.cuts or ())
        if cache:
            edges |= set(self.snaps)
        return sorted(edges)

    def edges(self, position: int) -> tuple[int, ...] | None:
        """The passes a snapshot at ``position`` was computed in (aligned plans), for ``PrefixCache``."""
        if self.cuts is None:
            return None
        return (*[c for c in self.cuts if c < position], position)


def layout(policy: Policy, tokens: Sequence[int], boundaries: Sequence[int], *, chunk: int,
           aligned_cuts: Sequence[int] | None) -> Layout:
    """The layout of a prompt on a model whose state cannot be cut back.

    ``boundaries``: lengths of the registered stage prefixes this prompt starts with.
    ``aligned_cuts``: the aligned plan's cuts (``plan.splits``), or None under monolithic. Only
    positions derived from the prompt itself are added to an aligned plan (interval multiples), so
    the cache-off run is cut in the same places and a restore is bit-exact by construction.
    """
    n = len(tokens)
    extra: set[int] = set()
    if policy.kind == "interval":
        assert policy.every is not None  # parse() sets it for every interval policy
        extra = set(range(policy.every, n, policy.every))
    cuts = None if aligned_cuts is None else sorted(set(aligned_cuts) | extra)
    # The end: under an aligned plan its last cut (the prompt's partial last pass is one a longer
    # transcript's cold run would not make); under monolithic the prompt's end.
    end = (cuts[-1] if cuts else None) if cuts is not None else n
    if policy.kind == "tail":
        steps = cuts if cuts is not None else list(range(chunk, n, chunk))
        snaps = {p: False for p in steps[-TAIL_STEPS:]}
    elif policy.kind == "interval":
        snaps = dict.fromkeys(extra, False)
    else:
        snaps = {b: True for b in boundaries if 0 < b <= n}
    if end:
        snaps.setdefault(end, False)
    return Layout(cuts, snaps)


@dataclass
class SnapshotStats:
    """Running totals: snapshots taken and restored (time and bytes), and erased by the rule."""

    taken: int = 0
    take_s: float = 0.0
    bytes_taken: int = 0
    restored: int = 0
    restore_s: float = 0.0
    bytes_restored: int = 0
    erased: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class SnapshotStore:
    """Snapshots in a ``PrefixCache`` (LRU by entries and bytes, pinned never evicted), plus the
    placement policy and the erase rule. A restore hands out a private copy (``ops.fork``)."""

    def __init__(self, cache: PrefixCache, policy: Policy):
        self.cache = cache
        self.policy = policy
        self.stats = SnapshotStats()

    def restore(self, tokens: Sequence[int], *, limit: int, at: Sequence[int] | None) -> Hit | None:
        """The deepest snapshot on ``tokens`` (at most ``limit`` long, agreeing with the cuts ``at``)."""
        start = perf_counter()
        hit = self.cache.lookup(tokens, limit=limit, at=at)
        if hit is not None:
            self.stats.restored += 1
            self.stats.restore_s += perf_counter() - start
            self.stats.bytes_restored += self.cache.ops.nbytes(hit.state)
        if self.policy.erase:
            self.erase_above(hit.length if hit else 0)
        return hit

    def take(self, tokens: Sequence[int], state: Any, *, pinned: bool, edges: Sequence[int] | None) -> Entry | None:
        """Keep a copy of ``state`` (which covers exactly ``tokens``); the caller keeps computing on its own."""
        if (old := self.cache.get(tokens)) is not None:
            if pinned:
                self.cache.pin(old)
            return old  # already held: copying it again would only cost time
        start = perf_counter()
        copy = self.cache.ops.fork(state, len(tokens))
        entry = self.cache.store(tokens, copy, pinned=pinned, edges=edges)
        self.stats.taken += 1
        self.stats.take_s += perf_counter() - start
        self.stats.bytes_taken += self.cache.ops.nbytes(copy)
        return entry

    def erase_above(self, position: int) -> int:
        """The single-slot rule: drop every unpinned snapshot longer than ``position``."""
        gone = self.cache.drop_longer(position)
        self.stats.erased += gone
        return gone

    @property
    def held(self) -> int:
        return len(self.cache)

    @property
    def nbytes(self) -> int:
        return self.cache.nbytes
