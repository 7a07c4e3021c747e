"""A second, independent reference: transformers reading the weights an engine profile's ``reference_model`` names
(a model folder, or a .gguf file it dequantizes), with no cache object (``engines/reader.py``).

The reference arm reads a server, mlx or llama.cpp with the engine's own cold path, which is the engine's own code:
where that code does not compute the model (mlx-lm 0.27.1's GPT BigCode built no causal mask), the arms agree with
it. Read again by another implementation, the two references picking different tokens by a clear margin say one of
the forwards is not the model: INCONCLUSIVE, the positions recorded, for a person to look at. The same full rows also
read a server's sampled draws that its top lists cannot tell (``reread``: gate/stats/pit.py tests them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ...engines import sampler
from ...engines.base import Engine, Referenced
from ...errors import GatekeeperError
from ...evidence import Ruling
from ..run.plans import Plan

KEPT = 5  # disagreements kept in the record (the count holds them all)


@dataclass
class Disagreement:
    """A position where the engine's own cold read and transformers' read pick different tokens."""

    case: str
    turn: int
    position: int  # 0-based, in the turn's answer
    engine: int  # the engine's own read's pick
    transformers: int  # transformers' pick
    margin: float  # transformers' log-probability margin of its pick over its second


@dataclass
class Second:
    """What transformers' read of the ``reference_model`` weights says of the engine's own cold read, at the positions
    that read covered."""

    weights: str
    dtype: str = ""
    positions: int = 0
    disagreed: int = 0
    where: list[Disagreement] = field(default_factory=list)  # the first KEPT


@dataclass
class Reread:
    """One arm's sampled draws that carry no transform of their own (a server's, beyond its top lists), transformed
    under the declared decoding from transformers' full rows (``sampler.reread``): the values, the draws the declared
    decoding gives no chance, and those too near its support's edge to tell."""

    values: list[float] = field(default_factory=list)
    impossible: list[str] = field(default_factory=list)
    undecided: int = 0


def check(p: Plan) -> None:
    """Exit 2 before anything runs where a profile's ``reference_model`` names no weights."""
    for c in p.configs.values():
        if c.profile.reference_model and not (path := _weights(p, c.profile.reference_model)).exists():
            raise GatekeeperError(f"{c.profile.where}: field 'reference_model': {path} does not exist; name the served "
                                  "model's folder or .gguf file (relative to the workspace), or remove the field")


def compare(p: Plan, memo: dict[tuple, Referenced], where: dict[tuple, tuple[str, int, str]],
            tolerance: dict[str, float], progress: Callable[[str], None], loaded: dict[str, Any]) -> Second | None:
    """Every sequence the engine's own cold read covered (``memo``: the reference arm's reads by key, ``where`` their
    first case, turn and arm), read again by transformers from its arm's ``reference_model`` and compared where the
    engine read: a disagreement is another pick by more than the reference arm's flip ``tolerance``. None where no
    profile names weights."""
    specs = {name: p.configs[name].profile.reference_model for name in ("off", "on")}
    if not any(specs.values()):
        return None
    from ...engines import reader

    out = Second(", ".join(sorted({s for s in specs.values() if s})))
    for key, own in memo.items():
        case, turn, arm = where[key]
        if not (spec := specs[arm]):
            continue
        tokens, asked = list(key[1]), [list(a) for a in key[2]]
        other = reader.read(_loaded(p, spec, loaded, progress), tokens, len(asked), asked, where=spec)
        out.dtype = other.dtype
        for i, j in enumerate(range(len(asked)) if own.at is None else own.at):
            mine, theirs = own.top2[i], other.top2[j]
            margin = theirs[0][1] - theirs[1][1]
            out.positions += 1
            if mine[0][0] != theirs[0][0] and margin > tolerance["flip_margin"]:
                out.disagreed += 1
                if len(out.where) < KEPT:
                    out.where.append(Disagreement(case, turn, j, int(mine[0][0]), int(theirs[0][0]), margin))
    return out


def reread(p: Plan, models: dict[str, Engine], pending: dict[str, list[tuple]], progress: Callable[[str], None],
           loaded: dict[str, Any]) -> dict[str, Reread]:
    """Each arm's sampled turns that carry no transforms of their own (``pending``: case, turn, draw, sequence, turn
    record), read by transformers from its profile's ``reference_model`` (full rows) and transformed under the
    declared decoding through the engine's own chain."""
    from ...engines import reader

    out: dict[str, Reread] = {}
    for arm, turns in pending.items():
        if not turns or not (spec := p.configs[arm].profile.reference_model):
            continue
        side, chain = out.setdefault(arm, Reread()), models[arm].sampler()
        for case, n, draw, tokens, turn in turns:
            steps = len(turn["tokens"])
            rows = reader.logits(_loaded(p, spec, loaded, progress), tokens, steps)
            start = len(tokens) - steps
            for j, u in enumerate(sampler.reread(draw.decoding, draw.key, chain, rows, tokens[:start], tokens[start:])):
                if u is None:
                    side.undecided += 1
                elif u < 0:
                    side.impossible.append(f"{case} turn {n} token {j}")
                else:
                    side.values.append(u)
    return out


def judge(second: Second | None, detok: Callable[[list[int]], str]) -> Ruling:
    """Two references that disagree make a PASS ``references_disagree:`` (INCONCLUSIVE) and add the line to any other
    verdict; agreeing, a ``second_reference:`` line."""
    if second is None:
        return Ruling()
    if not second.disagreed:
        return Ruling(notes=[f"second_reference: transformers reading {second.weights} in {second.dtype} picks what "
                                   f"the engine's own cache-free read picks at all {second.positions} positions it read"])
    first = second.where[0]
    line = (f"references_disagree: the engine's own cache-free read and transformers reading {second.weights} pick "
            f"different tokens at {second.disagreed} of {second.positions} positions (first {first.case} turn "
            f"{first.turn} token {first.position}: the engine's read picks {detok([first.engine])!r}, transformers "
            f"{detok([first.transformers])!r} by {first.margin:.3g} nats): one of the two forwards does not compute the "
            "model, so no reading of the arms can be trusted; a person must look (the positions are in the record)")
    return Ruling("INCONCLUSIVE", [line], over=("PASS",))


def _weights(p: Plan, spec: str) -> Path:
    path = Path(spec).expanduser()
    return path if path.is_absolute() else p.ws.root / path


def _loaded(p: Plan, spec: str, loaded: dict[str, Any], progress: Callable[[str], None]) -> Any:
    """The weights ``spec`` names, loaded once per evaluation."""
    from ...engines import reader

    if spec not in loaded:
        progress(f"reference {spec}")
        loaded[spec] = reader.load(_weights(p, spec))
    return loaded[spec]
