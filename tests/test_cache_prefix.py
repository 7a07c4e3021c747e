"""The token trie and the prefix cache's bookkeeping, on a plain list-of-tokens state.

``ListState`` is a real (if trivial) model state: it records which tokens it covers, so a wrong
fork or a mutated entry shows up as wrong tokens. Model-backed checks live in test_engine_*.py.
"""

from __future__ import annotations

import random

import pytest

from gatekeeper.cache import PrefixCache, TokenTrie
from gatekeeper.cache.trie import packed


class ListState:
    def __init__(self, tokens, trimmable=True, width=8):
        self.tokens = list(tokens)
        self.can_trim = trimmable
        self.width = width  # bytes per position


class ListOps:
    def length(self, s):
        return len(s.tokens)

    def nbytes(self, s):
        return len(s.tokens) * s.width

    def trimmable(self, s):
        return s.can_trim

    def fork(self, s, n):
        assert s.can_trim or n == len(s.tokens)
        return ListState(s.tokens[:n], s.can_trim, s.width)


def make(max_entries=64, max_bytes=1 << 30):
    return PrefixCache(ListOps(), max_entries=max_entries, max_bytes=max_bytes)


def put(cache, tokens, **kw):
    return cache.store(tokens, ListState(tokens, **{k: v for k, v in kw.items() if k != "pinned"}), pinned=kw.get("pinned", False))


# --- the trie ----------------------------------------------------------------------------------


def test_trie_longest_prefix_and_prefixes():
    t: TokenTrie[str] = TokenTrie()
    t.insert([1, 2, 3, 4], "a")
    t.insert([1, 2, 5], "b")
    t.insert([1, 2], "c")
    assert len(t) == 3
    assert t.longest([1, 2, 3, 9]) == (3, "a")
    assert t.longest([1, 2, 5, 6]) == (3, "b")
    assert t.longest([1, 2]) == (2, "c")  # the shortest sequence that holds the match
    assert t.longest([1]) == (1, "c")
    assert t.longest([7, 1]) == (0, None)
    assert t.prefixes([1, 2, 3, 4, 5]) == [(2, "c"), (4, "a")]
    assert t.get([1, 2, 5]) == "b" and t.get([1, 2, 3]) is None


def test_trie_remove_prunes_and_merges():
    t: TokenTrie[str] = TokenTrie()
    for seq, v in [([1, 2, 3], "a"), ([1, 2, 4], "b"), ([1, 2], "c")]:
        t.insert(seq, v)
    assert t.remove([1, 2]) == "c"
    assert t.remove([1, 2]) is None
    assert t.remove([1, 2, 4]) == "b"
    assert len(t) == 1 and list(t.items()) == [(3, "a")]
    assert t.longest([1, 2, 4]) == (2, "a")
    assert t.remove([1, 2, 3]) == "a" and t.longest([1]) == (0, None)


@pytest.mark.parametrize("store, ask", [(tuple, tuple), (list, list), (packed, list), (packed, packed)])
def test_trie_matches_brute_force(store, ask):
    """Whatever sequences it is given: tuples, lists, and C arrays (what a trie of a whole capture holds)."""
    rng = random.Random(7)
    t: TokenTrie[tuple] = TokenTrie()
    stored: set[tuple] = set()
    for step in range(600):
        seq = tuple(rng.choice([1, 2, 3]) for _ in range(rng.randint(1, 7)))
        if rng.random() < 0.3 and stored:
            victim = rng.choice(sorted(stored))
            assert t.remove(store(victim)) == victim
            stored.discard(victim)
        else:
            t.insert(store(seq), seq)
            stored.add(seq)
        query = tuple(rng.choice([1, 2, 3]) for _ in range(rng.randint(1, 8)))

        def lcp(a, b):
            n = 0
            while n < min(len(a), len(b)) and a[n] == b[n]:
                n += 1
            return n

        best = max((lcp(s, query) for s in stored), default=0)
        depth, value = t.longest(ask(query))
        assert depth == best == t.shared(ask(query)), (step, query, stored)
        if best:
            assert value in stored and value[:best] == query[:best]
        assert len(t) == len(stored)
        assert [v for _, v in t.prefixes(ask(query))] == sorted((s for s in stored if query[: len(s)] == s), key=len)


# --- the cache ---------------------------------------------------------------------------------


def test_hit_is_a_trimmed_private_copy():
    c = make()
    put(c, [1, 2, 3, 4, 5])
    hit = c.lookup([1, 2, 3, 9, 9])
    assert hit.length == 3 and hit.state.tokens == [1, 2, 3]
    hit.state.tokens.append(9)  # the caller runs the model on its copy ...
    assert c.get([1, 2, 3, 4, 5]).state.tokens == [1, 2, 3, 4, 5]  # ... and the entry is unchanged


def test_limit_keeps_tokens_to_compute():
    c = make()
    put(c, [1, 2, 3])
    assert c.lookup([1, 2, 3], limit=2).length == 2
    assert c.lookup([1], limit=0) is None
    assert c.lookup([5, 6]) is None


def test_lru_eviction_by_entries():
    c = make(max_entries=2)
    put(c, [1, 1])
    put(c, [2, 2])
    c.lookup([1, 1, 7])  # touch [1, 1]: now [2, 2] is the oldest
    put(c, [3, 3])
    assert [e.tokens for e in c.entries] == [(1, 1), (3, 3)]


def test_eviction_by_bytes_keeps_total_under_limit():
    c = make(max_bytes=100)
    for i in range(10):
        put(c, [i] * 5)  # 40 bytes each
        assert c.nbytes <= 100
        assert c.nbytes == sum(e.nbytes for e in c.entries)
    assert len(c) == 2
    assert put(c, [99] * 20) is None  # 160 bytes can never fit


def test_pinned_entries_survive_pressure_and_reset():
    c = make(max_entries=2, max_bytes=200)
    put(c, [7, 7, 7], pinned=True)
    for i in range(8):
        put(c, [i, i, i, i])
    assert c.get([7, 7, 7]).pinned
    assert c.lookup([7, 7, 7, 1]).length == 3
    c.reset()
    assert [e.tokens for e in c.entries] == [(7, 7, 7)]
    c.clear()
    assert len(c) == 0 and c.nbytes == 0


def test_chaining_supersedes_shorter_entries():
    c = make()
    put(c, [1, 2, 3])
    put(c, [1, 2, 3, 4, 5])  # the next turn extends the transcript
    assert [e.tokens for e in c.entries] == [(1, 2, 3, 4, 5)]
    assert put(c, [1, 2, 3, 4]) is None  # already covered by the longer entry
    assert len(c) == 1
    put(c, [1, 2], pinned=True)  # a pinned prefix is kept even though covered
    assert len(c) == 2


def test_untrimmable_states_are_reused_only_whole():
    c = make()
    put(c, [1, 2, 3, 4], trimmable=False)
    put(c, [1, 2], trimmable=False)
    hit = c.lookup([1, 2, 3, 9])
    assert hit.length == 2 and hit.state.tokens == [1, 2]
    assert c.lookup([1, 2, 3, 4, 5]).length == 4
    assert len(c) == 2  # no supersession either: the shorter one is still the only way in at 2


def test_store_rejects_a_state_of_the_wrong_length():
    with pytest.raises(ValueError):
        make().store([1, 2, 3], ListState([1, 2]))


def test_pinned_bytes_follow_pins_stores_and_drops():
    rng = random.Random(3)
    c = make(max_entries=6, max_bytes=8 * 40)
    for _ in range(300):
        tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 9))]
        if rng.random() < 0.2 and (entry := c.get(tokens)) is not None:
            c.pin(entry)
        else:
            c.store(tokens, ListState(tokens, trimmable=rng.random() < 0.7), pinned=rng.random() < 0.1)
        if rng.random() < 0.05:
            c.drop_covering(tokens[:2]) if rng.random() < 0.5 else c.reset()
        assert c.pinned_bytes == sum(e.nbytes for e in c.entries if e.pinned)
