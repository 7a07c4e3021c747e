"""A radix trie over token sequences: which stored sequence shares the longest prefix with a query.

Edges hold runs of tokens rather than one token each, so a few long prompts cost a few nodes,
not one node per token. A run is a slice of what was inserted: a tuple, or a C array of ids
(``packed``: 8 bytes a token, where a tuple costs a pointer and an int object, about 36), which keeps
a trie of every prompt a server has seen in memory.
"""

from __future__ import annotations

from array import array
from typing import Any, Generic, Iterator, Sequence, TypeVar, cast

V = TypeVar("V")


class _Node(Generic[V]):
    __slots__ = ("edge", "children", "value", "depth")

    def __init__(self, edge: tuple[int, ...] | array, depth: int, value: V | None = None):
        self.edge = edge  # the tokens on the way in from the parent
        self.depth = depth  # tokens from the root to the end of this node's edge
        self.children: dict[int, _Node[V]] = {}
        self.value = value


def packed(tokens: Sequence[int]) -> array:
    """Token ids as a C array: what a trie of millions of prompts should be given."""
    return tokens if isinstance(tokens, array) and tokens.typecode == "q" else array("q", tokens)


def _like(edge: tuple[int, ...] | array, run: Sequence[int]) -> tuple[int, ...] | array:
    """``run`` as the same kind of sequence as ``edge``, so that the two compare (and join) in C."""
    if type(run) is type(edge):
        return run  # type: ignore[return-value]
    return array("q", run) if isinstance(edge, array) else tuple(run)


def _shared(edge: tuple[int, ...] | array, tokens: Sequence[int], start: int) -> int:
    """How many leading tokens of ``edge`` equal ``tokens[start:]``."""
    n = min(len(edge), len(tokens) - start)
    if _like(edge, tokens[start : start + n]) == edge[:n]:  # the common case, compared in C
        return n
    k = 0
    while k < n and edge[k] == tokens[start + k]:
        k += 1
    return k


class TokenTrie(Generic[V]):
    """Maps token sequences to values; every leaf holds a value (empty branches are pruned)."""

    def __init__(self) -> None:
        self._root: _Node[V] = _Node((), 0)
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def insert(self, tokens: Sequence[int], value: V) -> None:
        if not isinstance(tokens, (tuple, array)):
            tokens = tuple(tokens)  # edges are slices of it: immutable, or a C array
        node, i, n = self._root, 0, len(tokens)
        while i < n:
            child = node.children.get(tokens[i])
            if child is None:
                node.children[tokens[i]] = _Node(tokens[i:], n, value)
                self._size += 1
                return
            k = _shared(child.edge, tokens, i)
            if k < len(child.edge):  # split the edge where the new sequence leaves it
                mid: _Node[V] = _Node(child.edge[:k], node.depth + k)
                child.edge = child.edge[k:]
                mid.children[child.edge[0]] = child
                node.children[tokens[i]] = mid
                child = mid
            node, i = child, i + k
        if node.value is None:
            self._size += 1
        node.value = value

    def get(self, tokens: Sequence[int]) -> V | None:
        path = self._path(tokens)
        return path[-1].value if path and path[-1].depth == len(tokens) else None

    def remove(self, tokens: Sequence[int]) -> V | None:
        path = self._path(tokens)
        if not path or path[-1].depth != len(tokens) or path[-1].value is None:
            return None
        node = path[-1]
        value, node.value = node.value, None
        self._size -= 1
        # Prune: drop a node left empty, then fold a valueless node with one child into it.
        for parent, node in zip(reversed(path[:-1]), reversed(path[1:])):
            if node.value is None and not node.children:
                del parent.children[node.edge[0]]
            elif node.value is None and len(node.children) == 1:
                (only,) = node.children.values()
                # the same kind on both sides (tuple + tuple, array + array), which mypy cannot pair up
                only.edge = node.edge + cast(Any, _like(node.edge, only.edge))
                parent.children[node.edge[0]] = only
            else:
                break
        return value

    def longest(self, tokens: Sequence[int]) -> tuple[int, V | None]:
        """(n, value): ``n`` is the longest prefix of ``tokens`` shared with any stored sequence,
        and ``value`` belongs to the shortest stored sequence that starts with those ``n`` tokens."""
        node, i = self._walk(tokens)
        if i == 0:
            return 0, None
        return i, min(self._values_under(node), key=lambda dv: dv[0])[1]

    def shared(self, tokens: Sequence[int]) -> int:
        """The longest prefix of ``tokens`` shared with any stored sequence: ``longest`` without
        looking for a value, so its cost is the query's length, not the matching subtree's size."""
        return self._walk(tokens)[1]

    def _walk(self, tokens: Sequence[int]) -> tuple["_Node", int]:
        """The deepest node ``tokens`` reaches (possibly part-way along its edge) and how many tokens matched."""
        node, i, n = self._root, 0, len(tokens)
        while i < n:
            child = node.children.get(tokens[i])
            if child is None:
                break
            k = _shared(child.edge, tokens, i)
            node, i = child, i + k
            if k < len(child.edge):
                break
        return node, i

    def prefixes(self, tokens: Sequence[int]) -> list[tuple[int, V]]:
        """Stored sequences that are prefixes of ``tokens`` (whole-entry matches), shortest first."""
        return [(node.depth, node.value) for node in self._path(tokens) if node.value is not None]

    def items(self) -> Iterator[tuple[int, V]]:
        return iter(self._values_under(self._root))

    # --- internals ------------------------------------------------------------------------------
    def _path(self, tokens: Sequence[int]) -> list[_Node[V]]:
        """Nodes whose whole edge lies on ``tokens``, root first."""
        path, node, i, n = [self._root], self._root, 0, len(tokens)
        while i < n:
            child = node.children.get(tokens[i])
            if child is None or _shared(child.edge, tokens, i) < len(child.edge):
                break
            node, i = child, i + len(child.edge)
            path.append(node)
        return path

    def _values_under(self, top: _Node[V]) -> list[tuple[int, V]]:
        out, stack = [], [top]
        while stack:
            node = stack.pop()
            if node.value is not None:
                out.append((node.depth, node.value))
            stack.extend(node.children.values())
        return out


def common_prefix(a: Sequence, b: Sequence) -> int:
    """How many leading items two sequences (token ids, text) share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
