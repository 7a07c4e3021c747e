"""Mining a battery for power: run every candidate case once with the flag off, score it from its own
decode, and keep the subset that gives the most sensitivity per second, every stage represented.

A step whose top-2 margin is near a tie is where a few ULPs of drift, or a slightly wrong restored state,
flip the greedy choice; a step far from one cannot. So a case's score is the near-tie weight of its
steps, ``exp(-margin / NEAR_TIE)`` each (1 at a tie, 0.37 at NEAR_TIE, nothing at a margin of 1), and
its cost the model seconds of its flag-off run (its prompt and generated tokens at the run's measured rates). Mining may decode longer than a suite asks
(``max_tokens``): longer answers hold more steps that can flip, and each suite keeps the length that
gives the most score per second. The suites it writes name where each case came from, its score, and
the engine it was scored on (``mined_on``), so an evaluation on another engine can say so.

Near-ties predict power; a planted fault measures it. With ``faults``, every candidate also runs flag
on under each planted fault (``engines/faults.py``), stopped at its first departing token, and the cases
whose outputs the most faults change come first: the battery is then chosen for the faults a broken
cache makes, not only for how close its decode comes to a tie.
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import yaml

from ...battery.partition import pieces, render
from ...battery.suites import Item
from ...engines.faults import Fault
from ...errors import GatekeeperError
from ...evidence import CaseResult, Turn
from ...workspace import Decoding, MinedOn, Suite, Workspace
from .. import planning
from ..kinds import NEAR_TIE, first_divergence
from ..run import runs

STEP = 16  # max_tokens is chosen among multiples of this (and each suite's own)


def weight(margin: float) -> float:
    return math.exp(-margin / NEAR_TIE)


@dataclass
class Candidate:
    item: Item
    source: str  # where it came from: "assertions/router.yaml#arith-1", "capture.jsonl:12"


@dataclass
class Scored:
    candidate: Candidate
    margins: list[list[float]]  # per turn, the top-2 margin of each generated step (decode order)
    prompt_tokens: list[int]  # per turn
    rates: tuple[float, float] = (0.0, 0.0)  # model seconds per prompt token and per generated token (``rates``)
    departs: dict[str, tuple[int, int] | None] = field(default_factory=dict)  # per probed fault: (turn, step) parted at

    def catches(self, upto: int | None = None) -> list[str]:
        """The probed faults that change this case's outputs within each turn's first ``upto`` tokens."""
        return [f for f, at in self.departs.items() if at is not None and (upto is None or at[1] < upto)]

    def score(self, upto: int | None = None) -> float:
        """The near-tie weight of each turn's first ``upto`` steps (all when None)."""
        return sum(weight(m) for turn in self.margins for m in turn[:upto])

    def seconds(self, upto: int | None = None) -> float:
        """Model seconds of the run with each turn cut to ``upto`` tokens, from the run's measured rates: the
        same cost model for every case, so the ranking does not follow one slow call on a busy machine."""
        prefill, decode = self.rates
        return sum(prefill * p + decode * len(m[:upto]) for p, m in zip(self.prompt_tokens, self.margins))

    def provenance(self, upto: int | None) -> dict[str, Any]:
        steps = [m for turn in self.margins for m in turn[:upto]]
        seconds = self.seconds(upto)
        return {"source": self.candidate.source, "score": round(self.score(upto), 4),
                "per_second": round(self.score(upto) / seconds, 4) if seconds else 0.0,
                "min_margin": round(min(steps), 6) if steps else None,
                "near_ties": sum(m <= NEAR_TIE for m in steps), "steps": len(steps), "seconds": round(seconds, 4),
                **({"catches": self.catches(upto)} if self.departs else {})}


def rates(turns: list[Turn]) -> tuple[float, float]:
    """Model seconds per prompt token and per generated token, over every measured call of the run."""
    prompt = sum(t["prompt_tokens"] for t in turns)
    generated = sum(len(t["tokens"]) for t in turns)
    return (sum(t["prefill_s"] or 0.0 for t in turns) / max(prompt, 1),
            sum(t["decode_s"] or 0.0 for t in turns) / max(generated, 1))


@dataclass
class Mined:
    chosen: list[Scored]
    max_tokens: dict[str, int]  # per suite
    power_per_token: dict[str, float | None]  # per suite: score gained per extra token over its own max_tokens
    identity: dict[str, Any]
    engine: str
    scored: list[Scored] = field(default_factory=list)
    faults: list[str] = field(default_factory=list)  # probed

    def to_dict(self) -> dict[str, Any]:
        return {"engine": self.engine, "candidates": len(self.scored), "chosen": len(self.chosen), "faults": self.faults,
                "seconds": round(sum(s.seconds(self.max_tokens[s.candidate.item.suite.suite]) for s in self.chosen), 3),
                "suites": {name: {"max_tokens": n, "power_per_token": self.power_per_token[name],
                                  "cases": [s.provenance(n) | {"id": s.candidate.item.case.id} for s in self.chosen
                                            if s.candidate.item.suite.suite == name]}
                           for name, n in self.max_tokens.items() if any(s.candidate.item.suite.suite == name for s in self.chosen)}}


def run(ws: Workspace, engine: str, candidates: list[Candidate], *, force, max_tokens: int | None = None,
        faults: Sequence[Fault] = (), progress: Callable[[str], None] = lambda label: None) -> tuple[list[Scored], dict[str, Any]]:
    """Every candidate once, flag off (the pipeline in force, cache off), decoding up to ``max_tokens``
    (each suite's own when None, never less), with top-2 logits; then, per planted fault, once flag on
    with that fault (``probe``). Returns the scores and the identity."""
    if not candidates:
        raise GatekeeperError("battery mine: no candidate cases; name suites (--suite), a capture (--capture) or both")
    p = planning.plan(ws, "prefix_cache", engine, force=force, grading=False)  # the flag-off side as the gate runs it
    off = p.configs["off"]
    from ...engines.registry import build_engine

    scored, turns, refs = [], [], []
    items = [_longer(c.item, max_tokens) for c in candidates]
    with build_engine(off.profile, workspace_root=ws.root) as model:
        for fault in faults:
            model.check_fault(fault)
        identity = model.identity()
        with model.session(cache=False) as session:
            for c, _item, result in _each(session, ws, candidates, items, off.render, "scoring ", progress):
                turns += result["turns"]
                refs.append(result)
                scored.append(Scored(c, [_margins(t) for t in result["turns"]], [t["prompt_tokens"] for t in result["turns"]]))
        probe(model, ws, off.render, scored, items, refs, faults, progress)
    measured = rates(turns)
    for s in scored:
        s.rates = measured
    return scored, identity


def probe(model, ws: Workspace, mode, scored: list[Scored], items: list[Item], refs: list[CaseResult],
          faults: Sequence[Fault], progress: Callable[[str], None]) -> None:
    """Each candidate flag on under each fault, every case stopped at its first token that departs from
    its flag-off run: records where (``Scored.departs``). The stage prefixes are computed once for all."""
    from .calibrate import Watch

    with tempfile.TemporaryDirectory(prefix="gatekeeper-mine-") as layer:
        for fault in faults:
            with model.session(cache=True, fault=fault, results=Path(layer)) as session:
                watches = [Watch(ref, {}, None) for ref in refs]
                runs = _each(session, ws, [s.candidate for s in scored], items, mode, f"{fault.spec} ", progress, watches)
                for s, ref, (_, _, result) in zip(scored, refs, runs):
                    s.departs[fault.spec] = departure(ref, result)


def departure(ref: CaseResult, result: CaseResult) -> tuple[int, int] | None:
    """The turn and step where ``result``'s tokens first part from ``ref``'s; None where they never do."""
    for n, (a, b) in enumerate(zip(ref["turns"], result["turns"])):
        if a["tokens"] != b["tokens"]:
            return n, first_divergence(a["tokens"], b["tokens"])
    return None


def _each(session, ws: Workspace, candidates: list[Candidate], items: list[Item], mode, label: str,
          progress: Callable[[str], None], watches: list | None = None):
    """Each candidate's case on ``session``, its stage boundary registered first as the gate registers it."""
    pinned: set[str] = set()
    for n, (c, item) in enumerate(zip(candidates, items)):
        if item.suite.suite not in pinned:
            _pin(session, ws, item, mode)
            pinned.add(item.suite.suite)
        progress(label + c.source)
        yield c, item, runs.run_case(session, ws, item, mode, watches[n] if watches else None)


def check_budget(cases: int | None, seconds: float | None) -> None:
    if (cases is None) == (seconds is None):
        raise GatekeeperError("battery mine: give one budget: --cases N or --seconds S")
    if (cases is not None and cases < 1) or (seconds is not None and seconds <= 0):
        raise GatekeeperError("battery mine: --cases must be at least 1 and --seconds above 0")


def select(scored: list[Scored], *, cases: int | None = None, seconds: float | None = None,
           identity: dict[str, Any], engine: str) -> Mined:
    """The cases with the most score per second within the budget, the best of every stage first, and
    per suite the ``max_tokens`` (up to what was decoded) that gives its cases the most score per second.
    Where faults were probed, cases (and lengths) that more of them catch come first."""
    check_budget(cases, seconds)
    by_suite: dict[str, list[Scored]] = {}
    for s in scored:
        by_suite.setdefault(s.candidate.item.suite.suite, []).append(s)
    lengths, gains = {}, {}
    for name, group in by_suite.items():
        own = min(s.candidate.item.suite.decoding.max_tokens for s in group)
        decoded = max((len(t) for s in group for t in s.margins), default=own)
        options = sorted({own, *range(STEP, decoded + 1, STEP)} - {n for n in range(0, own)})
        lengths[name] = max(options, key=lambda n: (sum(len(s.catches(n)) for s in group), _ratio(group, n), -n))
        extra = lengths[name] - own
        gains[name] = (round((sum(s.score(lengths[name]) for s in group) - sum(s.score(own) for s in group))
                             / extra / len(group), 4) if extra > 0 else None)

    def value(s: Scored) -> tuple[int, float]:
        n = lengths[s.candidate.item.suite.suite]
        return len(s.catches(n)), s.score(n) / max(s.seconds(n), 1e-9)

    ranked = sorted(scored, key=value, reverse=True)
    stages: dict[str, Scored] = {}
    for s in ranked:
        stages.setdefault(s.candidate.item.suite.stage, s)
    must = list(stages.values())
    # the cache probes every evaluation adds are built from a single-turn case: keep one (gate/arms/probes.py)
    if not any(len(s.candidate.item.case.turns) <= 1 for s in must):
        must += [s for s in ranked if len(s.candidate.item.case.turns) <= 1][:1]
    chosen: list[Scored] = []
    spent = 0.0
    for s in [*must, *(s for s in ranked if s not in must)]:
        cost = s.seconds(lengths[s.candidate.item.suite.suite])
        extra = len(must) - len(stages)  # the probes' case, beyond the budget's count
        if cases is not None:
            full = len(chosen) >= cases + extra
        else:
            assert seconds is not None  # check_budget: one budget or the other
            full = spent + cost > seconds and len(chosen) >= len(must)
        if full:
            break
        chosen.append(s)
        spent += cost
    return Mined(chosen, lengths, gains, identity, engine, scored, list(scored[0].departs) if scored else [])


def write(ws: Workspace, mined: Mined, out: Path) -> list[Path]:
    """One suite file per source suite with chosen cases, in ``out``; their prompt files are referred to
    where they are (relative to the workspace when inside it). Written only once all are rendered."""
    docs: dict[Path, dict[str, Any]] = {}
    ident = MinedOn.of(mined.identity)
    for s in mined.chosen:
        suite = s.candidate.item.suite
        n = mined.max_tokens[suite.suite]
        path = out / f"{suite.suite}.yaml"
        doc = docs.setdefault(path, {
            "suite": suite.suite, "stage": suite.stage,
            "prompt": [_segment(ws, suite, seg) for seg in suite.prompt],
            "decoding": {"max_tokens": n, "stop": list(suite.decoding.stop)},
            "mined_on": {"engine": mined.engine, "model_digest": mined.identity.get("model_digest"), "identity": ident,
                         "max_tokens": n, "power_per_token": mined.power_per_token[suite.suite],
                         **({"faults": mined.faults} if mined.faults else {})},
            "cases": []})
        case = s.candidate.item.case.model_dump(mode="json", by_alias=True, exclude_defaults=True, exclude={"mined"})
        taken = {c["id"] for c in doc["cases"]}
        base, k = case["id"], 1
        while case["id"] in taken:  # the same id from two sources
            k += 1
            case["id"] = f"{base}-{k}"
        doc["cases"].append({**case, "mined": s.provenance(n)})
    for doc in docs.values():
        Suite.model_validate(doc)  # what is written loads
    out.mkdir(parents=True, exist_ok=True)
    for path, doc in docs.items():
        path.write_text("# Mined by gatekeeper battery mine: cases chosen for " + ("the planted faults that change their outputs "
                        "(mined_on.faults), then " if mined.faults else "") + "sensitivity per second on the engine in "
                        "mined_on.\n" + yaml.safe_dump(doc, sort_keys=False, allow_unicode=True, width=120))
    return list(docs)


def _ratio(group: list[Scored], n: int) -> float:
    seconds = sum(s.seconds(n) for s in group)
    return sum(s.score(n) for s in group) / seconds if seconds else 0.0


def _margins(turn: Turn) -> list[float]:
    return [float(s[0][1] - s[1][1]) for s in (turn.get("top2") or []) if len(s) >= 2]


def _longer(item: Item, max_tokens: int | None) -> Item:
    """The case as mining runs it: decoding up to ``max_tokens``, and no assertions (mining scores tokens, so
    it runs no script and needs no grader)."""
    case = item.case.model_copy(update={"assert_": []})
    if max_tokens is None or max_tokens <= item.suite.decoding.max_tokens:
        return Item(item.suite, case)
    decoding = Decoding(max_tokens=max_tokens, stop=item.suite.decoding.stop)
    return Item(item.suite.model_copy(update={"decoding": decoding}), case)


def _pin(session, ws: Workspace, item: Item, mode) -> None:
    values = {**item.case.vars, **(item.case.turns[0] if item.case.turns else {})}
    r = render(session.model, pieces(ws, item.suite, values), mode)
    if r.static_tokens:
        session.pin(r.tokens[: r.static_tokens])


def _segment(ws: Workspace, suite: Suite, seg) -> dict[str, Any]:
    out = seg.model_dump(mode="json", exclude_none=True)
    if seg.file is not None:  # where the loader finds it, as a path that works from the new suite's folder
        base = suite.path.parent if suite.path and (suite.path.parent / seg.file).is_file() else ws.root
        found = (base / seg.file).resolve()
        out["file"] = str(found.relative_to(ws.root.resolve())) if found.is_relative_to(ws.root.resolve()) else str(found)
    return out
