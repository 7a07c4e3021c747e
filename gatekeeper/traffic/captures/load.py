"""The load a captured workload puts on its server: request rate and calls in flight.

A call is in flight from its ``t`` for its ``duration_s`` (the wall time ``gatekeeper proxy`` and the
runtime record); where a line has no duration but the server reported ``prefill_s`` and ``decode_s``,
their sum stands in (the server's own time, which leaves out queueing, so it can only undercount).
Concurrency is time-weighted over the time at least one call is in flight: its p50 is the number of
calls in flight for at least half of the busy time. Percentiles are nearest-rank, as in ``analyze``.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Sequence, TypedDict

from .capture import Request


class InFlight(TypedDict):
    """How many calls were in flight, time-weighted over the busy time."""

    p50: int
    p95: int
    max: int
    mean: float
    busy_s: float


class Durations(TypedDict):
    """How many calls have a duration, and from where: recorded wall time, else the server's own time."""

    calls_timed: int
    wall: int
    server: int


class Load(TypedDict):
    """Rate and concurrency of a set of calls, and what the capture cannot say."""

    calls: int
    span_s: float
    requests_per_s: float | None
    concurrency: InFlight | None
    durations: Durations | None
    cannot_report: list[str]


def duration(r: Request) -> tuple[float | None, str | None]:
    """(seconds, source) of one call: its recorded wall time, else the server's prefill and decode time."""
    if r.duration_s is not None:
        return r.duration_s, "wall"
    t = r.telemetry
    if t.prefill_s is not None and t.decode_s is not None:
        return t.prefill_s + t.decode_s, "server"
    return None, None


def in_flight(spans: Sequence[tuple[float, float]]) -> InFlight | None:
    """The time-weighted distribution of how many of these (start, end) calls were in flight, over busy time."""
    events = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans], key=lambda x: (x[0], x[1]))
    time_at: defaultdict[int, float] = defaultdict(int)  # seconds spent at each level
    level, last = 0, None
    for t, step in events:
        if last is not None and level > 0 and t > last:
            time_at[level] += t - last
        level, last = level + step, t
    busy = sum(time_at.values())
    if busy <= 0:
        return None

    def level_at(p: int) -> int:
        """The fewest calls in flight for at least ``p``% of the busy time (the levels' time adds up to all of it)."""
        covered = 0.0
        for n in sorted(time_at):
            covered += time_at[n]
            if covered >= p / 100 * busy - 1e-12:
                return n
        return max(time_at)  # not reached: the sum above is the busy time

    return {"p50": level_at(50), "p95": level_at(95), "max": max(time_at),
            "mean": round(sum(n * s for n, s in time_at.items()) / busy, 3), "busy_s": round(busy, 6)}


def load(requests: Sequence[Request]) -> Load:
    """Rate and concurrency of these calls, and what the capture cannot say."""
    starts = [r.t for r in requests]
    timed = [(r.t, d, src) for r in requests for d, src in [duration(r)] if d is not None]
    ends = [t + d for t, d, _ in timed]
    span = max([*starts, *ends]) - min(starts) if requests else 0.0
    out: Load = {
        "calls": len(requests), "span_s": round(span, 6),
        "requests_per_s": round(len(requests) / span, 4) if span > 0 else None,
        "concurrency": None, "durations": None, "cannot_report": [],
    }
    if len(requests) < 2 and not timed:
        out["cannot_report"].append("rate: one call spans no time")
    if not timed:
        out["cannot_report"].append("concurrency: no line has a duration_s (or the server's prefill_s and decode_s); "
                                    "capture through 'gatekeeper proxy' or the runtime, which record each call's wall time")
        return out
    out["concurrency"] = in_flight([(t, t + d) for t, d, _ in timed])
    sources = Counter(src for *_, src in timed)
    out["durations"] = {"calls_timed": len(timed), "wall": sources["wall"], "server": sources["server"]}
    if len(timed) < len(requests):
        out["cannot_report"].append(f"concurrency: {len(requests) - len(timed)} of {len(requests)} calls have no "
                                    "duration and are left out, so it may undercount")
    return out
