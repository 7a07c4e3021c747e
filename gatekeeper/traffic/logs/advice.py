"""Advice with numbers: what each setting a llama.cpp-family server offers would have re-used on the
traffic of its log.

The requests' prompts (matched from a capture, in the order the server started them) are replayed
through the snapshot simulator ``replay --simulate`` uses (token counts, no model), once per
setting, from empty. The simulator keeps a snapshot every ``unit`` tokens; the server keeps its
checkpoints at message starts and near a prompt's end, so where both restore a shared prefix the
server's figure is within one unit of the simulated one. Settings, each named by the flags it stands for:

- ``--cache-ram M``: a host prompt cache of M MiB, shared by the slots, that keeps prompts (with
  their checkpoints) an unrelated request pushed out of a slot;
- ``-np K``: K slots, each request sent to the slot holding the longest prefix of it (at least a
  unit), else the least recently used one; no host cache, so one slot's prompt is erased by the next;
- ``--ctx-checkpoints N`` and a checkpoint every S tokens (llama.cpp: ``--checkpoint-min-step``), one slot;
- gatekeeper's ``boundaries``: a pinned snapshot at each request's stage prefix (what all the
  requests of its capture ``stage`` share, at least a unit), kept whatever comes in between.

Memory is the simulation's peak bytes held beyond the slots' own KV cache, from the log's
checkpoint size and KV bytes per token: a slot's checkpoint costs its size (the slot holds the KV
anyway); a host-cache prompt its KV once plus its checkpoints (each snapshot a checkpoint and a
unit of KV); a gatekeeper snapshot stands alone (checkpoint and KV up to it); more slots add their
context's KV (``n_ctx_slot`` tokens each). Unknown (None) when the log shows neither size.
"""

from __future__ import annotations

from collections import Counter
from contextlib import ExitStack
from statistics import median
from typing import Any, Sequence

from ...engines.sim import SimEngine
from ...workspace import CacheLimits, EngineProfile
from .reuse import UNIT, lcp

CACHE_RAM = (1024, 8192, 32768)  # MiB
SLOTS = (2, 4)
CHECKPOINTS = (4, 32, 128)
SPACING = (4, 16)  # in units
UNBOUNDED = 1 << 62


def _run(prompts: Sequence[Sequence[int]], spec: str, *, slots: int = 1, entries: int = UNBOUNDED,
         nbytes: int = UNBOUNDED, unit: int, state: tuple[int, int], boundaries: Sequence[int] | None = None) -> tuple[int, int]:
    """(tokens re-used, peak snapshot bytes held) of one setting over the prompts."""
    profile = EngineProfile(adapter="sim", prefill="aligned", chunk=unit, snapshots=spec,
                            cache=CacheLimits(max_entries=entries, max_bytes=nbytes))
    model = SimEngine(profile, state_bytes=state)
    reused = peak = 0
    with ExitStack() as stack:
        sessions = [stack.enter_context(model.session(cache=True)) for _ in range(slots)]
        last: list[Sequence[int]] = [()] * slots
        used = list(range(slots))  # least recently used first
        for i, tokens in enumerate(prompts):
            shares = [lcp(t, tokens) for t in last]
            best = max(range(slots), key=lambda s: shares[s])
            slot = best if shares[best] >= unit else used[0]
            used.remove(slot)
            used.append(slot)
            last[slot] = tokens
            session = sessions[slot]
            if boundaries and boundaries[i]:
                session.pin(tokens[: boundaries[i]])
            reused += session.generate(list(tokens), max_tokens=1).cached_tokens or 0
            peak = max(peak, sum(s.held()[1] or 0 for s in sessions))
    return reused, peak


def stage_prefixes(prompts: Sequence[Sequence[int]], stages: Sequence[str], unit: int) -> list[int]:
    """Per request, its stage's prefix: what all the stage's requests share (a pipeline declares it
    before its first request); 0 for a stage of one request, or below a unit."""
    common: dict[str, Sequence[int]] = {}
    for tokens, stage in zip(prompts, stages):
        prev = common.get(stage)
        common[stage] = tokens if prev is None else tokens[: lcp(prev, tokens)]
    count = Counter(stages)
    return [len(common[s]) if count[s] > 1 and len(common[s]) >= unit else 0 for s in stages]


def advise(prompts: Sequence[Sequence[int]], stages: Sequence[str], possible: int, server: dict[str, Any],
           checkpoint_mib: float | None, *, unit: int = UNIT, cache_ram: Sequence[int] = CACHE_RAM) -> dict[str, Any]:
    """One line per setting: the setting, tokens re-used, share of the possible, memory in MiB; the
    first line is the configuration the log shows the server ran with."""
    per_token = server.get("kv_bytes_per_token") or 0.0
    fixed = round(checkpoint_mib * 2**20) if checkpoint_mib else 0
    known = bool(per_token or fixed)
    state = (fixed, 0)  # a slot's checkpoint: its KV is the slot's, there anyway
    whole = (fixed, round(per_token))  # a state that stands alone: checkpoint and KV up to it

    def chain(spacing: int) -> tuple[int, int]:  # a host-cache prompt: its KV once, a checkpoint every ``spacing``
        return fixed + round(per_token * spacing), 0
    served = server.get("slots") or 1
    count = server.get("ctx_checkpoints") or CHECKPOINTS[1]
    ram = server.get("cache_ram_mib")
    ctx = server.get("n_ctx_slot")
    lines = []

    def line(setting: str, reused: int, held: int, extra: float = 0.0, as_served: bool = False) -> None:
        lines.append({"setting": setting, "reused": reused, "share": round(reused / possible, 4) if possible else None,
                      "memory_mib": round((held + extra) / 2**20, 3) if known else None, "as_served": as_served})

    keep, erase = f"interval:{unit}", f"interval:{unit}+erase"

    def host(mib: int) -> tuple[int, int]:  # the host cache is shared by the slots: one store
        return _run(prompts, keep, nbytes=mib * 2**20 if mib > 0 else UNBOUNDED, unit=unit, state=chain(unit))

    flags = f"-np {served} --cache-ram {ram if ram is not None else '?'} --ctx-checkpoints {count}"
    line(f"as served: {flags}", *(host(ram) if ram else _run(prompts, erase, slots=served, entries=count, unit=unit,
                                                            state=state)), as_served=True)
    for mib in cache_ram:
        line(f"--cache-ram {mib}", *host(mib))
    for k in sorted({served * s for s in SLOTS}):
        more = (k - served) * (ctx or 0) * per_token
        line(f"-np {k} --cache-ram 0 (prefix affinity)",
             *_run(prompts, erase, slots=k, entries=count, unit=unit, state=state), extra=more)
    for n in CHECKPOINTS:
        line(f"--ctx-checkpoints {n} --cache-ram 0", *_run(prompts, erase, entries=n, unit=unit, state=state))
    for s in SPACING:
        line(f"a checkpoint every {s * unit} tokens --cache-ram 0",
             *_run(prompts, f"interval:{s * unit}+erase", entries=count, unit=unit, state=state))
    line("gatekeeper boundaries (pinned stage prefixes)",
         *_run(prompts, "boundaries", unit=unit, state=whole, boundaries=stage_prefixes(prompts, stages, unit)))
    return {"unit": unit, "requests": len(prompts), "possible": possible,
            "bytes_model": {"checkpoint_mib": checkpoint_mib, "kv_bytes_per_token": per_token}, "lines": lines}


def checkpoint_size(sizes: Sequence[float | None]) -> float | None:
    known = [s for s in sizes if s is not None]
    return median(known) if known else None
