"""Prefill plans: where a prompt's prefill is cut into forward passes.

In reduced precision the bits a forward pass writes into the KV state depend on its shape, so a
cache hit is exact only if every reused position was computed in the same pass as in the cold
run, and the hit ends where a cold pass ends. The ``aligned`` plan derives the cuts from the prompt
and the registered stage boundaries alone, the same with the cache on or off; the cache records
the cuts each stored state was computed with and serves a hit only where they agree with the
query's (``PrefixCache.lookup(at=...)``). ``monolithic`` prefills in one pass and lets a hit land
anywhere.
"""

from __future__ import annotations

from typing import Iterable, Sequence


def splits(tokens: Sequence[int], boundaries: Iterable[Sequence[int]], chunk: int) -> list[int]:
    """Ascending positions in (0, len(tokens)) where an aligned prefill starts a new pass.

    Every registered boundary the prompt starts with is a cut, and so is every ``chunk`` step
    after one, up to the next boundary. With no boundary the steps run from 0. A prompt that
    starts with a boundary computes everything before the first one in one pass: that pass is
    what the boundary's pinned state holds, and extra cuts there would only cost time (each pass
    streams every weight once). A prompt equal to a boundary is planned as one that extends it, so
    a pin is computed in exactly the passes of the prompts it serves.
    """
    n = len(tokens)
    head = tuple(tokens)
    anchors = sorted({len(b) for b in boundaries if 0 < len(b) <= n and head[: len(b)] == tuple(b)})
    starts = anchors or [0]
    out: list[int] = []
    for start, end in zip(starts, [*starts[1:], n]):
        if 0 < start < n:
            out.append(start)
        out.extend(range(start + chunk, end, chunk))
    return out


def segments(cuts: Sequence[int], start: int, end: int) -> list[tuple[int, int]]:
    """The passes that prefill positions [start, end): cut at every plan position in between."""
    edges = [start, *(c for c in cuts if start < c < end), end]
    return list(zip(edges, edges[1:]))
