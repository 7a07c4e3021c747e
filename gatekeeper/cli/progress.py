"""Progress of long work: a bar on a terminal; where stderr is a log (CI, a pipe, a file), a line per stage and a
heartbeat at most every 30 seconds, so the log shows life; nothing under --json."""

from __future__ import annotations

import sys
import threading
import time
from typing import Callable, TextIO

EVERY = 30.0  # seconds between two lines of one stage in a log


def clock(seconds: float) -> str:
    """``1h 02m``, ``4m 05s``, ``7s``: elapsed and remaining times in a log line."""
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    return f"{s // 60}m {s % 60:02d}s" if s >= 60 else f"{s}s"


class LogLines:
    """Lines for a log: one when the stage (a label's first word: ``off#0``, ``on#0``, ``distance``, a fault) changes,
    else at most one every ``every`` seconds, from a heartbeat thread too, so a long step (a model loading, a
    package installing) still shows it is alive. Each says what is running, done of total, elapsed, the rest."""

    def __init__(self, what: str, total: int, stream: TextIO | None = None, every: float = EVERY,
                 now: Callable[[], float] = time.monotonic, stage: Callable[[str], str] = lambda label: label.split(" ", 1)[0],
                 label: str = "starting"):
        self.what, self.total, self.every, self.now, self.stage_of = what, total, every, now, stage
        self.stream = stream or sys.stderr
        self.done, self.label, self.stage = 0, label, ""
        self.started = self.last = now()
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.beat = threading.Thread(target=self._heartbeat, daemon=True)

    def __enter__(self) -> Callable[[str], None]:
        self._line()
        self.beat.start()
        return self.advance

    def __exit__(self, exc_type, *exc) -> None:
        self.stopped.set()
        self.beat.join()
        with self.lock:
            if exc_type is None:
                print(f"{self.what}: finished in {clock(self.now() - self.started)}", file=self.stream, flush=True)
            else:
                self.label = f"stopped after {self.label}"
                self._line(rest=False)

    def advance(self, label: str) -> None:
        with self.lock:
            self.done += 1
            self.label = label
            stage = self.stage_of(label)
            if stage != self.stage or self.now() - self.last >= self.every:
                self.stage = stage
                self._line()

    def _heartbeat(self) -> None:
        while not self.stopped.wait(min(self.every, 5.0)):
            with self.lock:
                if self.now() - self.last >= self.every:
                    self._line()

    def _line(self, rest: bool = True) -> None:
        t = self.now()
        elapsed = t - self.started
        left = ""
        if rest and 0 < self.done < self.total:
            left = f", about {clock(elapsed / self.done * (self.total - self.done))} left"
        print(f"{self.what}: {self.label} ({min(self.done, self.total)}/{self.total} done), {clock(elapsed)} elapsed{left}",
              file=self.stream, flush=True)
        self.last = t


class progress:
    """A progress bar where stderr is a terminal, log lines (``LogLines``) where it is not; silent unless enabled
    (commands pass ``not json_``). Used as ``with progress(total, enabled) as advance: advance(label)``."""

    def __init__(self, total: int, enabled: bool, what: str = "evaluating"):
        self.total, self.what = total, what
        self.mode = None if not enabled else "bar" if sys.stderr.isatty() else "log"

    def __enter__(self) -> Callable[[str], None]:
        if self.mode is None:
            return lambda label: None
        if self.mode == "log":
            self.lines = LogLines(self.what, self.total)
            return self.lines.__enter__()
        from rich.console import Console
        from rich.progress import Progress

        self.bar = Progress(console=Console(stderr=True), transient=True)
        self.bar.start()
        task = self.bar.add_task(self.what, total=self.total)
        return lambda label: self.bar.update(task, advance=1, description=label)

    def __exit__(self, *exc) -> None:
        if self.mode == "log":
            self.lines.__exit__(*exc)
        elif self.mode == "bar":
            self.bar.stop()
