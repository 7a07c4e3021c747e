"""What caching could win on a captured workload, from the prompts alone (no model needed).

Per stage: the byte-stable prefix (the bytes every call of the stage starts with) as a share of the
mean prompt, the bound on what a pinned stage prefix can serve; and, where the capture marks
segments, the cacheable share as written (the leading run of static segments) vs after the
static-first partition (every static segment moved ahead). Across consecutive requests, in the
whole trace and within each stream: how long a prefix each request shares with the one before it,
the bound on what a cache holding only the last request could serve.

Where the lines carry the server's telemetry (``gatekeeper proxy``), the prefill tax per stage too:
calls, prompt and cached tokens, prefill and decode seconds and the prefill share of model time,
each summed over the calls that report it (None when none does). Metadata-only lines (no text)
compare their prefix digests instead, so their shared prefixes are exact to ``capture.BLOCK`` bytes.

The load per stage and in all (``load``): request rate, calls in flight (p50/p95/max, from each call's
start and duration) and the prompt length distribution.

Percentiles are nearest-rank: of n sorted values, the p-th percentile is the value at rank
ceil(p/100 * n) (1-based), so every reported figure is a value that occurred; the median is p50.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Sequence, TypeVar

from ...cache.trie import common_prefix
from .capture import BLOCK, TELEMETRY, Request
from .load import load

SHORT, LONG = 512, 4096  # a shared prefix under SHORT is barely worth a lookup; LONG is a large win
PERCENTILES = (("p10", 10), ("p25", 25), ("median", 50), ("p75", 75), ("p90", 90))
_N = TypeVar("_N", int, float)


def percentile(ordered: Sequence[_N], p: float) -> _N:
    """Nearest-rank percentile of already sorted values."""
    rank = max(1, math.ceil(p / 100 * len(ordered)))
    return ordered[rank - 1]


def distribution(values: Sequence[_N]) -> dict[str, _N] | None:
    if not values:
        return None
    ordered = sorted(values)
    return {"min": ordered[0], **{name: percentile(ordered, p) for name, p in PERCENTILES}, "max": ordered[-1]}


def common_prefix_all(seqs: Sequence[Sequence]) -> int:
    """Length of the prefix every sequence starts with."""
    n = min(len(s) for s in seqs)
    for other in seqs[1:]:
        n = common_prefix(seqs[0][:n], other)
    return n


def _share(part: float, whole: float) -> float | None:
    return round(part / whole, 4) if whole else None


def _cacheable(r: Request) -> tuple[int, int]:
    """(as written, partitioned) cacheable units of one request; regions no segment covers count as dynamic."""
    leading = 0
    for s in sorted(r.segments or [], key=lambda s: s.start):
        if not s.static or s.start > leading:
            break
        leading = max(leading, s.end)
    return leading, sum(s.end - s.start for s in r.segments or [] if s.static)


def _nbytes(r: Request) -> int:
    return len(r.text.encode()) if r.text is not None else r.size or 0


def _bytes_view(requests: Sequence[Request]) -> tuple[list[Sequence], int] | None:
    """Each request as a sequence whose common prefixes count bytes: the text's bytes (unit 1), or
    a metadata-only line's prefix digests (unit ``BLOCK``); None when the lines have neither throughout."""
    if all(r.text is not None for r in requests):
        return [r.text.encode() for r in requests], 1  # type: ignore[union-attr]
    if all(r.blocks is not None for r in requests):
        return [r.blocks for r in requests], BLOCK  # type: ignore[misc]
    return None


def telemetry(requests: Sequence[Request]) -> dict[str, Any] | None:
    """The prefill tax the server reported for these calls; None when no line carries telemetry."""
    reported = [r.telemetry for r in requests if any(v is not None for v in r.telemetry.to_dict().values())]
    if not reported:
        return None
    sums = {}
    for key in TELEMETRY:
        values = [getattr(t, key) for t in reported if getattr(t, key) is not None]
        sums[key] = (round(sum(values), 6) if key.endswith("_s") else sum(values)) if values else None
    both = [t for t in reported if t.prefill_s is not None and t.decode_s is not None]
    prefill = sum(t.prefill_s for t in both)  # type: ignore[misc]
    return {"calls": len(requests), "calls_reported": len(reported), **sums,
            "prefill_share": _share(prefill, prefill + sum(t.decode_s for t in both)) if both else None}  # type: ignore[misc]


def stage(requests: Sequence[Request]) -> dict[str, Any]:
    out: dict[str, Any] = {"calls": len(requests)}
    view = _bytes_view(requests)
    if view is not None:
        seqs, unit = view
        sizes = [_nbytes(r) for r in requests]
        mean = sum(sizes) / len(sizes)
        stable = min(common_prefix_all(seqs) * unit, min(sizes))
        out.update(mean_prompt_bytes=round(mean, 2), stable_prefix_bytes=stable, byte_stable_share=_share(stable, mean))
    else:
        out.update(mean_prompt_bytes=None, stable_prefix_bytes=None, byte_stable_share=None)
    if all(r.tokens is not None for r in requests):
        tokens = [r.tokens for r in requests]
        out.update(mean_prompt_tokens=round(sum(map(len, tokens)) / len(tokens), 2),  # type: ignore[arg-type]
                   stable_prefix_tokens=common_prefix_all(tokens))  # type: ignore[arg-type]
    if all(r.segments is not None for r in requests):
        written, partitioned = map(sum, zip(*(_cacheable(r) for r in requests)))
        total = sum(r.length for r in requests)
        out["cacheable_share"] = {"as_written": _share(written, total), "partitioned": _share(partitioned, total)}
    else:
        out["cacheable_share"] = None
    out["telemetry"] = telemetry(requests)
    out["load"] = load(requests)
    out["prompt_length"] = prompt_lengths(requests)
    return out


def prompt_lengths(requests: Sequence[Request]) -> dict[str, Any] | None:
    """The distribution of prompt lengths: tokens where every line has them, else UTF-8 bytes."""
    if all(r.tokens is not None for r in requests):
        unit, values = "tokens", [len(r.tokens) for r in requests]  # type: ignore[arg-type]
    elif all(r.text is not None or r.size is not None for r in requests):
        unit, values = "bytes", [_nbytes(r) for r in requests]
    else:
        return None
    return {"unit": unit, **distribution(values), "p95": percentile(sorted(values), 95)}  # type: ignore[dict-item]


def _unit(requests: Sequence[Request]) -> str | None:
    if all(r.tokens is not None for r in requests):
        return "tokens"
    if _bytes_view(requests) is not None:
        return "bytes"
    return None  # a mix of token-only and text-only lines has no common unit


def _prefix(a: Request, b: Request, unit: str) -> int:
    if unit == "tokens":
        return common_prefix(a.tokens, b.tokens)  # type: ignore[arg-type]
    if a.text is not None and b.text is not None:
        return common_prefix(a.text.encode(), b.text.encode())
    return min(common_prefix(a.blocks, b.blocks) * BLOCK, _nbytes(a), _nbytes(b))  # type: ignore[arg-type]


def consecutive(groups: Sequence[Sequence[Request]], unit: str) -> dict[str, Any]:
    """Each request's common prefix with the one before it in its group; the first of a group reuses nothing."""
    lcps = [_prefix(a, b, unit) for g in groups for a, b in zip(g, g[1:])]
    total = sum(r.length if unit == "tokens" else _nbytes(r) for g in groups for r in g)  # unit tokens: every request has them
    return {
        "pairs": len(lcps),
        "common_prefix": distribution(lcps),
        f"share_under_{SHORT}": _share(sum(n < SHORT for n in lcps), len(lcps)),
        f"share_at_least_{LONG}": _share(sum(n >= LONG for n in lcps), len(lcps)),
        "reusable": sum(lcps),
        "prompt_total": total,
        "reusable_share": _share(sum(lcps), total),
    }


def analyze(requests: Sequence[Request]) -> dict[str, Any]:
    """The report for a capture; requests are taken in time order (file order breaks ties)."""
    ordered = sorted(requests, key=lambda r: (r.t, r.line))
    by_stage: dict[str, list[Request]] = defaultdict(list)
    by_stream: dict[str, list[Request]] = defaultdict(list)
    for r in ordered:
        by_stage[r.stage].append(r)
        by_stream[r.stream].append(r)
    unit = _unit(ordered)
    return {
        "requests": len(ordered),
        "streams": len(by_stream),
        "stages": {name: stage(rs) for name, rs in by_stage.items()},
        "telemetry": telemetry(ordered),
        "load": load(ordered),
        "unit": unit,
        "consecutive": None if unit is None else {
            "global": consecutive([ordered], unit),
            "per_stream": consecutive(list(by_stream.values()), unit),
        },
    }
