"""Reuse across requests: what a server could have re-used of everything it had seen, and why it did not.

A server's log shows, per request, its prompt size and what it re-used, but no token ids, so the
longest prefix a request shares with *any* earlier request (whichever slot served it) needs the
prompts themselves: a capture of the same traffic beside the log (``gatekeeper proxy``, with text,
writes ``tokens``). Each request of the log is matched to the first unmatched capture line, in
time order, of the same prompt length (and the same re-used count where both show it).

Per request: ``shared``, the longest prefix shared with any earlier request (a token trie, so the
cost is each prompt's length, whatever the traffic); ``possible``, that less the one token every
request computes, or what the server re-used if more (its cache also held generated tokens). A
share below one ``unit`` is a chat header in common by chance, not reuse. What was lost
(possible - re-used) is put down to, in this order:

- what the request's own slot held (or the prompt it loaded from the host cache), when at least a
  unit, yet was not re-used: ``forced`` (the server said so; its reason is quoted),
  ``checkpoint_spacing`` (it restored a checkpoint below the shared prefix) or ``unexplained``;
- ``other_slot``: the part another slot held at the time;
- ``evicted``: the rest, which no slot held any more: requests in between had replaced it.
"""

from __future__ import annotations

from collections import Counter, deque
from itertools import islice
from pathlib import Path
from typing import Any, NamedTuple, Sequence

from ...cache.trie import TokenTrie, packed
from ...errors import GatekeeperError
from ..captures import capture

UNIT = 256  # tokens: the granularity reuse is counted in, and the advice's checkpoint spacing
WINDOW = 256  # capture lines looked ahead for a request's match (concurrent requests finish out of order)
# ``calls`` below are forensics.Call records (typed as Any: forensics imports this module)
CAUSES = ("evicted", "other_slot", "checkpoint_spacing", "forced", "unexplained")
NEEDS = ("reuse across requests and advice: the server's log holds no token ids; pass --capture FILE, "
         "a capture of the same traffic with token ids ('gatekeeper proxy' without --no-text)")


class Prompt(NamedTuple):
    tokens: Sequence[int]  # a C array (trie.packed): a capture of millions of prompts stays in memory
    stage: str


class _Line(NamedTuple):
    t: float
    tokens: Sequence[int]
    stage: str
    cached: int | None


def prompts(path: str | Path, calls: Sequence[Any]) -> list[Prompt | None]:
    """Each request's prompt from the capture at ``path``, None where no line matches."""
    lines = sorted((_Line(r.t, packed(r.tokens), r.stage, r.telemetry.cached_tokens)
                    for r in capture.requests(path, content=False) if r.tokens is not None), key=lambda r: r.t)
    if not lines:
        raise GatekeeperError(f"{path}: no line has 'tokens' (token ids), and the cross-request measure needs them; "
                              "capture with 'gatekeeper proxy' without --no-text, from a server with a /tokenize endpoint")
    if all(c.prompt_tokens is None for c in calls):
        raise GatekeeperError("the log shows no prompt sizes, so its requests cannot be matched to the capture's lines; "
                              "run the server with -lv 4 (or --verbose)")
    pending = deque(lines)
    out: list[Prompt | None] = []
    for call in calls:
        found = None
        if call.prompt_tokens is not None:
            for j, r in enumerate(islice(pending, WINDOW)):
                if len(r.tokens) == call.prompt_tokens and (r.cached is None or call.reused is None or r.cached == call.reused):
                    found = j
                    break
        if found is None:
            out.append(None)
            continue
        out.append(Prompt(pending[found].tokens, pending[found].stage))
        del pending[found]
    if not any(p is not None for p in out):
        raise GatekeeperError(f"{path}: none of its {len(lines)} prompts matches a request of the log by length; "
                              "pass the capture of the same server over the same time")
    return out


def lcp(a: Sequence[int], b: Sequence[int]) -> int:
    """Leading items two sequences share, found by halving with slice compares (C speed)."""
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while lo < hi:  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def measure(calls: Sequence[Any], ids: Sequence[Sequence[int] | None], unit: int = UNIT) -> dict[str, Any]:
    """Sets each matched call's ``shared``, ``possible`` and ``lost_to``; the totals."""
    seen: TokenTrie[bool] = TokenTrie()
    held: dict[int, Sequence[int]] = {}  # each slot's last prompt
    epoch = 0
    lost: Counter = Counter()
    reasons: Counter = Counter()
    possible = obtained = measured = 0
    for call, tokens in zip(calls, ids):
        if call.epoch != epoch:
            held, epoch = {}, call.epoch
        if tokens is None:
            continue
        shared = seen.shared(tokens)
        seen.insert(tokens, True)
        mine = held.get(call.slot)
        others = max((lcp(t, tokens) for s, t in held.items() if s != call.slot), default=0)
        held[call.slot] = tokens
        if call.reused is None:
            continue
        call.shared = shared
        top = min(shared, len(tokens) - 1)
        call.possible = max(call.reused, top if top >= unit else 0)
        # what the slot held: the log's own figure (its cache or the loaded prompt), else its last prompt
        here = call.lcp if call.lcp is not None else (lcp(mine, tokens) if mine else 0)
        here = min(here, call.possible) if here >= unit else 0
        others = min(others, call.possible) if others >= unit else 0
        parts: Counter[str] = Counter()
        if here > call.reused:
            cause = "forced" if call.forced else "checkpoint_spacing" if call.restored is not None else "unexplained"
            parts[cause] = here - call.reused
            if call.forced and call.reason:
                reasons[call.reason] += 1
        floor = max(here, call.reused)
        parts["other_slot"] = max(0, others - floor)
        parts["evicted"] = call.possible - max(floor, others)
        call.lost_to = {k: v for k, v in parts.items() if v > 0}
        lost.update(call.lost_to)
        measured += 1
        possible += call.possible
        obtained += call.reused
    return {
        "unit": unit,
        "requests": measured,
        "unmatched": sum(1 for t in ids if t is None),
        "possible": possible,
        "obtained": obtained,
        "lost": possible - obtained,
        "obtained_share": round(obtained / possible, 4) if possible else None,
        "lost_by_cause": {c: lost.get(c, 0) for c in CAUSES},
        "forced_reasons": dict(reasons),
        "silent": sum(c.silent(unit) for c in calls if c.shared is not None),
    }
