"""The comparisons the gate makes, made on shadowed requests too: beside the two texts, a request whose messages are a
suite case's (as the pipeline renders that case, partitioned or as written) is graded by the case's assertions on both
answers, and a pass the flag-on answer loses (it fails what the flag-off answer passes) is a lost pass; and, where the
servers give next-token distributions (vLLM's prompt log-probabilities, llama-server's and mlx_lm.server's forced
requests, as ``gate/arms/forced.py`` reads them), both sides read the flag-off answer teacher-forced, and a request whose
mean KL(flag-off || flag-on) over the positions read exceeds the rule's ``max_kld`` departs.

Neither judges a request alone: the guard's rule counts lost passes and departures as Bernoulli trials of their own
one-sample tests (``gate/guard.py``), beside the mismatch test; and each kept parting says which comparisons its request
got. Graded assertions that need a grader model or an embedding are not graded here (the proxy opens no grader): a case
holding one is not matched.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, Sequence

from ...battery import checks, graded, partition, similar
from ...battery.suites import all_suites
from ...errors import GatekeeperError
from ...shadows import Kept

if TYPE_CHECKING:
    from ...engines.base import Scored
    from ...workspace import Case, Workspace


class Reader(Protocol):
    """What reads both sides teacher-forced: an http engine (``engines/served/http.py``) whose ``off`` and ``on``
    deployments are the shadow and the upstream."""

    def render(self, messages: Sequence[dict[str, str]]) -> str: ...

    def tokenize(self, text: str) -> list[int]: ...

    def score(self, config: str, prompt: list[int], continuation: list[int]) -> Scored | None: ...

    def unscored(self) -> str | None: ...


@dataclass
class Judgement:
    """What the evaluation's comparisons said of one compared request (None: not made)."""

    case: str | None = None  # the suite case its messages are, where graded
    lost: bool | None = None  # the flag-on answer fails the case's assertions and the flag-off answer passes them
    kld: float | None = None  # mean KL(flag-off || flag-on) over the positions read teacher-forced
    same_top1: float | None = None  # the share of those positions whose likeliest token the two sides share
    departed: bool = False  # kld above the rule's max_kld
    unread: str | None = None  # why the distance could not be read for it
    ungraded: str | None = None  # why a case's assertions could not be evaluated on it

    def comparisons(self) -> list[str]:
        return ["text", *(["assertions"] if self.lost is not None else []), *(["distance"] if self.kld is not None else [])]

    def record(self) -> Kept:
        """As a kept parting carries it."""
        out: Kept = {"compared_by": self.comparisons()}
        if self.case:
            out["case"], out["lost_pass"] = self.case, bool(self.lost)
        if self.kld is not None:
            out["kld"] = round(self.kld, 9)
            if self.same_top1 is not None:
                out["same_top1"] = self.same_top1
        if self.unread:
            out["unread"] = self.unread
        if self.ungraded:
            out["ungraded"] = self.ungraded
        return out


def _key(messages: Any) -> str | None:
    """A chat request's messages as one digest (None: not a list of plain role/content messages)."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages):
        return None
    return hashlib.sha256(json.dumps([[m.get("role"), m["content"]] for m in messages]).encode()).hexdigest()


def _gradable(case: Case) -> bool:
    kinds = {a.type.removeprefix("not-") for a in case.assert_}
    return bool(case.assert_) and not case.turns and not kinds & {*graded.TYPES, *similar.TYPES, "answer-relevance"}


class Judge:
    """A workspace's suite cases by their messages, and (``reader``: an http engine whose ``off`` and ``on`` sides are
    the two deployments) the forced reads; ``max_kld``: where a read request departs (None: read, never departed)."""

    def __init__(self, ws: Workspace, assertions: bool = True, reader: Reader | None = None,
                 max_kld: float | None = None):
        self.reader, self.max_kld = reader, max_kld
        self.cases: dict[str, tuple[str, Case, dict[str, str]]] = {}
        if not assertions:
            return
        for suite in all_suites(ws).values():
            for case in suite.cases:
                if not _gradable(case):
                    continue
                try:
                    items = partition.pieces(ws, suite, case.vars)
                except GatekeeperError:  # a template this process cannot render (its JS filters need node): unmatched
                    continue
                for mode in ("partitioned", "as_written"):
                    key = _key(partition.messages(partition.order(items, mode)))
                    if key is not None:
                        self.cases.setdefault(key, (f"{suite.suite}/{case.id}", case, dict(case.vars)))

    def judge(self, request: dict[str, Any], on: str, off: str) -> Judgement:
        """The comparisons a request both sides answered (``on``, ``off``: their texts) gets. Runs on a worker thread:
        the forced reads are requests to both servers."""
        j = Judgement()
        found = self.cases.get(_key(request.get("messages")) or "")
        if found is not None:
            name, case, values = found
            context = checks.Context(vars=values, prompt=checks.stringify(request["messages"]))
            try:
                passed = [all(o["pass"] for o in checks.outcomes(list(case.assert_), text, context)) for text in (on, off)]
                j.case, j.lost = name, passed[1] and not passed[0]
            except Exception as e:  # noqa: BLE001 - a script that fails leaves the request compared by its text
                j.ungraded = f"{name}: {type(e).__name__}: {e}"[:200]
        if self.reader is not None:
            try:
                self._read(j, request, off)
            except Exception as e:  # noqa: BLE001 - a read that fails leaves the request compared by its text
                j.unread = f"{type(e).__name__}: {e}"[:200]
        return j

    def _read(self, j: Judgement, request: dict[str, Any], off: str) -> None:
        from ...gate.stats import distance

        assert self.reader is not None
        messages, prompt = request.get("messages"), request.get("prompt")
        text = self.reader.render(messages) if isinstance(messages, list) else prompt if isinstance(prompt, str) else None
        answer = self.reader.tokenize(off)
        if text is None or not answer:
            j.unread = "no text prompt to read" if text is None else "an empty flag-off answer"
            return
        tokens = self.reader.tokenize(text)
        a, b = (self.reader.score(side, tokens, answer) for side in ("off", "on"))
        if a is None or b is None:
            j.unread = self.reader.unscored() or "the server gave no distributions"
            return
        per = distance.positions(a, b)
        j.kld, j.same_top1 = float(per.kld.mean()), round(float(per.same.mean()), 6)
        j.departed = self.max_kld is not None and j.kld > self.max_kld
