"""Replay a trace of requests through an engine under snapshot placement policies, and report.

A trace is a capture (``capture.py``: one request a line) or a built-in scenario. Each policy gets
an engine of its own with the cache on; each trace starts it empty. Per policy and trace the report
gives restores, forced full re-prefills (a request that shared at least ``FORCED_MIN`` tokens with an
earlier one but restored nothing: sharing a chat header by chance is not a loss), tokens reused, the reusable bound (per request, the longest prefix it shares
with any earlier request of the trace, less its last token, which is always computed), the share
of the bound realized, tokens re-done (bound - reused), snapshot bytes held and taken, the time
spent taking and restoring snapshots, and, on a real model, whether every output (token ids and
text) was byte-identical to the same profile's run with the cache off.

Each request's static prefix (its leading run of static segments) is registered as a stage
boundary before it is served, as the runtime registers stage prefixes.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from ...cache.snapshots import parse
from ...cache.trie import TokenTrie, common_prefix
from ...errors import GatekeeperError
from . import capture

SCENARIOS = ("interleave", "synthetic")
DEFAULT_POLICIES = ("tail+erase", "interval:1024+erase", "boundaries+erase", "tail", "interval:1024", "boundaries")
FORCED_MIN = 64  # a miss counts as a forced full re-prefill when at least this much was reusable
DETAIL = 100  # per-request rows in the report for traces up to this many requests
LOW, HIGH = 32, 256  # scenario token ids: ordinary ids in any real vocabulary


@dataclass(frozen=True)
class Item:
    """One request to replay: its prompt tokens and the length of its static prefix (0: none)."""

    stage: str
    stream: str
    tokens: tuple[int, ...]
    boundary: int = 0


# --- traces --------------------------------------------------------------------------------------


def _static_prefix(r: capture.Request) -> int:
    """End of the leading run of static segments, in the request's own unit; 0 when none."""
    end = 0
    for s in sorted(r.segments or [], key=lambda s: s.start):
        if not s.static or s.start != end:
            break
        end = s.end
    return end


def from_capture(path: str | Path, tokenize: Callable[[str], list[int]] | None) -> list[Item]:
    """The requests of a capture in time order; lines with only ``text`` need ``tokenize``."""
    items = []
    for r in sorted(capture.read(path), key=lambda r: r.t):
        end = _static_prefix(r)
        if r.tokens is not None:
            tokens = r.tokens
        elif tokenize is None:
            raise GatekeeperError(f"{path}:{r.line}: field 'tokens' is missing and the simulator has no tokenizer; "
                                  "capture token ids, or replay on a model engine (drop --simulate)")
        else:
            tokens = tokenize(r.text)  # type: ignore[arg-type]
            if end:  # a byte offset into the text: the tokens covering exactly those bytes
                head = r.text.encode()[:end].decode("utf-8", errors="ignore")  # type: ignore[union-attr]
                end = common_prefix(tokenize(head), tokens)
        if len(tokens) < 2:
            raise GatekeeperError(f"{path}:{r.line}: a prompt of {len(tokens)} token(s) cannot be replayed; "
                                  "each request needs at least 2 tokens")
        items.append(Item(r.stage, r.stream, tuple(tokens), end))
    return items


def _ids(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(LOW, HIGH) for _ in range(n))


def interleave(scale: float = 1.0, seed: int = 0) -> dict[str, list[Item]]:
    """The interleave scenario: prompt A (~4,500 tokens), C sharing A's first 56% (its static stage
    prefix) then diverging, B (~100 tokens) unrelated; sequences A->C and A->B->C, each from empty."""
    rng = random.Random(seed)
    n, b = max(8, round(4500 * scale)), max(4, round(100 * scale))
    shared = round(0.56 * n)
    a = _ids(rng, n)
    c = a[:shared] + _ids(rng, n - shared)
    other = _ids(rng, b)
    A, B, C = Item("chat", "conversation", a, shared), Item("other", "one-off", other), Item("chat", "conversation", c, shared)
    return {"A->C": [A, C], "A->B->C": [A, B, C]}


def synthetic(requests: int = 1000, *, streams: int = 8, stages: int = 3, one_off: float = 0.25, turns: int = 6,
              scale: float = 1.0, seed: int = 0) -> dict[str, list[Item]]:
    """A synthetic single-slot workload: ``streams`` conversations running at once (each over one of
    ``stages`` stage prompts with a static prefix of 1,500-3,000 tokens, ``turns`` turns, then a
    new conversation takes its place), interleaved with unrelated one-off requests (a share
    ``one_off`` of all requests, 100-400 tokens). Each turn extends the previous prompt by a reply
    and a new user message."""
    rng = random.Random(seed)
    size = lambda lo, hi: max(2, round(rng.randint(lo, hi) * scale))  # noqa: E731
    prefixes = [_ids(rng, size(1500, 3000)) for _ in range(stages)]
    live: list[dict[str, Any]] = []
    opened = 0
    out: list[Item] = []

    def open_stream() -> dict[str, Any]:
        nonlocal opened
        opened += 1
        stage = rng.randrange(stages)
        return {"id": f"s{opened}", "stage": stage, "prompt": None, "turn": 0}

    while len(live) < streams:
        live.append(open_stream())
    while len(out) < requests:
        if rng.random() < one_off:
            out.append(Item("one-off", f"o{len(out)}", _ids(rng, size(100, 400))))
            continue
        i = rng.randrange(len(live))
        s = live[i]
        head = s["prompt"] + _ids(rng, size(30, 120)) if s["prompt"] else prefixes[s["stage"]]
        s["prompt"] = head + _ids(rng, size(40, 200))
        s["turn"] += 1
        out.append(Item(f"stage{s['stage']}", s["id"], s["prompt"], len(prefixes[s["stage"]])))
        if s["turn"] >= turns:
            live[i] = open_stream()
    return {"synthetic": out}


def scenario(name: str, *, scale: float = 1.0, requests: int = 1000) -> dict[str, list[Item]]:
    if name == "interleave":
        return interleave(scale)
    if name == "synthetic":
        return synthetic(requests, scale=scale)
    raise GatekeeperError(f"unknown scenario {name!r}; use one of: {', '.join(SCENARIOS)}")


def bounds(items: Sequence[Item]) -> list[int]:
    """Per request: the longest prefix shared with any earlier request, at most its length - 1."""
    seen: TokenTrie[bool] = TokenTrie()
    out = []
    for item in items:
        shared, _ = seen.longest(item.tokens)
        out.append(min(shared, len(item.tokens) - 1))
        seen.insert(item.tokens, True)
    return out


def policies(specs: Sequence[str] | None) -> list[str]:
    """The policies to compare, validated; a bad one is an error naming what is accepted."""
    out = []
    for spec in specs or DEFAULT_POLICIES:
        try:
            out.append(parse(spec).spec)
        except ValueError as e:
            raise GatekeeperError(f"--policy: {e}") from None
    return out


# --- running -------------------------------------------------------------------------------------


@dataclass
class Served:
    tokens: list[int]
    text: str
    reused: int


def serve(model: Any, items: Sequence[Item], max_tokens: int, cache: bool,
          after: Callable[[], None] | None = None) -> tuple[list[Served], int, Any]:
    """Run one trace on a fresh session: the outputs, the peak snapshot bytes held, and the session
    (closed: its figures stay readable)."""
    out, peak = [], 0
    with model.session(cache=cache) as session:
        for item in items:
            if item.boundary:
                session.pin(item.tokens[: item.boundary])
            g = session.generate(list(item.tokens), max_tokens=max_tokens)
            if g.cached_tokens is None:
                raise GatekeeperError(f"replay counts the tokens each request reused, and the {model.name} engine "
                                      f"({model.profile.where}) does not report them; replay on an engine that does")
            out.append(Served(g.tokens, g.text, g.cached_tokens))
            peak = max(peak, session.held()[1] or 0)
            if after:
                after()
        held = session.held()
    return out, peak, (held, session.snapshot_stats())


def _report(items: Sequence[Item], bound: list[int], served: list[Served], figures: Any, peak: int,
            cold: list[Served] | None) -> dict[str, Any]:
    reused = [s.reused for s in served]
    (held, nbytes), stats = figures
    total_bound = sum(bound)
    differing = None if cold is None else [i for i, (a, b) in enumerate(zip(cold, served))
                                           if a.tokens != b.tokens or a.text != b.text]
    row = {
        "requests": len(items),
        "prompt_tokens": sum(len(i.tokens) for i in items),
        "bound": total_bound,
        "reused": sum(reused),
        "redone": total_bound - sum(reused),
        "realized_share": sum(reused) / total_bound if total_bound else None,
        "restores": sum(1 for r in reused if r > 0),
        "forced_full": sum(1 for r, b in zip(reused, bound) if r == 0 and b >= FORCED_MIN),
        "snapshots_held": held,
        "snapshot_bytes": nbytes,
        "peak_snapshot_bytes": peak,
        "snapshots": stats,
        "identical": None if differing is None else not differing,
        "differing": differing,
    }
    if len(items) <= DETAIL:
        row["detail"] = [{"stream": i.stream, "stage": i.stage, "prompt": len(i.tokens), "bound": b, "reused": s.reused}
                         for i, b, s in zip(items, bound, served)]
    return row


def replay(traces: dict[str, list[Item]], specs: Sequence[str], make: Callable[[str], Any], *,
           parity: bool, max_tokens: int = 8, advance: Callable[[], None] | None = None) -> dict[str, Any]:
    """Every trace under every policy. ``make(spec)`` loads a model whose profile uses that policy;
    each trace runs on a fresh session of it; with ``parity`` each policy's outputs are compared with the cache-off run of the same
    profile (one cold run per distinct cold plan: the erase rule never changes it)."""
    colds: dict[tuple, dict[str, list[Served]]] = {}
    report: dict[str, Any] = {"traces": {}, "policies": []}
    for name, items in traces.items():
        b = bounds(items)
        report["traces"][name] = {"requests": len(items), "prompt_tokens": sum(len(i.tokens) for i in items),
                                  "bound": sum(b)}
    hybrid = None
    for spec in specs:
        model = make(spec)
        hybrid = model.hybrid
        cold = None
        if parity:
            key = _cold_key(model, spec)
            if key not in colds:
                colds[key] = {name: serve(model, items, max_tokens, False, advance)[0] for name, items in traces.items()}
            cold = colds[key]
        rows = {}
        for name, items in traces.items():
            served, peak, figures = serve(model, items, max_tokens, True, advance)
            rows[name] = _report(items, bounds(items), served, figures, peak, cold[name] if cold else None)
        model.close()
        report["policies"].append({"policy": spec, "traces": rows, "total": _total(rows)})
    report["hybrid"] = hybrid
    return report


def _cold_key(model: Any, spec: str) -> tuple:
    """What the cache-off run depends on: the plan; under aligned, interval cuts are part of it."""
    p = parse(spec)
    aligned = model.profile.prefill == "aligned"
    return (aligned, p.every if aligned and model.hybrid else None)


def _total(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    keys = ("requests", "prompt_tokens", "bound", "reused", "redone", "restores", "forced_full")
    total = {k: sum(r[k] for r in rows.values()) for k in keys}
    total["realized_share"] = total["reused"] / total["bound"] if total["bound"] else None
    flags = [r["identical"] for r in rows.values()]
    total["identical"] = None if any(f is None for f in flags) else all(flags)
    return total


# --- engines -------------------------------------------------------------------------------------


def maker(profile: Any, root: Path | None, *, simulate: bool, state_bytes: tuple[int, int] = (0, 0)) -> Callable[[str], Any]:
    """``make(spec)``: a model of ``profile`` with its ``snapshots`` policy set to ``spec``; the
    simulator (same plan, policy and limits, no model) when ``simulate``."""

    def make(spec: str) -> Any:
        p = profile.model_copy(update={"snapshots": spec})
        if simulate:
            from ...engines.sim import SimEngine

            return SimEngine(p, state_bytes=state_bytes)
        from ...engines.registry import build_engine

        return build_engine(p, workspace_root=root)

    return make
