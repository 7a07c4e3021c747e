"""Caches of model state: the prefix cache (``prefix``: stored states reused by longest shared prefix, over a
token ``trie``, with pinned prefixes and chaining), what it needs of an engine's model state (``state``),
hybrid-model ``snapshots``, the ``response`` cache, and the layers that persist pinned prefixes: which prefixes are
pinned (``recipe``) and their states saved on this machine (``results``).

Imports: errors, identity.
"""

from .prefix import Entry, Hit, PrefixCache
from .state import StateOps
from .trie import TokenTrie

__all__ = ["Entry", "Hit", "PrefixCache", "StateOps", "TokenTrie"]
