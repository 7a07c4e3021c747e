"""Prefill plans: where a prompt's prefill is cut into forward passes.

In reduced precision the bits a forward pass writes into the KV state depend on its shape, so a
cache hit is exact only if the cold run computed the reused positions in the same passes. The
``aligned`` plan derives the cuts from the prompt alone (registered stage boundaries, then fixed
chunk steps after each), the same with the cache on or off, and the cache reuses states only at
cuts. ``monolithic`` prefills in one pass and lets a hit land anywhere.
"""

from __future__ import annotations

from typing import Iterable, Sequence


def splits(tokens: Sequence[int], boundaries: Iterable[Sequence[int]], chunk: int) -> list[int]:
    """Ascending positions in (0, len(tokens)) where an aligned prefill starts a new pass.

    Anchors are 0 and every boundary that is a proper prefix of ``tokens``; from each anchor the
    plan steps by ``chunk`` up to the next anchor. A cut depends only on the tokens before it, so
    two prompts that share their first n tokens share every cut below n: a state stored at a cut
    of one prompt sits at a cut of every prompt that shares it, computed in the same passes.
    """
    n = len(tokens)
    head = tuple(tokens)
    anchors = sorted({len(b) for b in boundaries if 0 < len(b) < n and head[: len(b)] == tuple(b)})
    out: list[int] = []
    for start, end in zip([0, *anchors], [*anchors, n]):
        out.extend(range(start + chunk, end, chunk))
        if end < n:
            out.append(end)
    return out


def segments(cuts: Sequence[int], start: int, end: int) -> list[tuple[int, int]]:
    """The passes that prefill positions [start, end): cut at every plan position in between."""
    edges = [start, *(c for c in cuts if start < c < end), end]
    return list(zip(edges, edges[1:]))
