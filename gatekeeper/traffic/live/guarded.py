"""The guard in the proxy: after a flip, a share of live requests goes again to the flag-off side, the two answers
are compared, the evidence is appended to the ledger in batches, and a breach of the policy's rule turns the flag
off by itself.

The client's answer is never touched: a request is offered to the guard only once its answer has been written out
in full, and the shadow request runs as a background task with its own timeout and a cap on how many run at once
(over it, or over the token budget, the shadow is dropped and counted, never queued). Ledger writes and the rule
run on one writer thread, so the event loop never waits on the database; the rule is decided on what the ledger
holds, which is also what a restarted proxy resumes from (``gate/guard.py``): the batches written under the rule
in force now; a rule changed since is a new test, and every batch records its rule and segment. A rollback is a
flip to off signed with the service key (``--sign``, a key in ``policies/allowed_signers``) whose reason names the
batches; the proxy then serves every request from the flag-off side and shadows nothing more. Turning the flag on
again takes a new evaluation and a human flip, as always.

The A/A baseline (the policy's ``aa_rate``): a share of the shadowed requests goes to the flag-off side a second
time (or to a second flag-off replica, ``baseline``), one after the other on one side and at once on two, and the two
flag-off answers are compared too; each stage's row of a batch then counts ``aa_compared``, ``aa_mismatches`` and
the discordant requests (``ab_only``: only flag-on vs flag-off parted; ``aa_only``: only flag-off vs flag-off),
which the rule's baseline-aware test reads. A second answer that does not come back drops the A/A comparison only.

Failures are evidence: a live request the flag-on side failed (an error status, a dropped connection, an answer cut
off mid-stream, a timeout) is shadowed like any other, and where the flag-off side answers it, it is a parting
(``flag_on_failed``, counted by the rule, kept with its status and error). The flag-off side failing is no fault of
the flag: that shadow is dropped, and counted by its reason.

One test for a fleet: N proxies in front of N replicas, each with its own guard on one ledger (a team's
PostgreSQL), are one watch. Before each write a guard folds in every batch written since it last looked, whichever
proxy wrote it (``gate/guard.py``'s ``Watch``), so its tests, and the alpha they hold, are the fleet's; each batch names
the proxy that wrote it. Each request reads a cheap stamp of the ledger (as the OFREP server does) and, when it moved,
the flag's state: a rollback written by one proxy turns every other one to the flag-off side within a request.

The live side's health (the policy's ``min_success_rate``, ``max_latency_s``): every live request is counted before
any is picked for a shadow, as failed (a 5xx, no response, a cut answer; a 4xx is the client's) and as slow (over
``max_latency_s`` from the request to its last byte), in the batch's ``served``, which the rule's one-sample tests read.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import threading
import time
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Callable

from ...errors import GatekeeperError
from ...gate.guard import (
    AA,
    ALL,
    ASSERTIONS,
    DISTANCE,
    FAILED,
    KEPT,
    SLOW,
    SUCCESS,
    Count,
    Judged,
    Rule,
    Segment,
    Served,
    Test,
    Watch,
)
from ...gate.state import rollout as rollouts
from ...shadows import Kept, Raise, Rollback, ShadowSummary
from ...summaries import FlipRow
from ..captures.capture import metadata
from . import shadow
from .judge import Judge, Judgement, Reader

if TYPE_CHECKING:
    import aiohttp

    from ...signing import SigningKey
    from ...workspace import Workspace

CLOSING_S = 5  # at shutdown, shadows still running get this long to finish
LATENCY = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)  # histogram buckets of a shadow request, seconds


@dataclass
class Failed:
    """A live request the flag-on side did not answer: its status (0: no response at all) and what broke it."""

    status: int
    error: str

    def cost(self, request: dict) -> int:
        """The tokens its shadow may cost: the request's own cap, else a short answer's."""
        cap = request.get("max_tokens") or request.get("max_completion_tokens")
        return cap if isinstance(cap, int) and cap > 0 else 16


@dataclass
class Batch:
    """What the guard saw since the last record: every request, what was compared and what was not."""

    requests: int = 0
    failed: int = 0  # live requests the flag-on side failed (shadowed or not)
    slow: int = 0  # live requests slower than the rule's max_latency_s
    shadowed: int = 0
    stages: dict[str, dict[str, int]] = field(default_factory=dict)  # stage -> compared, mismatches, unpaired (+ AA)
    unpaired: dict[str, int] = field(default_factory=dict)  # reason -> requests
    dropped: dict[str, int] = field(default_factory=dict)  # reason -> requests
    shapes: dict[str, int] = field(default_factory=dict)  # prompt size class -> comparisons
    judged: Judged = field(default_factory=Judged)  # the evaluation's comparisons (judge.py)
    mismatches: list[Kept] = field(default_factory=list)

    def compared(self) -> int:
        return sum(s.get("compared", 0) for s in self.stages.values())

    def eventful(self) -> bool:
        return bool(self.stages or self.unpaired or self.dropped or self.failed or self.slow)

    def stage(self, name: str) -> dict[str, int]:
        return self.stages.setdefault(name, {"compared": 0, "mismatches": 0, "unpaired": 0})

    def summary(self) -> ShadowSummary:
        out: ShadowSummary = {"requests": self.requests, "shadowed": self.shadowed, "stages": self.stages,
                              "unpaired": self.unpaired, "dropped": self.dropped, "shapes": self.shapes}
        if self.judged != Judged():
            out["judged"] = vars(self.judged).copy()
        return out


class Guarded:
    """One flag's guard, bound to a workspace, its ledger and the flag-off side's URL."""

    def __init__(self, ws: Workspace, ledger_url: str, flag: str, other: str, key: SigningKey, *,
                 operator: str = "guard", no_text: bool = False, webhook: str | None = None,
                 say: Callable[[str], None] = lambda line: None, seed: int | None = None, baseline: str | None = None,
                 name: str | None = None, reader: Reader | None = None):
        import socket

        from ...ledger.stamp import LedgerStamp

        self.ws, self.url, self.flag, self.other = ws, ledger_url, flag, other.rstrip("/")
        self.name = name or f"{socket.gethostname()}:{os.getpid()}"  # this proxy, in a fleet's batches
        self.baseline = baseline.rstrip("/") if baseline else None  # a second flag-off replica for the A/A share
        policy = ws.policy(flag)
        if policy.guard is None:
            raise GatekeeperError(f"{ws.root / 'policies' / (flag + '.yaml')}: no 'guard:' section; add one, e.g. "
                                  "guard: {rate: 0.1, limit: 0, alpha: 0.05, min_comparisons: 20}")
        self.policy = policy.guard
        self.rollout = policy.rollout  # by steps (gate/state/rollout.py): the share the flag-on side serves
        self.rule = Rule.of(self.policy)
        if self.policy.distance and reader is None:
            raise GatekeeperError(f"{ws.root / 'policies' / (flag + '.yaml')}: field 'guard.distance': the teacher-forced "
                                  "distance is read from both servers through an http profile's dialect; run the proxy "
                                  "with --shadow-engine NAME, or set 'distance: false' (in process it cannot be read)")
        # the evaluation's comparisons on each compared request: the suite's assertions, the forced distance
        self.judge = (Judge(ws, self.policy.assertions, reader, self.policy.max_kld)
                      if self.policy.assertions or reader is not None else None)
        self.key, self.operator, self.no_text = key, operator, no_text
        self.salt = os.urandom(16)  # digests in the ledger cannot be looked up against known prompts
        self.webhook, self.say = webhook, say
        self.sampler = shadow.Sampler(self.policy.rate, self.policy.stages, self.policy.tokens_per_minute, seed,
                                      self.policy.aa_rate)
        self.batch = Batch()
        self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gatekeeper-guard")
        self.in_flight = 0
        self.tasks: set[asyncio.Task] = set()
        self.on = True
        self.rollback: Rollback | None = None  # the rollback's flip, once made
        self.totals = {"requests": 0, "failed": 0, "slow": 0, "shadowed": 0, "compared": 0, "mismatches": 0, FAILED: 0,
                       **dict.fromkeys(AA, 0), **{f"judged_{k}": 0 for k in vars(Judged())}}
        self.unpaired: dict[str, int] = {}
        self.dropped: dict[str, int] = {}
        self.latency = [0] * (len(LATENCY) + 1)
        self.latency_sum = 0.0
        self._check_signer()
        self.flip_id, self.watch = self._resume()
        self.step_since = time.monotonic()  # a (re)started guard holds the step in force hold_s before raising it
        self.own: set[int] = set()  # the batches this guard wrote since the watch last read the ledger
        self._segment()
        self.stamp = LedgerStamp(ledger_url, recheck_s=60)  # read per request (current)
        self._stamp: tuple | None = None
        self.reader: Any = None  # a ledger opened once for those reads

    # --- at startup ------------------------------------------------------------------------------
    def _check_signer(self) -> None:
        """The rollback must be signable: the service key is in allowed_signers now."""
        from datetime import datetime, timezone

        from ...signing import fingerprint

        allowed = self.ws.allowed_signers
        if allowed is None or allowed.principal(self.key.blob, datetime.now(timezone.utc)) is None:
            raise GatekeeperError(f"--sign: key {fingerprint(self.key.blob)} may not sign for anyone in "
                                  f"{self.ws.allowed_signers_path}; the guard signs its rollbacks with it: add a line "
                                  "'PRINCIPAL KEY-TYPE KEY' for the service key")

    def _resume(self) -> tuple[int, Watch]:
        """The flip to on being watched, and its segments as the ledger holds them (a restart resumes its rule's)."""
        from ...ledger import Ledger

        with Ledger(self.url) as ledger:
            if not ledger.verify(self.ws.root).ok:
                raise GatekeeperError("the ledger does not verify; the guard appends to it only when it does: "
                                      "see 'gatekeeper ledger verify'")
            last = ledger.flag_states().get(self.flag)
            if last is None or last["state"] != "on":
                raise GatekeeperError(f"{self.flag} is off; the guard watches a flag that is on: flip it on first "
                                      "(gatekeeper flip FLAG on --evaluation ID)")
            return last["id"], Watch(ledger.shadows(self.flag, last["id"]))

    def _segment(self) -> None:
        """Test the segment of the rule in force; the others' evidence stands as it was, under their own rules."""
        self.segment = self.watch.segment(self.rule)
        self.counts = self.segment.counts
        self.tests: list[Test] = self.segment.tests()
        self.before = [(seg, t) for seg in self.watch.segments if seg is not self.segment for t in seg.tests() if t.breached]

    def _fold(self, ledger) -> None:
        """Every batch written since the watch last looked, by the other proxies of a fleet (this one's are in)."""
        step = self.watch.step
        for b in ledger.shadows(self.flag, self.flip_id, after=self.watch.seen):
            if b["id"] in self.own:
                self.own.discard(b["id"])
                self.watch.seen = max(self.watch.seen, b["id"])
            else:
                self.watch.add(b)
        if self.watch.step != step:  # another proxy of the fleet raised the step
            self.step_since = time.monotonic()
        self._segment()

    @property
    def share(self) -> float:
        """The share of requests the flag-on side serves: the rollout's step in force, else all of them."""
        return 1.0 if self.rollout is None else self.rollout.steps[self.watch.step]

    def serves(self, key: str) -> bool:
        """Whether the flag-on side serves a request of this key now (a rollout's share; else every request)."""
        return rollouts.serves_on(self.flag, key, self.share)

    # --- on the request path (before the answer) -------------------------------------------------
    def current(self) -> bool:
        """Whether the watch goes on: a cheap stamp of the ledger per request and, when it moved, the flag's state, so a
        rollback (or a flip) written by another proxy of a fleet turns this one to the flag-off side at once."""
        if not self.on:
            return False
        stamp = self.stamp.stamp()
        if stamp != self._stamp:
            from ...ledger import Ledger

            if self.reader is None:
                self.reader = Ledger(self.url, read_only=True)
            last = self.reader.flag_states().get(self.flag)
            self._stamp = stamp
            if self.on and (last is None or last["id"] != self.flip_id):
                self._stop(last)
        return self.on

    def _stop(self, last: FlipRow | None) -> None:
        self.on = False
        self.say(f"gatekeeper guard: {self.flag} was flipped {last['state'] if last else 'off'} by "
                 f"{last['operator'] if last else 'someone'}; the guard stops and every request goes to {self.other}")

    # --- on the request path (after the answer) --------------------------------------------------
    def offer(self, session: aiohttp.ClientSession, path: str, stage: str, headers: dict[str, str], body: bytes,
              status: int, answer: bytes | None, sse: bool, error: str | None = None, seconds: float = 0.0) -> None:
        """A live call whose answer has gone out in full, or failed (an error status, or ``error``: what broke it),
        ``seconds`` after it came in: count it, and maybe shadow it. Never raises, never waits."""
        if not self.count(stage, error is not None or status >= 500 or status == 0, seconds):
            return
        if error is None and status != 200:
            error = f"answered {status}"
        request = shadow.document(body)
        if request is None:
            return
        live = Failed(status, error) if error is not None else shadow.read(answer or b"", sse)
        twice = self.admit(stage, request, live)
        if twice is None:
            return
        assert live is not None  # admit drops an unreadable answer
        task = asyncio.get_running_loop().create_task(self._shadow(session, path, stage, headers, request, live, twice))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def count(self, stage: str, failed: bool, seconds: float) -> bool:
        """Count a live call (failed, slow) in the batch; whether it is picked for a shadow (the watch is on)."""
        self.batch.requests += 1
        self.totals["requests"] += 1
        if not self.on:
            return False
        for name, counts in (("failed", failed),
                             ("slow", self.rule.max_latency_s is not None and seconds > self.rule.max_latency_s)):
            setattr(self.batch, name, getattr(self.batch, name) + counts)
            self.totals[name] += counts
        return self.sampler.pick(stage)

    def admit(self, stage: str, request: dict, live: shadow.Answer | Failed | None) -> bool | None:
        """A picked call's shadow, counted as in flight: whether it also goes to the flag-off side twice (A/A); None
        where it is not shadowed (unpaired decoding, an unreadable answer, too many in flight, the token budget)."""
        reason = shadow.unpaired(request)
        if reason is not None:
            self.batch.stage(stage)["unpaired"] += 1
            self._count(self.batch.unpaired, self.unpaired, reason)
            return None
        if live is None or self.in_flight >= self.policy.in_flight:
            self._drop("live answer unreadable" if live is None else "too many in flight")
            return None
        twice = isinstance(live, shadow.Answer) and self.sampler.twice()  # an A/A comparison too: it costs twice
        if not self.sampler.afford((1 + twice) * live.cost(request)):
            self._drop("token budget")
            return None
        self.in_flight += 1
        self.batch.shadowed += 1
        self.totals["shadowed"] += 1
        return twice

    def _count(self, batch: dict[str, int], total: dict[str, int], reason: str) -> None:
        batch[reason] = batch.get(reason, 0) + 1
        total[reason] = total.get(reason, 0) + 1

    def _drop(self, reason: str) -> None:
        self._count(self.batch.dropped, self.dropped, reason)

    async def _shadow(self, session, path: str, stage: str, headers: dict[str, str], request: dict,
                      live: shadow.Answer | Failed, twice: bool = False) -> None:
        """The flag-off answer, and with ``twice`` a second one (from the replica at once, else after the first)."""
        again: shadow.Answer | str | None = None
        try:
            if twice and self.baseline:
                other, again = await asyncio.gather(self._ask(session, self.other, path, headers, request),
                                                    self._ask(session, self.baseline, path, headers, request))
            else:
                other = await self._ask(session, self.other, path, headers, request)
                if twice and isinstance(other, shadow.Answer):
                    again = await self._ask(session, self.other, path, headers, request)
            judged = (await asyncio.to_thread(self.judged, request, live, other)) if self.judge else None
        finally:
            self.in_flight -= 1
        self.settle(stage, request, live, other, again, judged)

    def judged(self, request: dict, live: shadow.Answer | Failed, other: shadow.Answer | str) -> Judgement | None:
        """The evaluation's comparisons of two answers (judge.py), off the request path; None where there are not two."""
        if self.judge is None or not isinstance(live, shadow.Answer) or not isinstance(other, shadow.Answer):
            return None
        return self.judge.judge(request, live.text, other.text)

    def settle(self, stage: str, request: dict, live: shadow.Answer | Failed, other: shadow.Answer | str,
               again: shadow.Answer | str | None, judged: Judgement | None = None) -> None:
        """A shadow come back (its flag-off answer, or a drop reason; ``again``: the A/A twin; ``judged``: what the
        evaluation's comparisons said of the two): compared or dropped."""
        if isinstance(other, str):
            return self._drop(other)
        if isinstance(again, str):  # the A/B comparison stands; only its A/A twin is lost
            self._drop(f"A/A: {again}")
            again = None
        if not self.on:
            return
        if isinstance(live, Failed):
            return self._failed(stage, request, live, other)
        self._compare(stage, request, live, other, again, judged)

    async def _ask(self, session, base: str, path: str, headers: dict[str, str], request: dict) -> shadow.Answer | str:
        """One flag-off answer, or why there is none (a drop reason)."""
        import aiohttp

        t0 = time.monotonic()
        try:
            async with session.post(base + path, data=shadow.shadow_body(request), headers=headers,
                                    timeout=aiohttp.ClientTimeout(total=self.policy.timeout_s)) as r:
                body = await r.read()
                other = shadow.read(body, False) if r.status == 200 else None
                if other is None:
                    return f"flag-off side answered {r.status}" if r.status != 200 else "flag-off answer unreadable"
        except asyncio.TimeoutError:
            return "flag-off side timed out"
        except aiohttp.ClientError:
            return "flag-off side unreachable"
        self.observe(time.monotonic() - t0)
        return other

    def observe(self, seconds: float) -> None:
        self.latency[next((i for i, b in enumerate(LATENCY) if seconds <= b), len(LATENCY))] += 1
        self.latency_sum += seconds

    def _compare(self, stage: str, request: dict, live: shadow.Answer, other: shadow.Answer,
                 again: shadow.Answer | None = None, judged: Judgement | None = None) -> None:
        """Flag-on vs flag-off (A/B); with ``again``, flag-off vs flag-off (A/A) on the same request beside it; with
        ``judged``, the evaluation's comparisons of the two counted (a request they part is kept like a mismatch)."""
        at = shadow.parting(live.text + f"\0{live.finish}", other.text + f"\0{other.finish}")
        row = self.batch.stage(stage)
        row["compared"] += 1
        self.totals["compared"] += 1
        aa_at = None
        if again is not None:
            aa_at = shadow.parting(other.text + f"\0{other.finish}", again.text + f"\0{again.finish}")
            for name, counts in (("aa_compared", True), ("aa_mismatches", aa_at is not None),
                                 ("ab_only", at is not None and aa_at is None), ("aa_only", at is None and aa_at is not None)):
                row[name] = row.get(name, 0) + counts
                self.totals[name] += counts
        prompt = json.dumps(request.get("messages", request.get("prompt")), sort_keys=True)
        size = shadow.shape(len(prompt))
        self.batch.shapes[size] = self.batch.shapes.get(size, 0) + 1
        if at is not None:
            row["mismatches"] += 1
            self.totals["mismatches"] += 1
        counted = self._judged(judged)
        if (at is not None or counted) and len(self.batch.mismatches) < KEPT:
            item = self._item(stage, prompt, live, other, at)
            if again is not None:
                item["aa_parting_char"] = aa_at
            self.batch.mismatches.append(item if judged is None else {**item, **judged.record()})
        if self.batch.compared() >= self.policy.batch:
            self.flush()

    def _judged(self, j: Judgement | None) -> bool:
        """Count what the evaluation's comparisons said; whether they part the two answers (a lost pass, a departure)."""
        if j is None:
            return False
        counts = Judged(read=int(j.kld is not None), departed=int(j.departed), graded=int(j.lost is not None),
                        lost=int(bool(j.lost)))
        self.batch.judged.add(counts)
        for name, n in vars(counts).items():
            self.totals[f"judged_{name}"] += n
        return bool(counts.departed or counts.lost)

    def _failed(self, stage: str, request: dict, live: Failed, other: shadow.Answer) -> None:
        """The flag-on side failed a request the flag-off side answered: a parting, kept with its status and error."""
        row = self.batch.stage(stage)
        for name in ("compared", "mismatches", FAILED):
            row[name] = row.get(name, 0) + 1
            self.totals[name] += 1
        if len(self.batch.mismatches) < KEPT:
            prompt = json.dumps(request.get("messages", request.get("prompt")), sort_keys=True)
            item: Kept = {"stage": stage, "reason": FAILED, "status": live.status, "error": live.error,
                          "parting_char": 0, "finish": [None, other.finish]}
            self.batch.mismatches.append({**item, "prompt": metadata(prompt, self.salt),
                                          "answers": [None, metadata(other.text, self.salt)["digest"]]} if self.no_text
                                         else {**item, "prompt": prompt, "answers": [None, other.text]})
        if self.batch.compared() >= self.policy.batch:
            self.flush()

    def _item(self, stage: str, prompt: str, live: shadow.Answer, other: shadow.Answer, at: int | None) -> Kept:
        """A mismatch as the ledger keeps it: the texts, or under --no-text salted digests and lengths only."""
        item: Kept = {"stage": stage, "parting_char": at, "finish": [live.finish, other.finish]}
        if self.no_text:
            return {**item, "prompt": metadata(prompt, self.salt),
                    "answers": [metadata(live.text, self.salt)["digest"], metadata(other.text, self.salt)["digest"]]}
        return {**item, "prompt": prompt, "answers": [live.text, other.text]}

    # --- the ledger and the rule (one writer thread) ----------------------------------------------
    def flush(self) -> Future | None:
        """Hand the batch to the writer, if it holds any shadow activity (requests alone wait for the next one)."""
        if not self.batch.eventful():
            return None
        batch, self.batch = self.batch, Batch()
        return self.writer.submit(self._record, batch)

    async def tick(self) -> None:
        """Every ``flush_s``: write what a quiet stretch gathered."""
        while True:
            await asyncio.sleep(self.policy.flush_s)
            self.flush()

    async def close(self) -> None:
        """Stop: let running shadows finish (briefly), write the last batch, stop the writer."""
        if self.tasks:  # a stuck flag-off side must not hold a shutdown for long: the rest are dropped
            await asyncio.wait(self.tasks, timeout=min(self.policy.timeout_s, CLOSING_S))
            for task in self.tasks:
                task.cancel()
        if (f := self.flush()) is not None:
            await asyncio.wrap_future(f)
        self.shut()

    def shut(self) -> None:
        """The writer (its queued batches written), the ledger stamp and the reader, closed."""
        self.writer.shutdown(wait=True)
        self.stamp.close_unlocked()
        if self.reader is not None:
            self.reader.close()

    def _record(self, batch: Batch) -> None:
        """``_write``, on the writer thread; a ledger that cannot take the batch is said, and the live side goes on."""
        try:
            self._write(batch)
        except Exception as e:  # noqa: BLE001 - nothing here may reach the request path
            self.dropped["not recorded"] = self.dropped.get("not recorded", 0) + batch.compared()
            self.say(f"gatekeeper guard: {batch.compared()} comparisons could not be recorded ({type(e).__name__}: "
                     f"{e}); the live side is unaffected; 'gatekeeper ledger verify' checks the ledger")

    def _write(self, batch: Batch) -> None:
        from ...ledger import Ledger

        with Ledger(self.url) as ledger:
            self._fold(ledger)  # the fleet's batches: the tests below are over every proxy's comparisons
            for stage, row in batch.stages.items():
                self.counts.setdefault(stage, Count()).add(Count.of(row))
            self.segment.served.add(Served(batch.requests, batch.failed, batch.slow))
            self.segment.judged.add(batch.judged)
            tests = self.segment.tests()
            breached = self.before + [(self.segment, t) for t in tests if t.breached]
            raised = self._raise(batch.compared()) if not breached else None
            summary = batch.summary()
            summary["proxy"], summary["tests"] = self.name, [t.to_dict() for t in tests]
            summary["rule"], summary["segment"] = self.rule.to_dict(), self.segment.record()
            if self.rule.live:
                summary["served"] = self._served(batch)
            if raised:
                summary["raised"] = raised
            if self.rollout is not None:  # the step in force after this batch, readable from the ledger alone
                step = raised["step"] if raised else self.watch.step
                ro = self.rollout
                summary["rollout"] = {"steps": ro.steps, "min_comparisons_per_step": ro.min_comparisons_per_step,
                                      "hold_s": ro.hold_s, "step": step, "share": ro.steps[step],
                                      "compared_at_step": 0 if raised else self.watch.compared_at_step + batch.compared()}
            batch_id = ledger.add_shadow(self.flag, self.flip_id, self.operator, summary, batch.mismatches)
            self.own.add(batch_id)
            self.segment.batches.append(batch_id)
            self.watch.stepped(batch_id, batch.compared(), raised)
            self.tests = tests
            if raised:
                assert self.rollout is not None  # only a rollout is raised
                self.step_since = time.monotonic()
                self.say(f"gatekeeper guard: {self.flag} raised to step {raised['step'] + 1} of "
                         f"{len(self.rollout.steps)}: the flag-on side now serves "
                         f"{raised['share']:.0%} of requests ({raised['compared']} comparisons at {raised['from']:.0%}, "
                         "no test breached)")
            last = ledger.flag_states().get(self.flag)
            if self.on and (last is None or last["id"] != self.flip_id):  # flipped by someone since: the watch ends
                return self._stop(last)
            if breached and self.on:
                self._roll_back(ledger, breached, batch_id)

    def _raise(self, compared: int) -> Raise | None:
        """A rollout's next step, signed with the service key, where it is due with this batch's ``compared`` (the
        caller has found no test breached); else None."""
        from datetime import datetime, timezone

        if self.rollout is None or not self.on:
            return None
        at_step = self.watch.compared_at_step + compared
        if not rollouts.due(self.rollout, self.watch.step, at_step, self.step_since):
            return None
        step = self.watch.step + 1
        share, batches = self.rollout.steps[step], list(self.watch.at_step)
        signed = self.key.sign(rollouts.message(self.flag, self.flip_id, step, share, batches))
        allowed = self.ws.allowed_signers
        return {"step": step, "share": share, "from": self.share, "compared": at_step, "batches": batches,
                "signer": allowed.principal(self.key.blob, datetime.now(timezone.utc)) if allowed else None,
                "signature": signed}

    def _served(self, batch: Batch) -> dict[str, int]:
        """The live side's counts the rule tests: failed requests under a success-rate floor, slow ones under a ceiling."""
        return {**({"failed": batch.failed} if self.rule.min_success_rate is not None else {}),
                **({"slow": batch.slow} if self.rule.max_latency_s is not None else {})}

    def _roll_back(self, ledger, breached: list[tuple[Segment, Test]], batch_id: int) -> None:
        from ...errors import Superseded
        from ...gate.enable.attestation import Attestation
        from ...gate.enable.flip import flip
        from ...ledger import checkpoint

        self.on = False  # from here every request goes to the flag-off side (Proxy.upstream_for)
        first = min(b["id"] for b in ledger.shadows(self.flag, self.flip_id))
        lines = "; ".join(f"{_scope(seg, t)}: {_evidence(t)} (log statistic {t.log_e:.2f} >= {t.threshold:.2f})"
                          for seg, t in breached)
        reason = f"guard rollback: {lines}; evidence: shadow batches {first}-{batch_id} of flip {self.flip_id}"
        try:  # only off the flip it watched: of a fleet's proxies that breach at once, one rolls back
            result = flip(self.ws, ledger, self.flag, "off", evaluation_id=None, operator=self.operator, reason=reason,
                          attestation=Attestation(key=self.key), after=self.flip_id,
                          record_checkpoint=partial(checkpoint.after_flip, self.ws, ledger))
        except Superseded:
            return self._stop(ledger.flag_states().get(self.flag))
        self.rollback = {"flag": self.flag, "state": result.state, "action": result.action, "reason": reason,
                         "refused": result.reasons, "signer": result.signer, "batches": [first, batch_id],
                         "watched_flip": self.flip_id, "checkpoint": result.checkpoint}
        self.say(f"gatekeeper guard: {self.flag} turned off ({result.action}{': ' + '; '.join(result.reasons) if result.reasons else ''}); "
                 f"{reason}; every request now goes to {self.other}")
        if self.webhook:
            threading.Thread(target=self._notify, daemon=True).start()

    def _notify(self) -> None:
        """POST the rollback to the operator's webhook (JSON); a webhook that fails is said, never retried forever."""
        req = urllib.request.Request(self.webhook or "", data=json.dumps({"event": "gatekeeper.rollback", **(self.rollback or {})}).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        for attempt in range(3):
            try:
                with urllib.request.urlopen(req, timeout=10):
                    return
            except OSError as e:
                if attempt == 2:
                    self.say(f"gatekeeper guard: the webhook {self.webhook} failed ({e}); the rollback stands in the ledger")
                time.sleep(1 + attempt)

    # --- /metrics ----------------------------------------------------------------------------------
    def metrics(self) -> str:
        flag = f'flag="{_label(self.flag)}"'
        out: list[str] = []

        def metric(name: str, kind: str, help_: str, rows: list[tuple[str, float]]) -> None:
            out.append(f"# HELP gatekeeper_guard_{name} {help_}\n# TYPE gatekeeper_guard_{name} {kind}")
            for labels, value in rows:
                out.append(f"gatekeeper_guard_{name}{{{flag}{labels}}} {_number(value)}")

        metric("requests_total", "counter", "Completion requests served since start.", [("", self.totals["requests"])])
        metric("failed_total", "counter", "Completion requests the flag-on side failed (a 5xx, no response, a cut "
               "answer), shadowed or not.", [("", self.totals["failed"])])
        metric("slow_total", "counter", "Completion requests slower than the rule's max_latency_s (0 without one).",
               [("", self.totals["slow"])])
        metric("shadowed_total", "counter", "Requests sent again to the flag-off side.", [("", self.totals["shadowed"])])
        metric("compared_total", "counter", "Shadowed requests whose two answers were compared.", [("", self.totals["compared"])])
        metric("mismatches_total", "counter", "Compared requests whose answers differ.", [("", self.totals["mismatches"])])
        metric("flag_on_failed_total", "counter", "Compared requests the flag-on side failed (an error status, a dropped "
               "connection, a timeout) and the flag-off side answered: partings.", [("", self.totals[FAILED])])
        metric("aa_compared_total", "counter", "Compared requests whose flag-off answer was also compared with a second "
               "flag-off answer (the A/A baseline).", [("", self.totals["aa_compared"])])
        metric("aa_mismatches_total", "counter", "A/A comparisons whose two flag-off answers differ.",
               [("", self.totals["aa_mismatches"])])
        metric("discordant_total", "counter", "Requests compared both ways that parted one way only (only: ab, flag-on vs "
               "flag-off; aa, flag-off vs flag-off): the baseline-aware test's evidence.",
               [(',only="ab"', self.totals["ab_only"]), (',only="aa"', self.totals["aa_only"])])
        metric("graded_total", "counter", "Compared requests whose messages are a suite case's, graded by its assertions "
               "on both sides (lost: the flag-on answer fails what the flag-off answer passes).",
               [(',outcome="graded"', self.totals["judged_graded"]), (',outcome="lost"', self.totals["judged_lost"])])
        metric("read_total", "counter", "Compared requests read teacher-forced on both sides (departed: mean KL over the "
               "rule's max_kld).", [(',outcome="read"', self.totals["judged_read"]),
                                    (',outcome="departed"', self.totals["judged_departed"])])
        metric("unpaired_total", "counter", "Picked requests whose decoding cannot be paired (counted, not compared).",
               [(f',reason="{_label(r)}"', n) for r, n in sorted(self.unpaired.items())] or [(',reason=""', 0)])
        metric("dropped_total", "counter", "Shadows dropped (the live request is never affected).",
               [(f',reason="{_label(r)}"', n) for r, n in sorted(self.dropped.items())] or [(',reason=""', 0)])
        metric("statistic", "gauge", "The sequential test's log statistic, comparisons since the flip.",
               [(f',scope="{_label(t.scope)}"', t.log_e) for t in self.tests])
        metric("threshold", "gauge", "The log statistic at which the flag is turned off.",
               [(f',scope="{_label(t.scope)}"', t.threshold) for t in self.tests])
        metric("flag_on", "gauge", "1 while the guard keeps the flag on.", [("", 1 if self.on else 0)])
        metric("rollout_share", "gauge", "The share of requests the flag-on side serves: a rollout's step in force (1 "
               "without a rollout).", [("", self.share if self.on else 0)])
        metric("in_flight", "gauge", "Shadow requests running now.", [("", self.in_flight)])
        out.append("# HELP gatekeeper_guard_shadow_seconds Shadow request latency.\n"
                   "# TYPE gatekeeper_guard_shadow_seconds histogram")
        running = 0
        for bound, n in zip([*LATENCY, math.inf], self.latency):
            running += n
            out.append(f'gatekeeper_guard_shadow_seconds_bucket{{{flag},le="{_number(bound)}"}} {running}')
        out.append(f"gatekeeper_guard_shadow_seconds_sum{{{flag}}} {_number(self.latency_sum)}")
        out.append(f"gatekeeper_guard_shadow_seconds_count{{{flag}}} {running}")
        return "\n".join(out) + "\n"


def _evidence(t: Test) -> str:
    """What a breached test rejected, on which counts."""
    if t.scope == SUCCESS:
        return (f"{t.mismatches} of {t.compared} live requests failed on the flag-on side (success rate >= "
                f"{1 - t.limit:g} rejected at alpha {t.alpha:.3g})")
    if t.scope == ASSERTIONS:
        return (f"{t.mismatches} of {t.compared} graded requests lost a pass on the flag-on side (a share <= {t.limit:g} "
                f"rejected at alpha {t.alpha:.3g})")
    if t.scope == DISTANCE:
        return (f"{t.mismatches} of {t.compared} requests read teacher-forced departed beyond the rule's max_kld (a "
                f"share <= {t.limit:g} rejected at alpha {t.alpha:.3g})")
    if t.scope == SLOW:
        return (f"{t.mismatches} of {t.compared} live requests were slower than the rule's ceiling (a share <= "
                f"{t.limit:g} rejected at alpha {t.alpha:.3g})")
    if t.baseline is None:
        return (f"{t.mismatches} of {t.compared} live requests parted from the flag-off side (rate <= {t.limit:g} "
                f"rejected at alpha {t.alpha:.3g})")
    b = t.baseline
    return (f"of {b.paired} live requests compared both ways, {b.ab_only} parted flag-on vs flag-off only and "
            f"{b.aa_only} flag-off vs flag-off only ({t.mismatches} of {t.compared} parted flag-on vs flag-off in all; "
            f"rate <= the flag-off side's own + {t.limit:g} rejected at alpha {t.alpha:.3g})")


def _scope(seg: Segment, t: Test) -> str:
    """A test as a rollback's reason names it: its stages, and its rule segment when the rule changed in the watch."""
    where = ("the live side's " + t.scope if t.scope in (SUCCESS, SLOW) else "the " + t.scope if t.scope in
             (ASSERTIONS, DISTANCE) else "stage " + t.scope if t.scope != ALL
             else "other stages" if seg.rule.stage_limits else "all stages")
    return where if seg.index == 1 else f"{where} (rule segment {seg.index}, rule {seg.rule.digest()[:12]})"


def _label(value: str) -> str:
    """A Prometheus label value: backslash, quote and newline escaped (stage names come from the policy)."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(x: float) -> str:
    if x == math.inf:
        return "+Inf"
    return repr(float(x)) if isinstance(x, float) else str(x)
