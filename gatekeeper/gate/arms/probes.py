"""Cache probes: gatekeeper's own cases for the paths real prefix caches break on, which a battery of
independent cases never takes.

Every run of an evaluation (each configuration and repeat) ends with them, on the same session, in
this order, built from the battery's first single-turn case (prompt P, its answer A):

- ``repeat``: P, then P again: a prompt identical to the one before it (a full hit);
- ``continuation``: P, A (all but its last token, which a server never feeds back) and more text: the previous
  prompt and its answer, then more;
- ``inside``: a prefix of that prompt and its answer: a prompt wholly inside what the server holds;
- ``block``: P with its static part lengthened past the cache's first block (the server's KV block, else
  the profile's chunk), then the same with another case's dynamic part: a hit that crosses a block edge;
- ``window``: a prompt longer than the model's sliding window, then its continuation: reuse of a state
  whose oldest tokens the window no longer attends (skipped when the model has no window and the policy
  names none).

- ``split``: P's next-token choices after its stage prefix, prefilled in one pass and cut at the prefix (the prefix,
  then the rest on top: what reusing a cached prefix runs); an engine whose cut path is broken (positions restarted,
  a state offset lost) answers differently, and an aligned prefill plan cuts the flag-off side there too, so the
  cases alone cannot show it (found on a real mlx-lm bug: ``bench/real_bugs/``). In-process engines only.

They run on both sides in the same order, so the flag-off side's answers are the reference. A probe is
compared as a case is (``probe:NAME`` ids); each side must also answer its repeat as it answered P.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ...battery import partition
from ...engines import sampler
from ...engines.base import Generation, Session, labelled
from ...errors import EngineCrash, described
from ...evidence import CaseResult, Crash, Run, Top2, Turn
from ...identity import sha256_hex
from ...workspace import Decoding
from .. import kinds
from ..run.plans import Plan

PREFIX = "probe:"
SPLIT_ROWS = 16  # next-token choices compared after the cut
FOLLOW = " Also,"  # text after an answer: the model goes on from its own words, so they must be there


@dataclass
class Base:
    """The prompts the probes are built from, rendered as the side renders."""

    stage: str
    tokens: list[int]  # P
    static: int  # tokens of P before its first dynamic byte
    other: list[int]  # another case's prompt of the same suite (P again when there is none)
    follow: list[int]  # the follow-up of a continuation
    stop: list[str]
    decoding: Decoding  # the suite's: a sampled suite's probes draw as its cases do, keyed per probe


@dataclass
class Probed:
    """One run's probes: results by probe id, the probes skipped and why, the seconds they took, and per probe and
    turn the sequence the reference arm reads there (kept in memory; its last positions are the turn's answer)."""

    results: Run = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    read: dict[str, list[list[int]]] = field(default_factory=dict)
    decoding: Decoding | None = None  # the suite's sampled decoding its probes drew under; None: greedy


def why_not(p: Plan) -> str | None:
    """Why no probe runs in this evaluation; None when they run."""
    if not p.policy.probes.kinds:
        return "probes: off in the policy"
    if p.load is not None:
        return "under a load, batching changes outputs: the probes run in evaluations without one"
    if p.ws.engine(p.engine_name).executor == "ray":
        return "executor: ray runs the cases on actors: the probes run in evaluations in this process"
    if not any(len(i.case.turns) <= 1 for i in p.items):
        return "the battery has no single-turn case to build them from"
    return None


def base(session: Session, p: Plan, mode: partition.Mode) -> Base:
    item = next(i for i in p.items if len(i.case.turns) <= 1)
    others = [i for i in p.items if i.suite.suite == item.suite.suite and i is not item and len(i.case.turns) <= 1]

    def rendered(it) -> partition.Rendered:
        values = {**it.case.vars, **(it.case.turns[0] if it.case.turns else {})}
        return partition.render(session.model, partition.pieces(p.ws, it.suite, values), mode)

    r = rendered(item)
    other = rendered(others[0]).tokens if others else r.tokens
    return Base(item.suite.stage, r.tokens, r.static_tokens, other, session.model.tokenize(FOLLOW),
                list(item.suite.decoding.stop), item.suite.decoding)


class _Skip(Exception):
    """A probe that cannot run on this engine (its prompt would not fit)."""


def run(session: Session, p: Plan, mode: partition.Mode) -> Probed:
    """Every probe the policy asks for, in order, on ``session`` (after the battery's cases)."""
    out = Probed()
    spec = p.policy.probes
    b = base(session, p, mode)
    out.decoding = None if b.decoding.plain else b.decoding
    model = session.model
    state: dict[str, Any] = {}
    t0 = time.perf_counter()

    def gen(prompt: list[int]) -> Generation:
        need = len(prompt) + spec.max_tokens
        if model.context is not None and need > model.context:
            raise _Skip(f"does not fit: it needs {need} tokens and the engine holds {model.context}")
        # sampled: one key per probe, the same on both sides and for each of its turns (a repeat draws as the first
        # time), so the penalties' history across the cached prefix and the draws pair as the cases' do
        found = draw(out.decoding, PREFIX + name)
        drawn: dict[str, Any] = {} if found is None else {"sampling": found}
        with labelled(stage=b.stage, stream="gatekeeper-probes"):
            return session.generate(prompt, max_tokens=spec.max_tokens, stop=b.stop, top2=True, **drawn)

    def stretched(length: int, tail: list[int]) -> list[int]:
        """P's static part lengthened to ``length`` tokens with its own text, then ``tail``."""
        head, filler = b.tokens[: b.static], (b.tokens[1: b.static] or b.tokens[1:] or b.tokens)
        while len(head) < length:
            head = head + filler[: length - len(head)]
        return head + tail

    def repeat():
        first, second = gen(b.tokens), gen(b.tokens)
        state["answer"] = second.tokens
        return [(b.tokens, first), (b.tokens, second)]

    def continuation():
        # A server holds the prompt and all of the answer but its last token (never fed back): go on from there
        answer = state["answer"] if "answer" in state else gen(b.tokens).tokens
        prompt = b.tokens + answer[:-1] + b.follow
        g = gen(prompt)
        state["last"] = (prompt, g.tokens)
        return [(prompt, g)]

    def inside():
        prompt, answer = state["last"] if "last" in state else (b.tokens, gen(b.tokens).tokens)
        held = prompt + answer
        cut = len(prompt) + len(answer) // 2 if len(answer) >= 2 else len(prompt) - 1
        return [(held[:cut], gen(held[:cut]))]

    def block():
        size = spec.block or (model.granularity if model.granularity > 1 else p.configs["off"].profile.chunk)
        length = max(b.static, size + size // 2)
        first, second = stretched(length, b.tokens[b.static:]), stretched(length, b.other[b.static:])
        return [(first, gen(first)), (second, gen(second))]

    def window():
        size = spec.window or model.window
        if not size:
            raise _Skip("no sliding window in the model's config; set probes.window in the policy to probe one")
        first = stretched(size + max(size // 4, 8), b.tokens[b.static:])
        if model.context is not None and len(first) + 2 * spec.max_tokens + len(b.follow) > model.context:
            raise _Skip(f"does not fit: a {size}-token window and its continuation need more than the "
                        f"{model.context} tokens the engine holds")
        g = gen(first)
        nxt = first + g.tokens[:-1] + b.follow
        return [(first, g), (nxt, gen(nxt))]

    def split():
        at = b.static
        if not 0 < at < len(b.tokens) - 1:
            raise _Skip("the battery's first case has no stage prefix with text after it to cut at")
        prompt = b.tokens[: at + SPLIT_ROWS]
        rows = session.split(prompt, at)
        if rows is None:
            raise _Skip("a server chooses its own prefill passes: the split probe runs on in-process engines")
        whole, cut = rows
        return [(prompt, _choices(whole, whole)), (prompt, _choices(cut, whole))]

    def read_as(prompt: list[int], g: Generation) -> list[int]:
        """What R reads of one probe turn: its prompt and answer; for ``split``'s teacher-forced rows, the prompt and
        one more token (any: a row never sees the token after it), so that its last rows are those after the cut."""
        return [*prompt, g.tokens[-1]] if name == "split" else [*prompt, *g.tokens]

    steps: dict[str, Callable[[], list[tuple[list[int], Generation]]]] = {
        "repeat": repeat, "continuation": continuation, "inside": inside, "block": block, "window": window,
        "split": split}
    for name in spec.kinds:
        turns: list[Turn] = []
        crash: Crash | None = None
        try:
            for prompt, g in steps[name]():
                turns.append(Turn(**g.to_dict(), static_tokens=0, prompt_digest=sha256_hex(str(prompt).encode())))
                out.read.setdefault(PREFIX + name, []).append(read_as(prompt, g))
        except _Skip as e:
            out.skipped[name] = str(e)
            continue
        except EngineCrash as e:
            crash = Crash(**e.record(), turn=len(turns) + 1)
        except Exception as e:  # noqa: BLE001 - a step after the cases: named in the verdict's probe line, never a crash
            out.skipped[name] = f"failed: {described(e)}"
            continue
        result = CaseResult(turns=turns, text=turns[-1]["text"] if turns else "", outcomes=[])
        if crash:
            result["crash"] = crash
        out.results[PREFIX + name] = result
    out.seconds = time.perf_counter() - t0
    return out


def draw(decoding: Decoding | None, pid: str) -> sampler.Draw | None:
    """A sampled probe's draw: one key for all its turns, on both sides; None: greedy."""
    return None if decoding is None else sampler.Draw(decoding, sampler.key(decoding.seed, pid, 0, 0))


def _choices(rows: list[Top2], reference: list[Top2]) -> Generation:
    """Teacher-forced top-2 rows as a generation: each row's choice and top-2; where the reference row is a near-tie
    its choice stands for both, so float noise between two prefill plans is never read as a break."""
    tokens = [int(ref[0][0] if ref[0][1] - ref[1][1] <= kinds.NEAR_TIE else row[0][0])
              for row, ref in zip(rows, reference)]
    return Generation(tokens=tokens, text="", prompt_tokens=0, cached_tokens=None, prefill_s=0.0, decode_s=0.0,
                      ttft_s=0.0, top2=[[list(x) for x in row] for row in rows])


def self_check(result: CaseResult) -> bool:
    """A side's repeat answered as it answered the same prompt just before."""
    turns = result["turns"]
    return len(turns) < 2 or turns[0]["tokens"] == turns[1]["tokens"]


@dataclass
class Judged:
    """What the probes showed, for the verdict: differences blamed on the flag, a flag-off side that
    disagreed with itself, one line per probe, defects both sides show (``base_defect:``) and notes."""

    differs: list[str]
    unstable: list[str]
    status: dict[str, str]
    seconds: float
    base: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def line(self) -> str:
        if not self.status:
            return ""
        return "probes: " + "; ".join(f"{name} {s}" for name, s in self.status.items())


def judge(p: Plan, off: list[Probed], on: Probed, detok: Callable[[list[int]], str], record,
          unpaired: bool = False) -> Judged:
    """Compare each probe flag-off (every repeat) with flag-on; ``record(pid, equal, detail)`` writes a comparison.
    ``unpaired``: the engine's draws do not follow their keys (gate/stats/unpaired.py), so probes that drew compare nothing."""
    differs, unstable, base, notes, status = [], [], [], [], {}
    for name in p.policy.probes.kinds:
        pid = PREFIX + name
        skipped = on.skipped.get(name) or off[0].skipped.get(name)
        if skipped:
            status[name] = f"skipped: {skipped}"
            continue
        if unpaired and off[0].decoding is not None:
            status[name] = "unpaired"  # independent draws on each side: their tokens show nothing
            continue
        ref, mine = off[0].results[pid], on.results[pid]
        if any("crash" in r for r in (ref, mine, *(o.results[pid] for o in off[1:]))):
            status[name] = "crashed"  # named with the cases' crashes (gate/arms/crashes.py)
            continue
        status[name] = "equal"
        for r, other in enumerate(off[1:], 1):
            d = kinds.token_diff(ref, other.results[pid], detok)
            record(pid, d is None, {"pair": f"off#0~off#{r}", **(d or {})})
            if d is not None:
                unstable.append(f"baseline_unstable: {pid} gave different outputs on repeated flag-off runs (off#0 vs "
                                f"off#{r}: turn {d['turn']} {kinds.divergence(d, ('off#0', f'off#{r}'))})")
                status[name] = "baseline_unstable"
        if name == "split" and (broken := [side for side, r in (("flag-off", ref), ("flag-on", mine)) if not self_check(r)]):
            # a finding about each side that shows it: both is the base's defect, the flag-on side alone the flag's
            whole, cut = ((ref if broken[0] == "flag-off" else mine)["turns"][i]["tokens"] for i in (0, 1))
            i = kinds.first_divergence(whole, cut)
            where = (f"chose otherwise with the prefill cut at the stage prefix (token {i + 1} after it: {whole[i]} in "
                     f"one pass, {cut[i]} cut)")
            if len(broken) == 2:
                base.append(f"base_defect: {pid} both sides {where}: the engine's cut path is broken whatever the flag "
                            "(an aligned prefill cuts the flag-off side there too), so this flag's verdict is void; fix "
                            "or change the engine, then evaluate again")
                status[name] = "base_defect"
            elif broken == ["flag-on"]:
                differs.append(f"differs: {pid} the flag-on side {where}: reusing a cached prefix changes the model's "
                               "answers, whatever the cases showed")
                status[name] = "differs"
            else:
                notes.append(f"repairs_base: {pid} the flag-off side {where} and the flag-on side does not")
                status[name] = "repairs_base"
            continue
        if name == "repeat" and not self_check(ref):
            unstable.append(f"stale_state: {pid} the flag-off side answered a prompt identical to the one before it "
                            "differently: the deployment reuses state with the flag off too (a server's own prefix "
                            "matching) and that reuse is broken, so no baseline can be taken from it (llama-cpp-python "
                            "before 0.3.17 on a recurrent model does this: bench/real_bugs/)")
            status[name] = "baseline_unstable"
        if status[name] != "equal":
            continue
        d = kinds.token_diff(ref, mine, detok) if p.kind.numeric else None  # other kinds change outputs by design
        if p.kind.numeric:
            record(pid, d is None, {"pair": "off#0~on#0", **(d or {})})
        if d is not None:
            differs.append(f"differs: {pid} turn {d['turn']} first divergent token at position "
                           f"{d['first_divergent_position']} {kinds.divergence(d)}")
        elif name == "repeat" and not self_check(mine):
            differs.append(f"differs: {pid} the flag-on side answered a prompt identical to the one before it "
                           "differently from the first time (a stale or corrupted cached state)")
        else:
            continue
        status[name] = "differs"
    seconds = sum(o.seconds for o in off) / max(len(off), 1) + on.seconds
    return Judged(differs, unstable, status, round(seconds, 3), base, notes)
