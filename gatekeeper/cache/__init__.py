"""Caches of model state: the prefix cache (token trie, pinned prefixes, chaining) and its seams."""

from .prefix import Entry, Hit, PrefixCache
from .state import StateOps
from .trie import TokenTrie

__all__ = ["Entry", "Hit", "PrefixCache", "StateOps", "TokenTrie"]
