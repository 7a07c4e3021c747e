"""The prefill tax: run the battery's cases through the runtime and add up what each stage costs.

Each run builds its own ``Runtime`` with the flag state forced and the response cache off (a served
answer costs nothing, so it would measure nothing), so the figures are the engine's own. A comparison
runs the flag off, then on, each on a fresh engine, and reports what the flag saves per stage.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from ...battery import suites as battery
from ...engines.base import plus
from ...errors import GatekeeperError
from ...workspace import Workspace

STATES = ("current", "off", "on")


@dataclass
class Figures:
    """What a set of calls cost; ``wall_s`` is around each call, so it includes rendering and tokenizing."""

    calls: int = 0
    prompt_tokens: int = 0
    cached_tokens: int | None = 0  # None once a call's engine did not report it (printed n/a, never 0)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    wall_s: float = 0.0

    def add(self, c, wall_s: float) -> None:
        self.calls += 1
        self.prompt_tokens += c.prompt_tokens
        self.cached_tokens = plus(self.cached_tokens, c.cached_tokens)
        self.prefill_s += c.prefill_s
        self.decode_s += c.decode_s
        self.wall_s += wall_s

    def merge(self, other: "Figures") -> None:
        for k, v in asdict(other).items():
            setattr(self, k, plus(getattr(self, k), v))

    def to_dict(self) -> dict[str, Any]:
        model_s = self.prefill_s + self.decode_s
        return {
            "calls": self.calls,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "computed_tokens": None if self.cached_tokens is None else self.prompt_tokens - self.cached_tokens,
            "prefill_s": round(self.prefill_s, 6),
            "decode_s": round(self.decode_s, 6),
            "model_s": round(model_s, 6),
            "prefill_share": round(self.prefill_s / model_s, 4) if model_s else 0.0,
            "wall_s": round(self.wall_s, 6),
        }


@dataclass
class Run:
    """One pass over the cases under one flag state."""

    flag_state: str
    flags: dict[str, str]
    pipeline_hash: str
    startup_s: float  # model load, a warm-up call and, with the cache on, computing the pinned stage prefixes
    wall_s: float = 0.0  # the whole pass, end to end
    stages: dict[str, Figures] = field(default_factory=dict)

    def total(self) -> Figures:
        t = Figures()
        for f in self.stages.values():
            t.merge(f)
        return t

    def to_dict(self) -> dict[str, Any]:
        total = self.total().to_dict()
        return {
            "flag_state": self.flag_state, "flags": self.flags, "pipeline_hash": self.pipeline_hash,
            "startup_s": round(self.startup_s, 6), "wall_s": round(self.wall_s, 6),
            "overhead_s": round(max(0.0, self.wall_s - total["model_s"]), 6),
            "stages": {name: f.to_dict() for name, f in self.stages.items()}, "total": total,
        }


@dataclass
class Plan:
    ws: Workspace
    flag: str
    states: list[str]  # flag states to run, in order ("current" means the ledger's)
    engine: str
    items: list[battery.Item]
    config: dict[str, Any]


def plan(ws: Workspace, flag: str = "prefix_cache", flag_state: str = "current", compare: bool = False,
         engine: str = "auto", suites: list[str] | None = None, limit: int | None = None, *,
         skip_unsupported: bool = False) -> Plan:
    """Every input checked before a model is loaded or anything is written. ``skip_unsupported``: a suite
    with promptfoo assertions gatekeeper cannot evaluate is measured anyway (measuring runs no assertions)."""
    ws.policy(flag)
    if flag_state not in STATES:
        raise GatekeeperError(f"--flag-state must be one of {', '.join(STATES)}, not {flag_state!r}")
    if compare and flag_state != "current":
        raise GatekeeperError("--compare runs the flag off and then on; drop --flag-state")
    ws.engine(engine)
    items = battery.read(ws, suites, limit, skip_unsupported=skip_unsupported)
    config = {"flag": flag, "flag_state": flag_state, "compare": compare, "engine": engine, "suites": suites, "limit": limit,
              **({"skip_unsupported": True} if skip_unsupported else {})}
    return Plan(ws, flag, ["off", "on"] if compare else [flag_state], engine, items, config)


def _warm_up(model) -> None:
    """One untimed call on a throwaway session: a framework's first forward pays one-off set-up
    (kernels, allocators) that would otherwise be charged to whichever run came first."""
    with model.session(cache=False) as session:
        session.generate(model.tokenize(model.render([{"role": "user", "content": "warm up"}])), max_tokens=1)


def run(p: Plan, state: str, ledger_url: str | None, capture: Path | None = None,
        progress: Callable[[str], None] = lambda label: None) -> Run:
    """One pass over the plan's cases; each case is one stream whose turns extend its transcript."""
    from ...runtime import Runtime

    forced = None if state == "current" else {p.flag: state}
    t0 = time.perf_counter()
    rt = Runtime(p.ws.root, engine=p.engine, ledger=ledger_url, response_cache=False, flags=forced, capture=capture)
    try:
        _warm_up(rt.model)
        result = Run(rt.flags[p.flag], dict(rt.flags), rt.pipeline_hash, time.perf_counter() - t0)
        t_pass = time.perf_counter()
        for item in p.items:
            progress(f"{result.flag_state} {item.case_id}")
            figures = result.stages.setdefault(item.suite.stage, Figures())
            values = dict(item.case.vars)
            history: list[dict[str, str]] = []
            for turn in item.case.turns or [{}]:
                values.update(turn)
                t_call = time.perf_counter()
                c = rt.complete(item.suite.stage, values, history, stream=item.case_id)
                figures.add(c, time.perf_counter() - t_call)
                history = c.messages
        result.wall_s = time.perf_counter() - t_pass
        return result
    finally:
        rt.close()


def _drop(off: float, on: float) -> float:
    return round((off - on) / off, 4) if off else 0.0


def reduction(off: Run, on: Run) -> dict[str, Any]:
    """Per stage and in total: prompt tokens computed and prefill seconds, off vs on."""
    rows = {name: (off.stages[name], on.stages.get(name, Figures())) for name in off.stages}
    rows["total"] = (off.total(), on.total())
    out = {}
    for name, (a, b) in rows.items():
        ca, cb = a.to_dict()["computed_tokens"], b.to_dict()["computed_tokens"]
        known = ca is not None and cb is not None
        out[name] = {
            "computed_tokens_off": ca, "computed_tokens_on": cb, "computed_tokens_saved": ca - cb if known else None,
            "computed_tokens_reduction": _drop(ca, cb) if known else None,
            "prefill_s_off": round(a.prefill_s, 6), "prefill_s_on": round(b.prefill_s, 6),
            "prefill_s_reduction": _drop(a.prefill_s, b.prefill_s),
        }
    return out


@dataclass
class Measurement:
    flag: str
    runs: list[Run]
    reduction: dict[str, Any] | None
    measurement_id: int | None = None  # set once recorded

    def to_dict(self) -> dict[str, Any]:
        return {"measurement_id": self.measurement_id, "flag": self.flag,
                "runs": [r.to_dict() for r in self.runs], "reduction": self.reduction}


def measure(p: Plan, ledger_url: str | None, capture: Path | None = None,
            progress: Callable[[str], None] = lambda label: None) -> Measurement:
    """Run every state of the plan. With two runs only the first is captured: the prompts are the
    same in both, and one pass keeps the capture's streams unique."""
    runs = [run(p, state, ledger_url, capture if n == 0 else None, progress) for n, state in enumerate(p.states)]
    return Measurement(p.flag, runs, reduction(runs[0], runs[1]) if len(runs) == 2 else None)


def record(m: Measurement, p: Plan, ledger, operator: str, captured: bool) -> int:
    """Append the measurement to the ledger (only once it is complete: a failed run writes nothing)."""
    result = {k: v for k, v in m.to_dict().items() if k != "measurement_id"}
    m.measurement_id = ledger.add_measurement(operator, {**p.config, "capture": captured}, result)
    return m.measurement_id
