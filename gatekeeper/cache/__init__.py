"""Caches of model state: the prefix cache (token trie, pinned prefixes, chaining), hybrid-model
snapshots, the response cache, and the recipe and result layers that persist pinned prefixes.

Imports: errors, identity.
"""

from .prefix import Entry, Hit, PrefixCache
from .state import StateOps
from .trie import TokenTrie

__all__ = ["Entry", "Hit", "PrefixCache", "StateOps", "TokenTrie"]
