"""The prefix cache: stored model states keyed by their tokens, reused by longest shared prefix.

Engine-agnostic: states are opaque and handled through the engine's ``StateOps``. A hit hands out
``ops.fork`` of the stored state, so the stored entry is never changed by the call that uses it.

Under an aligned prefill plan an entry also records its ``edges``: the positions where the passes
that computed it ended (its own length last). A hit then lands only where the query's cold run
would cut, with every pass before it the same, so the reused positions hold the cold run's bits.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

from .state import StateOps
from .trie import TokenTrie


@dataclass
class Entry:
    tokens: tuple[int, ...]
    state: Any
    nbytes: int
    pinned: bool = False
    edges: tuple[int, ...] | None = None  # where its prefill passes ended; None: not recorded (monolithic)

    @property
    def length(self) -> int:
        return len(self.tokens)


@dataclass
class Hit:
    """A private working state holding the first ``length`` tokens of the query."""

    state: Any
    length: int


class PrefixCache:
    """Longest-prefix reuse, LRU eviction by entry count and bytes, pinned entries never evicted.

    Pinned entries count toward both limits (they hold real memory) but are skipped by eviction.
    """

    def __init__(self, ops: StateOps, *, max_entries: int, max_bytes: int):
        self.ops = ops
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._trie: TokenTrie[Entry] = TokenTrie()
        self._lru: OrderedDict[tuple[int, ...], Entry] = OrderedDict()  # oldest first
        self.nbytes = 0
        self.pinned_bytes = 0  # kept as entries are pinned and dropped: summing them per store is quadratic

    def __len__(self) -> int:
        return len(self._lru)

    @property
    def entries(self) -> list[Entry]:
        """Least recently used first."""
        return list(self._lru.values())

    def get(self, tokens: Sequence[int]) -> Entry | None:
        return self._lru.get(tuple(tokens))

    # --- reuse ----------------------------------------------------------------------------------
    def lookup(self, tokens: Sequence[int], *, limit: int | None = None, at: Sequence[int] | None = None) -> Hit | None:
        """The longest stored prefix of ``tokens`` (at most ``limit`` tokens), as a private fork.

        ``at`` (ascending), when given, is the query's own plan cuts: the hit is the last of them
        up to which a stored entry was computed in the same passes, and the caller recomputes the
        rest. Without it the hit is the whole shared prefix.
        """
        limit = len(tokens) if limit is None else min(limit, len(tokens))
        if limit <= 0:
            return None
        shared, entry = self._trie.longest(tokens)
        if entry is not None and (n := self._usable(entry, min(shared, limit), at)):
            return self._restore(entry, n)
        # Else the longest entry that is itself a prefix of the query and can serve: a state that
        # cannot be cut back is usable only whole, and a deeper entry may have other passes.
        for length, whole in reversed(self._trie.prefixes(tokens[:limit])):
            if n := self._usable(whole, length, at):
                return self._restore(whole, n)
        return None

    def _usable(self, entry: Entry, n: int, at: Sequence[int] | None) -> int:
        """How many of ``entry``'s first ``n`` positions (shared with the query) may serve it; 0: none."""
        if at is not None:
            agreed = 0
            for mine, theirs in zip(at, entry.edges or ()):  # passes equal so far, ending at or before n
                if mine != theirs or mine > n:
                    break
                agreed = mine
            n = agreed
        return n if n > 0 and (n == entry.length or self.ops.trimmable(entry.state)) else 0

    def _restore(self, entry: Entry, n: int) -> Hit:
        """Hand out the first ``n`` positions of ``entry``; the one place a hit touches a state."""
        self._lru.move_to_end(entry.tokens)
        return Hit(self.ops.fork(entry.state, n), n)

    # --- storing --------------------------------------------------------------------------------
    def store(self, tokens: Sequence[int], state: Any, *, pinned: bool = False,
              edges: Sequence[int] | None = None) -> Entry | None:
        """Keep ``state`` (which covers exactly ``tokens``); returns the entry, or None if not kept.

        ``edges``: where the passes that computed it ended, ``len(tokens)`` last (aligned plans).
        The caller hands the state over: it must not run the model on it afterwards.
        """
        key = tuple(map(int, tokens))
        if not key:
            return None
        if self.ops.length(state) != len(key):
            raise ValueError(f"state covers {self.ops.length(state)} tokens, not {len(key)}")
        edges = tuple(edges) if edges is not None else None
        if edges is not None and (not edges or edges[-1] != len(key)):
            raise ValueError(f"edges {edges} must end at the state's length {len(key)}")
        old = self._lru.get(key)
        if old is not None:
            if pinned:
                self.pin(old)
            self._lru.move_to_end(key)
            return old
        trimmable = self.ops.trimmable(state)
        if not pinned and trimmable:
            shared, longer = self._trie.longest(key)
            if shared == len(key) and longer is not None and self.ops.trimmable(longer.state) and _covers(longer.edges, edges):
                self._lru.move_to_end(longer.tokens)  # a longer entry already covers these tokens
                return None
        entry = Entry(key, state, self.ops.nbytes(state), pinned, edges)
        if not pinned and entry.nbytes + self.pinned_bytes > self.max_bytes:  # could never fit beside the pinned entries
            return None
        if trimmable:
            # Shorter unpinned entries on the same path are now redundant: this one covers them.
            for _, shorter in self._trie.prefixes(key[:-1]):
                if not shorter.pinned and self.ops.trimmable(shorter.state) and _covers(edges, shorter.edges):
                    self._drop(shorter)
        self._trie.insert(key, entry)
        self._lru[key] = entry
        self.nbytes += entry.nbytes
        self.pinned_bytes += entry.nbytes if pinned else 0
        self._evict()
        return entry

    def _evict(self) -> None:
        while len(self._lru) > self.max_entries or self.nbytes > self.max_bytes:
            victim = next((e for e in self._lru.values() if not e.pinned), None)
            if victim is None:
                return  # only pinned entries left; they stay whatever the limits say
            self._drop(victim)

    def _drop(self, entry: Entry) -> None:
        self._trie.remove(entry.tokens)
        del self._lru[entry.tokens]
        self.nbytes -= entry.nbytes
        self.pinned_bytes -= entry.nbytes if entry.pinned else 0

    def pin(self, entry: Entry) -> None:
        """Keep ``entry`` whatever the limits say (it still counts toward them)."""
        if not entry.pinned:
            entry.pinned = True
            self.pinned_bytes += entry.nbytes

    def drop_covering(self, prefix: Sequence[int]) -> int:
        """Drop every entry (pinned too) that holds all of ``prefix``; how many were dropped.

        A new boundary changes the cuts of every prompt that starts with it, so states computed
        before it was known were cut otherwise: lookups would refuse them anyway, but they would
        hold memory, and one that equals the boundary would pass for its pinned state.
        """
        key = tuple(int(t) for t in prefix)
        stale = [e for e in self._lru.values() if e.length >= len(key) and e.tokens[: len(key)] == key]
        for entry in stale:
            self._drop(entry)
        return len(stale)

    def drop_longer(self, n: int) -> int:
        """Drop every unpinned entry holding more than ``n`` tokens; how many were dropped.

        The single-slot erase rule of snapshot stores (``snapshots.SnapshotStore.erase_above``).
        """
        stale = [e for e in self._lru.values() if not e.pinned and e.length > n]
        for entry in stale:
            self._drop(entry)
        return len(stale)

    def reset(self) -> None:
        """Drop every entry except pinned ones."""
        for entry in [e for e in self._lru.values() if not e.pinned]:
            self._drop(entry)

    def clear(self) -> None:
        for entry in list(self._lru.values()):
            self._drop(entry)


def _covers(longer: tuple[int, ...] | None, shorter: tuple[int, ...] | None) -> bool:
    """Whether an entry computed with passes ``longer`` serves every hit one with ``shorter`` would."""
    if longer is None or shorter is None:
        return longer is None and shorter is None
    return longer[: len(shorter)] == shorter
