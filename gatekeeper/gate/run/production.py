"""An evaluation under production load: which load is in force, the background traffic that makes it,
how it enters the identity, and what a server offers when batching changes its answers.

Under a load every configuration and baseline repeat keeps ``concurrency`` requests in flight on its
deployment (the battery's own cases among them), and the battery also runs once alone, one case at a
time: a baseline that changes under load, or parts from the run alone, is ``batch_variant:``; a sampled case that
parts where both runs computed the same distribution is ``seed_batched:`` (the draw changed, not the numerics).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from ...battery import partition
from ...battery.suites import Item
from ...errors import GatekeeperError
from ...evidence import CaseResult
from ...identity import file_digest
from ...workspace import Decoding, Load, Workspace

BACKGROUND_MAX_TOKENS = 32  # a captured call's answer length is not in the capture: this many tokens each

# What each kind of server offers to make greedy decoding independent of the batch it lands in.
FIXES = {
    "vllm": "vLLM: set VLLM_BATCH_INVARIANT=1 (batch-invariant kernels)",
    "sglang": "SGLang: start it with --enable-deterministic-inference",
    "llamacpp": "llama.cpp: run one slot (-np 1), so requests are never batched together",
}


def in_force(ws: Workspace, flag: str, concurrency: int | None = None, background: str | None = None) -> Load | None:
    """The load an evaluation of ``flag`` runs under: ``evaluate --load`` if given, else the policy's."""
    policy = ws.policy(flag)
    if concurrency is None:
        if background is not None:
            raise GatekeeperError("--load-from names the background traffic of a load: give --load N (requests in flight) too")
        return policy.load
    if concurrency < 2:
        raise GatekeeperError(f"--load {concurrency}: a load keeps at least 2 requests in flight (the case and one other)")
    return Load(concurrency=concurrency, background=background or "battery")


def source(ws: Workspace, load: Load) -> Path | None:
    """The capture a load replays, checked to exist (None: the battery's own prompts)."""
    if load.background == "battery":
        return None
    path = Path(load.background).expanduser()
    path = path if path.is_absolute() else ws.root / path
    if not path.is_file():
        raise GatekeeperError(f"load background {load.background}: no such capture file; name a JSONL capture "
                              "('gatekeeper proxy --capture' or 'measure --capture' write one) or 'battery'")
    return path


def identity(ws: Workspace, load: Load, battery_digest: str) -> dict[str, Any]:
    """What the evidence says about the load: its concurrency, its source and that source's digest."""
    path = source(ws, load)
    return {"concurrency": load.concurrency, "background": "battery" if path is None else "capture",
            "source_digest": battery_digest if path is None else file_digest(path, memo=False)}


def prompts(ws: Workspace, load: Load, model, items: Sequence[Item], mode: partition.Mode,
            captured: Sequence[list[int] | str] | None) -> list[tuple[list[int], int, Decoding | None]]:
    """The background requests (token ids, max tokens, the suite's sampled decoding, which they draw with no seed):
    each case's first turn, or each captured call, greedy (``captured``: the capture's prompts, ids or text, as
    ``traffic.captures.capture.prompts`` reads them)."""
    if source(ws, load) is None:
        out = []
        for item in items:
            values = {**item.case.vars, **(item.case.turns[0] if item.case.turns else {})}
            rendered = partition.render(model, partition.pieces(ws, item.suite, values), mode)
            d = item.suite.decoding
            out.append((list(rendered.tokens), d.max_tokens, None if d.plain else d))
        return out
    if captured is None:
        raise GatekeeperError(f"load background {load.background}: the capture's prompts were not read")
    return [(p if isinstance(p, list) else model.tokenize(p), BACKGROUND_MAX_TOKENS, None) for p in captured]


def seed_broken(alone: CaseResult, loaded: CaseResult, turn: int, position: int) -> bool:
    """Whether two runs of a sampled case part at a step where both read the same top-2 logits: one distribution,
    two draws from it, so the seed did not hold for the batched request (equal margins alone could be chance)."""
    a, b = alone["turns"][turn - 1], loaded["turns"][turn - 1]
    if not (a.get("draws") or b.get("draws")):
        return False  # greedy: a parting is the numerics'
    tops = [(t.get("top2") or [])[position:position + 1] for t in (a, b)]
    return bool(tops[0]) and tops[0] == tops[1]


def seed_fix(dialect: str | None) -> str:
    """What to do when a server's per-request seed does not survive batching."""
    return ("the server's per-request seed does not hold for a batched request, so sampled answers under this load "
            f"cannot pair by seed: evaluate the sampled suites without a load, or greedy under it ({fix(dialect)})")


def fix(dialect: str | None) -> str:
    """What the deployment's server offers against batch variance (every known one if it is not known)."""
    return FIXES.get(dialect or "", "; ".join(FIXES.values()))
