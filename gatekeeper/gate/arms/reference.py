"""The reference arm R: each arm's own answers read again, teacher-forced, in ONE forward pass over the whole
conversation with no cache object at all (``Engine.reference``: eager attention, float64 where the model is small).

An on/off comparison cannot see a defect both arms share: with the pipeline on a broken cache class, both sides run
it and agree. R can. At every generated position of each arm it asks two things of a read that no cache touched:
is the token the arm emitted the one R picks (a flip), and how far is the arm's top-2 logit gap from R's gap
between the same two tokens (a gap, which no normalisation moves).

Neither is judged against a fixed tolerance but against a floor calibrated in the same evaluation, on the path the
arms take and none of their cache handling: a share of the answers (chosen by a hash of their tokens, never by their
values) read again by the engine's own model, stepping through the answer on a fresh cache where its decode runs
another algorithm than a one-pass read (recurrent layers: a recurrence against a chunked scan), else in one pass
(``calibrate``). The floor is an order statistic of those reads' gap differences. A flip counts where R's margin
exceeds ``FLIP`` floors; gaps depart only together, where so many of an arm's positions outside the calibration answers
exceed ``GAP`` floors that exchangeable noise gives that many with a chance of at most ``ALPHA`` (``gap_test``): a
smooth decode-vs-scan difference on every position is no departure, a cache that moves every step is.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence, cast

from ...battery import partition
from ...engines.base import Engine, Referenced
from ...engines.sampler import Draw
from ...errors import GatekeeperError
from ...evidence import NOT_FAIL, Ruling, Run, Turn
from ...identity import sha256_hex
from ...summaries import ReferenceCalibration, ReferenceSummary
from ..run import runs
from ..run.plans import Plan
from . import independent
from . import probes as probes_
from .probes import PREFIX, Probed

FLIP = 10.0  # a flip counts where R's top-1/top-2 margin exceeds this many floors
GAP = 10.0  # a gap is counted above this many floors: the allowance for positions of one answer moving together
FLOOR = 1e-6  # the least noise assumed: float64 against float64 can be exactly equal
ALPHA = 0.01  # per arm: the chance that a correct arm's gaps alone read as a departure, positions exchangeable
ORDER = 2  # the floor is the ORDER-th largest calibration gap: no single position sets it
SHARE = 4  # one distinct answer in SHARE calibrates the floor,
CONTROLS = 2  # at least this many,
CALIBRATED = 16  # at most this many
KEPT = 5  # departures kept in the record per arm (the count holds them all)


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
    controls: int = 0  # positions in the calibration answers (read again to set the floor; their gaps are not judged)
    flips: int = 0  # R's pick differs, at any margin
    departures: list[Departure] = field(default_factory=list)  # the first KEPT
    departed: int = 0
    flipped: int = 0  # of those, R picks another token by a margin above the tolerance (the others: the gap only)
    max_gap: float = 0.0
    unread: list[str] = field(default_factory=list)  # turns R could not read, and why
    probed: int = 0  # of the positions, those in the cache probes' answers (gate/arms/probes.py)
    judged: int = 0  # positions whose gaps the count judges (outside the calibration answers, top-2 given, gaps read)
    exceeded: int = 0  # of those, gaps above the tolerance
    needed: int | None = None  # the count at which the gaps depart (None: no count this small is unlikely enough)
    p: float = 1.0  # the chance of at least ``exceeded`` under exchangeable positions


def _uncalibrated() -> ReferenceCalibration:
    """What ``calibrate`` records when it reads nothing."""
    return {"source": "none", "reads": 0, "of": 0}


@dataclass
class Read:
    """R's reading of both arms, the floors it was judged against, and what it took."""

    dtype: str
    arms: dict[str, Arm]
    floor: dict[str, float]  # reference_batch, repeat, calibration
    tolerance: dict[str, float]  # flip_margin, gap
    seconds: float = 0.0
    reads: int = 0  # cache-free reads made: an answer both arms gave, on the same weights, is read once
    second: independent.Second | None = None
    reread: dict[str, independent.Reread] = field(default_factory=dict)  # gate/stats/pit.py reads it (pit's counts record it)
    calibration: ReferenceCalibration = field(default_factory=_uncalibrated)  # where the floor came from (``calibrate``)

    def departs(self, arm: str) -> bool:
        return self.arms[arm].departed > 0

    def to_dict(self) -> ReferenceSummary:
        out = {k: v for k, v in asdict(self).items() if k != "reread"}
        return cast(ReferenceSummary, {**out, "departs": {k: self.departs(k) for k in self.arms}})


@dataclass
class Row:
    """One generated position of one arm, as R read it."""

    departure: Departure
    flips: bool  # R picks another token there (at any margin)
    judged: bool  # its gap may be judged (the arm gave its top-2, the read gives gaps)
    content: tuple  # the read's tokens and asked pairs: which answer it is, whichever arm read it


@dataclass
class GapTest:
    """An arm's gaps against the floor: ``judged`` positions, ``exceeded`` above the tolerance, the count ``needed``
    for a departure and the chance ``p`` of at least ``exceeded`` when every position is exchangeable."""

    judged: int
    exceeded: int
    needed: int | None
    p: float
    alpha: float = ALPHA

    @property
    def departs(self) -> bool:
        return self.p <= self.alpha


def law(n: int, m: int, k: int) -> list[float]:
    """P(X = j) for j = 0..m, X the number of ``m`` judged values above the ``k``-th largest of ``n`` calibration values,
    all ``n + m`` exchangeable (no ties): with j judged values above it, the judged values fill j of the ``j + k - 1``
    ranks above it and ``m - j`` of the ``m - j + n - k`` below."""
    total = math.comb(n + m, m)
    return [math.comb(j + k - 1, j) * math.comb(m - j + n - k, m - j) / total for j in range(m + 1)]


def tail(n: int, m: int, k: int, x: int) -> float:
    """P(X >= x) (``law``)."""
    return 1.0 if x <= 0 else sum(law(n, m, k)[x:])


def needed(n: int, m: int, k: int, alpha: float = ALPHA) -> int | None:
    """The least count of ``m`` judged values above the ``k``-th largest of ``n`` whose chance is at most ``alpha``."""
    least, above = None, 0.0
    for x, p in reversed(list(enumerate(law(n, m, k)))):
        above += p
        if above > alpha or x == 0:
            return least
        least = x
    return least


def order_statistic(values: Sequence[float]) -> tuple[float, int]:
    """The floor from calibration gap differences: their ``ORDER``-th largest (all of them where fewer), and which."""
    k = min(ORDER, len(values))
    return (sorted(values, reverse=True)[k - 1] if k else 0.0), k


def gap_test(values: Sequence[float], tolerance: float, n: int, k: int, alpha: float = ALPHA) -> GapTest:
    """An arm's judged gap differences (``values``) against ``tolerance``, a floor that is the ``k``-th largest of ``n``
    calibration values times an allowance of at least 1 (counting above more than the floor only lowers the count):
    the count above it is judged by its law under exchangeability (``tail``), so a correct arm departs by its gaps with
    probability at most ``alpha``. With no calibration there is no law: nothing departs."""
    m, x = len(values), sum(v > tolerance for v in values)
    if not n or not m:
        return GapTest(m, x, None, 1.0, alpha)
    return GapTest(m, x, needed(n, m, k, alpha), tail(n, m, k, x), alpha)


def read(p: Plan, models: dict[str, Engine], results: dict[str, list[Run]],
         progress: Callable[[str], None], probes: dict[str, list[Probed]] | None = None) -> Read | str:
    """R over both arms' first runs, their cases and then their cache probes (``probes``: the window crossing, the
    block edge, the continuation start and the stage-prefix cut, which the cases may never reach); or why it cannot
    be read."""
    for name in ("off", "on"):
        if why := models[name].unreferenced():
            return f"the flag-{name} engine ({models[name].name}) gives no cache-free read: {why}"
    arms = {name: Arm() for name in ("off", "on")}
    rows: dict[str, list[Row]] = {"off": [], "on": []}
    memo: dict[tuple, Referenced] = {}
    where: dict[tuple, tuple[str, int, str]] = {}  # a read's first case, turn and arm
    pending: dict[str, list[tuple]] = {"off": [], "on": []}  # sampled turns with no transforms of their own
    floor = {"reference_batch": 0.0, "repeat": _repeat_floor(results["off"])}
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
            # what R reads depends on its weights, the tokens and the two candidates asked about at each position: an
            # answer both arms gave is read once where their engines read with the same weights (``reference_key``)
            key = ((model.reference_key(), model.profile.reference_model), tuple(tokens), tuple(map(tuple, asked)))
            if key not in memo:
                try:
                    memo[key] = r = _read(model, tokens, steps, asked)
                except GatekeeperError as e:  # a probe's own text a server cannot be sent as these tokens: that turn
                    if not case.startswith(PREFIX):
                        raise
                    arms[name].unread.append(f"{case} turn {n}: {e}")
                    break
                where[key] = (case, n, name)
                if not dtype:  # once: the same read as a batch of two
                    again = _read(model, tokens, steps, asked, batch=2)
                    floor["reference_batch"] = max(abs(_gap(a) - _gap(b)) for a, b in zip(r.top2, again.top2))
            r = memo[key]
            dtype = r.dtype
            for j, top, want in zip(range(steps) if r.at is None else r.at, r.top2, r.asked):
                gap = abs(_arm_gap(turn, j) - _asked_gap(want)) if turn["top2"] else 0.0
                d = Departure(case, n, j, _likeliest(turn, j, sampled), int(top[0][0]), _gap(top), gap)
                rows[name].append(Row(d, d.emitted != d.reference, bool(turn["top2"]) and r.gaps, key[1:]))
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
    if memo:
        progress("reference calibration")
    values, chosen, calibration = calibrate(memo, {key: models[arm] for key, (_, _, arm) in where.items()})
    floor["calibration"], k = order_statistic(values)
    noise = max(FLOOR, *floor.values())
    tolerance = {"flip_margin": FLIP * noise, "gap": GAP * noise}
    for name, arm in arms.items():
        _judge(arm, rows[name], chosen, tolerance, len(values), k)
    calibration["positions"] = len(values)
    calibration["order"] = k
    calibration["floor"] = floor["calibration"]
    calibration["alpha"] = ALPHA
    loaded: dict[str, Any] = {}
    return Read(dtype, arms, floor, tolerance, reads=len(memo), second=independent.compare(p, memo, where, tolerance, progress, loaded),
                reread=independent.reread(p, models, pending, progress, loaded), calibration=calibration)


def calibrate(memo: dict[tuple, Referenced], engines: dict[tuple, Engine]) -> tuple[list[float], set[tuple], ReferenceCalibration]:
    """The floor's calibration: one distinct answer in ``SHARE`` (at least ``CONTROLS``, at most ``CALIBRATED``),
    chosen by a hash of its tokens, so never by what was read there, read again by its arm's engine on the path its
    decode takes with none of the pipeline's cache handling (``Engine.stepped``: its own model stepping through the
    answer on a fresh cache, where its decode runs another algorithm than a one-pass read), else its own model in one
    pass (``own``: its dtype and kernels). Returns each calibration position's gap difference against R (between the
    two tokens the arm gave), the answers chosen (their gaps are not judged) and the record's account of them."""
    contents: dict[tuple, tuple] = {}
    for key in memo:  # an answer both arms gave is one answer: read once, judged in neither arm
        contents.setdefault(key[1:], key)
    order = sorted(contents, key=lambda c: sha256_hex(repr(c).encode()))
    chosen = order[:min(CALIBRATED, max(CONTROLS, math.ceil(len(order) / SHARE)))]
    values: list[float] = []
    sources: set[str] = set()
    for content in chosen:
        key = contents[content]
        model, r = engines[key], memo[key]
        tokens, asked = list(key[1]), [list(a) for a in key[2]]
        again = model.stepped(tokens, len(asked), asked)
        sources.add("the engine's own model stepping through the answer on a fresh cache" if again is not None
                    else "the engine's own model in one pass")
        if again is None:
            again = _read(model, tokens, len(asked), asked, own=True)
        positions = range(len(asked)) if r.at is None else r.at
        values += [abs(_asked_gap(a) - _asked_gap(b)) for j, a, b in zip(positions, again.asked, r.asked)
                   if asked[j][0] != asked[j][1]]  # an arm that gave no top-2 asks one token twice: no gap to read
    return values, set(chosen), {"source": "; ".join(sorted(sources)) or "none", "reads": len(chosen),
                                 "of": len(order)}


def _judge(arm: Arm, rows: list[Row], chosen: set[tuple], tolerance: dict[str, float], n: int, k: int) -> None:
    """One arm against the floor: each clear flip departs; its gaps outside the calibration answers depart together
    where their count above the tolerance is unlikely for exchangeable noise (``gap_test``)."""
    arm.positions = len(rows)
    arm.max_gap = max((row.departure.gap for row in rows), default=0.0)
    arm.flips = sum(row.flips for row in rows)
    arm.controls = sum(row.content in chosen for row in rows)
    judged = [row for row in rows if row.judged and row.content not in chosen]
    test = gap_test([row.departure.gap for row in judged], tolerance["gap"], n, k)
    arm.judged, arm.exceeded, arm.needed, arm.p = test.judged, test.exceeded, test.needed, test.p
    counted = {id(row) for row in judged if test.departs and row.departure.gap > tolerance["gap"]}
    for row in rows:
        clear = row.flips and row.departure.margin > tolerance["flip_margin"]
        if clear or id(row) in counted:
            arm.departed += 1
            arm.flipped += clear
            if len(arm.departures) < KEPT:
                arm.departures.append(row.departure)


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


def judge(found: Read | str | None, shared: str, detok: Callable[[list[int]], str], exact: bool = True) -> Ruling:
    """R's word: both arms depart: ``base_defect:``, INCONCLUSIVE (the flag's verdict is void); the flag-on arm alone:
    FAIL where the change should be ``exact`` (a change that is not exact moves that arm by design, and its own gate
    judges it: reported); the flag-off arm alone: reported (the flag repairs the base); neither: a line of what was
    read. ``shared``: the cache path both sides run, named in a base_defect. (A second, independent reference is
    ``independent.judge``'s.)"""
    if found is None or isinstance(found, str):
        return Ruling()
    off, on = found.arms["off"], found.arms["on"]

    def where(arm: Arm) -> str:
        return (f"at {arm.departed} of {arm.positions} answer positions, first {arm.departures[0].line(detok)}"
                if arm.departures else "nowhere")

    if found.departs("off") and found.departs("on"):
        return Ruling("INCONCLUSIVE", [f"base_defect: both arms depart from a cache-free read of their own answers "
                                       f"(flag-off {where(off)}; flag-on {where(on)}): the pipeline's base is broken in "
                                       f"{shared}, so this flag's verdict is void; fix or change the base, then evaluate "
                                       "again"])
    if found.departs("on"):
        line = (f"departs_from_reference: the flag-on arm departs from a cache-free read of its own answers "
                f"{where(on)}; the flag-off arm agrees with it")
        if not exact:
            return Ruling(notes=[line + " (a change that is not exact: reported, its gate decides)"])
        if not on.flipped:  # its tokens are the reference's picks: a numeric move, which the drift grades
            return Ruling(notes=[line + " (in its top-2 gaps only, never a token the reference would not pick: drift, "
                                        "which the policy's require and max_drift decide)"])
        return Ruling("FAIL", [line], over=NOT_FAIL)
    if found.departs("off"):
        return Ruling(notes=[f"repairs_base: the flag-off arm departs from a cache-free read of its own answers "
                             f"{where(off)} and the flag-on arm does not: the flag repairs a defect of the base"])
    if not off.positions or not on.positions:
        unread = (off.unread + on.unread)[:1]
        return Ruling(notes=[f"reference: nothing read of the flag-{'off' if not off.positions else 'on'} arm's "
                             f"answers{': ' + unread[0] if unread else ''}"])
    t, c = found.tolerance, found.calibration
    probed = f", {off.probed} and {on.probed} of them in the cache probes" if off.probed or on.probed else ""
    return Ruling(notes=[f"reference: both arms agree with a cache-free {found.dtype} read of their answers at "
                         f"{off.positions} flag-off and {on.positions} flag-on answer positions{probed} (flips counted "
                         f"above a margin of {t['flip_margin']:.2g}, gaps above {t['gap']:.2g}: {FLIP:g} and {GAP:g} "
                         f"times the floor {max(found.floor.values()):.2g}, {floor_line(c)}; {count_line(off, on)})"])


def count_line(off: Arm, on: Arm) -> str:
    """How many counted gaps an arm departs from, per arm."""
    if not off.needed and not on.needed:
        return (f"gaps alone cannot depart: {off.judged} and {on.judged} judged positions give no count whose chance is "
                f"at most {ALPHA:g}")
    each = [f"{a.needed} of the flag-{name} arm's {a.judged} judged positions" if a.needed else
            f"never in the flag-{name} arm's {a.judged}" for name, a in (("off", off), ("on", on))]
    return f"gaps depart only by a count whose chance is at most {ALPHA:g} for exchangeable noise: {', '.join(each)}"


def floor_line(c: ReferenceCalibration) -> str:
    """Where the floor came from, in words: which reads, how many positions, which order statistic."""
    if not c.get("positions"):
        return "no calibration read (the batch and repeat floors alone; gaps are not judged)"
    nth = {1: "largest", 2: "second largest", 3: "third largest"}.get(c["order"], f"{c['order']}th largest")
    return (f"calibrated as the {nth} gap difference at {c['positions']} positions of {c['reads']} of {c['of']} answers "
            f"read again by {c['source']}")
