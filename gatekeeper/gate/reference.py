"""The reference arm R: each arm's own answers read again, teacher-forced, in ONE forward pass over the whole
conversation with no cache object at all (``Engine.reference``: eager attention, float64 where the model is small).

An on/off comparison cannot see a defect both arms share: with the pipeline on a broken cache class, both sides run
it and agree. R can. At every generated position of each arm it asks two things of a read that no cache touched:
is the token the arm emitted the one R picks (a flip), and how far is the arm's top-2 logit gap from R's gap
between the same two tokens (a gap, which no normalisation moves). Neither is judged against a fixed tolerance but
against the noise measured in the same evaluation: R against R under another batch shape, the flag-off arm against
its own repeat, and R against the engine's own model reading the same tokens without a cache (control reads: its
dtype and kernels, no cache structure between them; the first two answers read). A flip counts only where R's margin
is well above that floor, a gap only where it is far above it: a structural cache defect is a step change there, on
a tiny random model as on a trained one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from ..battery import partition
from ..engines.base import Engine, Referenced
from ..engines.sampler import Draw
from ..errors import GatekeeperError
from ..evidence import Run, Turn
from ..identity import sha256_hex
from . import independent, runs
from . import probes as probes_
from .plans import Plan
from .probes import PREFIX, Probed

FLIP = 10.0  # a flip counts where R's top-1/top-2 margin exceeds this many noise floors
GAP = 100.0  # a gap counts where it exceeds this many noise floors
FLOOR = 1e-6  # the least noise assumed: float64 against float64 can be exactly equal
KEPT = 5  # departures kept in the record per arm (the count holds them all)
CONTROLS = 2  # answers also read by the engine's own model without a cache (the control floor), the first ones


@dataclass
class Departure:
    """One generated position where an arm parts from R."""

    case: str
    turn: int
    position: int  # 0-based, in the turn's answer
    emitted: int  # what the arm emitted; under sampled decoding its likeliest token (a draw is no flip)
    reference: int  # the token R picks there
    margin: float  # R's log-probability margin of its pick over its second
    gap: float  # |arm's top-2 gap - R's gap between the same tokens|

    def line(self, detok: Callable[[list[int]], str]) -> str:
        return (f"{self.case} turn {self.turn} token {self.position}: emitted {detok([self.emitted])!r}, the reference "
                f"picks {detok([self.reference])!r} by {self.margin:.3g} nats (gap off by {self.gap:.3g})")


@dataclass
class Arm:
    """What R says of one arm's answers."""

    positions: int = 0
    controls: int = 0  # positions also read by the engine's own model without a cache
    flips: int = 0  # R's pick differs, at any margin
    departures: list[Departure] = field(default_factory=list)  # the first KEPT
    departed: int = 0
    flipped: int = 0  # of those, R picks another token by a margin above the tolerance (the others: the gap only)
    max_gap: float = 0.0
    unread: list[str] = field(default_factory=list)  # turns R could not read, and why
    probed: int = 0  # of the positions, those in the cache probes' answers (gate/probes.py)


@dataclass
class Read:
    """R's reading of both arms, the floors it was judged against, and what it took."""

    dtype: str
    arms: dict[str, Arm]
    floor: dict[str, float]  # reference_batch, repeat, controls
    tolerance: dict[str, float]  # flip_margin, gap
    seconds: float = 0.0
    second: independent.Second | None = None
    reread: dict[str, independent.Reread] = field(default_factory=dict)  # gate/pit.py reads it (pit's counts record it)

    def departs(self, arm: str) -> bool:
        return self.arms[arm].departed > 0

    def to_dict(self) -> dict[str, Any]:
        return {**{k: v for k, v in asdict(self).items() if k != "reread"},
                "departs": {k: self.departs(k) for k in self.arms}}


def read(p: Plan, models: dict[str, Engine], results: dict[str, list[Run]],
         progress: Callable[[str], None], probes: dict[str, list[Probed]] | None = None) -> Read | str:
    """R over both arms' first runs, their cases and then their cache probes (``probes``: the window crossing, the
    block edge, the continuation start and the stage-prefix cut, which the cases may never reach); or why it cannot
    be read."""
    for name in ("off", "on"):
        if why := models[name].unreferenced():
            return f"the flag-{name} engine ({models[name].name}) gives no cache-free read: {why}"
    arms = {name: Arm() for name in ("off", "on")}
    # per position: where, whether R flips, whether its gap may be judged (Referenced.gaps)
    rows: dict[str, list[tuple[Departure, bool, bool]]] = {"off": [], "on": []}
    memo: dict[tuple, Referenced] = {}
    where: dict[tuple, tuple[str, int, str]] = {}  # a read's first case, turn and arm
    pending: dict[str, list[tuple]] = {"off": [], "on": []}  # sampled turns with no transforms of their own
    floor = {"reference_batch": 0.0, "repeat": _repeat_floor(results["off"]), "controls": 0.0}
    dtype = ""

    def turns(name: str, case: str, conversation, draws: list[Draw | None]) -> None:
        """One case's or probe's turns for one arm; ``draws``: each turn's draw where it was sampled, else None."""
        nonlocal dtype
        model = models[name]
        for n, ((turn, tokens), draw) in enumerate(zip(conversation, draws), 1):
            sampled = draw is not None
            if draw and not isinstance(tokens, str) and len((turn.get("draws") or [[]])[0]) < 4:
                pending[name].append((case, n, draw, list(tokens), turn))  # its draws, from the reference's rows
            if sampled and not turn["top2"]:  # a draw is no flip: without the arm's likeliest tokens nothing to judge
                tokens = "a sampled answer whose server gave no likeliest tokens"
            if isinstance(tokens, str):
                arms[name].unread.append(f"{case} turn {n}: {tokens}")
                break
            steps, asked = len(turn["tokens"]), _asked(turn)
            if steps == 0:
                continue
            # what R reads depends on the tokens and on the two candidates asked about at each position
            key = (id(model), tuple(tokens), tuple(map(tuple, asked)))
            if key not in memo:
                try:
                    memo[key] = r = _read(model, tokens, steps, asked)
                except GatekeeperError as e:  # a probe's own text a server cannot be sent as these tokens: that turn
                    if not case.startswith(PREFIX):
                        raise
                    arms[name].unread.append(f"{case} turn {n}: {e}")
                    break
                where[key] = (case, n, name)
                if len(memo) <= CONTROLS:  # the engine's own cache-free read: what precision alone moves
                    own = _read(model, tokens, steps, asked, own=True)
                    floor["controls"] = max(floor["controls"], *(abs(_asked_gap(a) - _asked_gap(b))
                                                                 for a, b in zip(own.asked, r.asked)))
                    arms[name].controls += steps if r.at is None else len(r.at)
                if not dtype:  # once: the same read as a batch of two
                    again = _read(model, tokens, steps, asked, batch=2)
                    floor["reference_batch"] = max(abs(_gap(a) - _gap(b)) for a, b in zip(r.top2, again.top2))
            r = memo[key]
            dtype = r.dtype
            for j, top, want in zip(range(steps) if r.at is None else r.at, r.top2, r.asked):
                gap = abs(_arm_gap(turn, j) - _asked_gap(want)) if turn["top2"] else 0.0
                d = Departure(case, n, j, _likeliest(turn, j, sampled), int(top[0][0]), _gap(top), gap)
                rows[name].append((d, d.emitted != d.reference, r.gaps))
                arms[name].probed += case.startswith(PREFIX)

    for item in p.items:
        progress(f"reference {item.case_id}")
        for name in ("off", "on"):
            result = results[name][0].get(item.case_id)
            if result is not None and "crash" not in result:
                turns(name, item.case_id, _conversation(p, models[name], name, item, result),
                      [runs.draw(item, n) for n in range(len(result["turns"]))])
    if probes:
        progress("reference cache probes")
    for name, probed in (probes or {}).items():
        if name not in arms or not probed:
            continue
        first = probed[0]
        for pid, result in first.results.items():
            if "crash" not in result and pid in first.read:
                turns(name, pid, zip(result["turns"], first.read[pid]),
                      [probes_.draw(first.decoding, pid)] * len(result["turns"]))
    noise = max(FLOOR, *floor.values())
    tolerance = {"flip_margin": FLIP * noise, "gap": GAP * noise}
    for name, arm in arms.items():
        arm.positions = len(rows[name])
        arm.max_gap = max((d.gap for d, _, _ in rows[name]), default=0.0)
        arm.flips = sum(f for _, f, _ in rows[name])
        for d, flipped, gaps in rows[name]:
            clear = flipped and d.margin > tolerance["flip_margin"]
            if clear or (gaps and d.gap > tolerance["gap"]):
                arm.departed += 1
                arm.flipped += clear
                if len(arm.departures) < KEPT:
                    arm.departures.append(d)
    loaded: dict[str, Any] = {}
    return Read(dtype, arms, floor, tolerance, second=independent.compare(p, memo, where, tolerance, progress, loaded),
                reread=independent.reread(p, models, pending, progress, loaded))


def _read(model: Engine, *args: Any, **kwargs: Any) -> Referenced:
    r = model.reference(*args, **kwargs)
    assert r is not None  # read() asked unreferenced() first
    return r


def _conversation(p: Plan, model: Engine, name: str, item, result):
    """Per turn of an arm's answer: the turn and the whole sequence it was generated from and as (prompt as that arm
    rendered it, then the answer), or why that prompt cannot be rebuilt (then the case stops there)."""
    values = dict(item.case.vars)
    history: list[dict[str, str]] = []
    mode = p.configs[name].render
    for turn_vars, turn in zip(item.case.turns or [{}], result["turns"]):
        values.update(turn_vars)
        rendered = partition.render(model, partition.pieces(p.ws, item.suite, values), mode, history)
        if sha256_hex(rendered.text.encode()) != turn["prompt_digest"]:
            yield turn, "its prompt renders differently now than when it ran"
            return
        yield turn, list(rendered.tokens) + list(turn["tokens"])
        history = [*rendered.messages, {"role": "assistant", "content": turn["text"]}]


def _likeliest(turn: Turn, j: int, sampled: bool) -> int:
    """The arm's pick at step ``j`` as greedy makes it: what it emitted, or where it sampled, its raw likeliest."""
    if sampled:
        return int(turn["top2"][j][0][0])  # type: ignore[index]  # turns() reads no sampled turn without them
    return int(turn["tokens"][j])


def _asked(turn: Turn) -> list[list[int]]:
    """Per generated position, the arm's top-2 tokens (or what it emitted, twice, where it gave no top-2)."""
    if turn["top2"]:
        return [[int(t[0][0]), int(t[1][0])] for t in turn["top2"]]
    return [[int(t), int(t)] for t in turn["tokens"]]


def _arm_gap(turn: Turn, j: int) -> float:
    (_, best), (_, second) = turn["top2"][j]  # type: ignore[index]
    return best - second


def _asked_gap(asked: list[float]) -> float:
    return asked[0] - asked[1]


def _gap(top2: list[list[float]]) -> float:
    return top2[0][1] - top2[1][1]


def _repeat_floor(off: list[Run]) -> float:
    """The flag-off arm against its own repeats: the largest top-2 gap difference where both emitted the same."""
    worst = 0.0
    for again in off[1:]:
        for cid, a in off[0].items():
            b = again.get(cid)
            if b is None or "crash" in a or "crash" in b:
                continue
            for ta, tb in zip(a["turns"], b["turns"]):
                for s, t, x, y in zip(ta["tokens"], tb["tokens"], ta["top2"] or [], tb["top2"] or []):
                    if s != t:  # past here the two read different histories
                        break
                    if [x[0][0], x[1][0]] == [y[0][0], y[1][0]]:
                        worst = max(worst, abs(_gap(x) - _gap(y)))
                if ta["tokens"] != tb["tokens"]:
                    break
    return worst


def judge(found: Read | str | None, verdict: str, reasons: list[str], shared: str,
          detok: Callable[[list[int]], str], exact: bool = True) -> tuple[str, list[str]]:
    """R's word on a verdict: both arms depart: ``base_defect:``, INCONCLUSIVE (the flag's verdict is void); the
    flag-on arm alone: FAIL where the change should be ``exact`` (a change that is not exact moves that arm by
    design, and its own gate judges it: reported); the flag-off arm alone: reported (the flag repairs the base);
    neither: a line of what was read. ``shared``: the cache path both sides run, named in a base_defect. A second,
    independent reference that disagrees with the first makes a PASS ``references_disagree:``, INCONCLUSIVE."""
    if found is None or isinstance(found, str):
        return verdict, reasons
    verdict, reasons = _by_arms(found, verdict, reasons, shared, detok, exact)
    return independent.judge(found.second, verdict, reasons, detok)


def _by_arms(found: Read, verdict: str, reasons: list[str], shared: str, detok: Callable[[list[int]], str],
             exact: bool) -> tuple[str, list[str]]:
    off, on = found.arms["off"], found.arms["on"]

    def where(arm: Arm) -> str:
        return (f"at {arm.departed} of {arm.positions} answer positions, first {arm.departures[0].line(detok)}"
                if arm.departures else "nowhere")

    if found.departs("off") and found.departs("on"):
        return "INCONCLUSIVE", [f"base_defect: both arms depart from a cache-free read of their own answers (flag-off "
                                f"{where(off)}; flag-on {where(on)}): the pipeline's base is broken in {shared}, so "
                                "this flag's verdict is void; fix or change the base, then evaluate again", *reasons]
    if found.departs("on"):
        line = (f"departs_from_reference: the flag-on arm departs from a cache-free read of its own answers "
                f"{where(on)}; the flag-off arm agrees with it")
        if not exact:
            return verdict, reasons + [line + " (a change that is not exact: reported, its gate decides)"]
        if not on.flipped:  # its tokens are the reference's picks: a numeric move, which the drift grades
            return verdict, reasons + [line + " (in its top-2 gaps only, never a token the reference would not "
                                              "pick: drift, which the policy's require and max_drift decide)"]
        return "FAIL", ([line] + reasons if verdict != "FAIL" else reasons + [line])
    if found.departs("off"):
        return verdict, reasons + [f"repairs_base: the flag-off arm departs from a cache-free read of its own answers "
                                   f"{where(off)} and the flag-on arm does not: the flag repairs a defect of the base"]
    if not off.positions or not on.positions:
        unread = (off.unread + on.unread)[:1]
        return verdict, reasons + [f"reference: nothing read of the flag-{'off' if not off.positions else 'on'} arm's "
                                   f"answers{': ' + unread[0] if unread else ''}"]
    t = found.tolerance
    probed = f", {off.probed} and {on.probed} of them in the cache probes" if off.probed or on.probed else ""
    return verdict, reasons + [f"reference: both arms agree with a cache-free {found.dtype} read of their answers at "
                               f"{off.positions} flag-off and {on.positions} flag-on answer positions{probed} (flips counted "
                               f"above a margin of {t['flip_margin']:.2g}, gaps above {t['gap']:.2g}: the measured "
                               f"noise floor {max(found.floor.values()):.2g} times {FLIP:g} and {GAP:g})"]
