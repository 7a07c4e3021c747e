"""The guard in process: a pipeline that calls the model through ``gatekeeper.Runtime`` turns it on with
``Runtime(ws, guard="prefix_cache", sign=KEY)``.

Each call is answered as before, on the caller's thread. Once answered (or failed), it is counted, and a share of
the calls the engine answered is queued for one background worker, which answers it again with a flag-off Runtime of
the same workspace (the flag forced off, no response cache) and hands both answers to the proxy's guard
(``guarded.py``): the same batches, rule, A/A baseline, signed rollback and metrics. The caller never waits on a
replay: a full queue drops it and counts it, as the proxy drops a shadow over its cap. A rollback (this process's, or
one any other guard wrote to the ledger) sends every later call to the flag-off Runtime; so does a rollout
(``rollout:``) for the calls whose key is not yet within its step's share.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable, Mapping, Sequence

from . import shadow
from .guarded import CLOSING_S, Failed, Guarded

# The flag-off side: (stage, values, history) -> the Runtime's Completion (``text`` and ``tokens`` are read)
Replay = Callable[[str, Mapping[str, str], Sequence[dict[str, str]]], Any]


class InProcess:
    """One flag's guard inside a Runtime: ``offer`` from the callers' threads, replays on the worker."""

    def __init__(self, guarded: Guarded, off: Replay, close_off: Callable[[], None]):
        self.guarded, self.off, self.close_off = guarded, off, close_off
        self.lock = threading.Lock()  # the guard's counts: the callers' threads and the worker
        self.off_lock = threading.Lock()  # the flag-off Runtime: the worker, and every caller after a rollback
        self.jobs: queue.Queue = queue.Queue()
        self.worker = threading.Thread(target=self._work, name="gatekeeper-guard-replay", daemon=True)
        self.worker.start()

    def current(self, key: str) -> bool:
        """Whether a call of this rollout key goes to the flag-on side: the watch is on (a cheap stamp of the ledger per
        call) and, during a rollout, the key is within its share."""
        with self.lock:
            return self.guarded.current() and self.guarded.serves(key)

    def answer(self, stage: str, values: Mapping[str, str], history: Sequence[dict[str, str]]) -> Any:
        """A call after the watch ended: the flag-off Runtime answers it."""
        with self.off_lock:
            return self.off(stage, values, history)

    def offer(self, stage: str, values: Mapping[str, str], history: Sequence[dict[str, str]], request: dict,
              live: shadow.Answer | Failed, seconds: float) -> None:
        """A call answered (or failed) ``seconds`` after it began: counted, and maybe queued for a replay."""
        with self.lock:
            if not self.guarded.count(stage, isinstance(live, Failed), seconds):
                return
            twice = self.guarded.admit(stage, request, live)
        if twice is not None:
            self.jobs.put((stage, dict(values), list(history), request, live, twice))

    def _work(self) -> None:
        """Replay queued calls; every ``flush_s`` write what a quiet stretch gathered; stop at None."""
        flush_s = self.guarded.policy.flush_s
        due = time.monotonic() + flush_s
        while True:
            try:
                job = self.jobs.get(timeout=max(0.0, due - time.monotonic()))
            except queue.Empty:
                with self.lock:
                    self.guarded.flush()
                due = time.monotonic() + flush_s
                continue
            if job is None:
                return
            stage, values, history, request, live, twice = job
            try:
                other = self._ask(stage, values, history)
                again = self._ask(stage, values, history) if twice and isinstance(other, shadow.Answer) else None
                judged = self.guarded.judged(request, live, other)
            finally:
                with self.lock:
                    self.guarded.in_flight -= 1
            with self.lock:
                self.guarded.settle(stage, request, live, other, again, judged)

    def _ask(self, stage: str, values: Mapping[str, str], history: Sequence[dict[str, str]]) -> shadow.Answer | str:
        """The flag-off answer, or why there is none (a drop reason)."""
        t0 = time.monotonic()
        try:
            with self.off_lock:
                c = self.off(stage, values, history)
        except Exception as e:  # noqa: BLE001 - the flag-off side failing is counted, never raised at the caller
            return f"flag-off side failed ({type(e).__name__})"
        self.guarded.observe(time.monotonic() - t0)
        return shadow.Answer(c.text, None, len(c.tokens))

    def metrics(self) -> str:
        """The guard's Prometheus text, as the proxy serves it at /metrics."""
        with self.lock:
            return self.guarded.metrics()

    def close(self) -> None:
        """Stop: let the replays queued finish (briefly), write the last batch, close the flag-off Runtime."""
        self.jobs.put(None)
        self.worker.join(timeout=max(CLOSING_S, self.guarded.policy.timeout_s))
        with self.lock:
            f = self.guarded.flush()
        if f is not None:
            f.result()
        self.guarded.shut()
        if not self.worker.is_alive():  # a replay still running keeps its Runtime: the process is ending anyway
            self.close_off()
