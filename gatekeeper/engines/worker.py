"""An in-process engine run under another Python environment: the profile's ``python`` names the interpreter (or an
environment ``gatekeeper runtime prepare`` made), and the adapter runs there, in a worker process, behind the same
model and session contract. So a transformers or mlx-lm upgrade is evaluated side by side with the version in
production: each side's worker imports its own environment's packages.

The parent (``WorkerEngine``) and the worker (``worker_main``, run as ``python -m gatekeeper.engines.worker_main``) speak one
JSON document per line over the worker's stdin and a private copy of its stdout (what libraries print goes to
stderr). A request is ``{"op": ..., ...}``; the answer ``{"ok": value}`` or ``{"error": ..., "gatekeeper": bool}``.
While a ``generate`` with an ``until`` runs, the worker asks ``{"until": [tokens, top2]}`` after each token and the
parent answers ``{"stop": bool}``: early stopping crosses the process as it would a call. A worker that dies is an
error naming its exit and last lines of output: the evaluation is aborted, never a verdict.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
from collections import deque
from pathlib import Path
from typing import Any, Sequence

from ..errors import EngineCrash, GatekeeperError, InternalError
from ..evidence import Top2
from ..identity import child_env
from ..workspace import EngineProfile
from .base import Engine, Generation, Referenced, Scored, Session, Until
from .faults import Fault
from .sampler import Draw

PACKAGE_ROOT = Path(__file__).resolve().parent.parent.parent  # the folder holding the gatekeeper package
DECLARED = ("name", "concurrency", "hybrid", "persists", "granularity", "window", "context", "early_stop", "samples", "weights",
            "dialect_name", "score_caveat")


def interpreter(python: str) -> str:
    """The interpreter a profile's ``python`` names: a path, a command on PATH, or an environment made by
    ``gatekeeper runtime prepare NAME``; exit 2 naming the field when there is none."""
    from ..setup.runtimes import environment

    named = environment(python)
    found = named if named is not None else shutil.which(python) if os.sep not in python else python
    if not found or not os.access(found, os.X_OK) or Path(found).is_dir():
        raise GatekeeperError(f"field 'python': {python!r} is neither an interpreter nor an environment made by "
                              f"'gatekeeper runtime prepare {python} PACKAGE==VERSION'; make it, or name an existing "
                              "python executable")
    return str(found)


RUNS = ("generate", "score", "split", "pin")  # what the model computes: a runtime's exception there is a crash


class WorkerError(RuntimeError):
    """An exception the adapter raised in the worker (outside gatekeeper's own errors), as the worker named it."""


class WorkerSession(Session):
    """A session of the model the worker holds: every call is forwarded."""

    def __init__(self, model: "WorkerEngine", *, cache: bool = False, results: Path | None = None,
                 fault: Fault | None = None):
        super().__init__(model, cache=cache, results=results)
        self.worker = model
        self.id = model.call("session", cache=cache, results=str(results) if results else None,
                             fault=fault.to_dict() if fault else None)

    def generate(self, prompt: Sequence[int], *, max_tokens: int, stop: Sequence[str] = (), top2: bool = False,
                 until: Until | None = None, sampling: Draw | None = None) -> Generation:
        g = Generation(**self.worker.call("generate", sid=self.id, prompt=list(prompt), max_tokens=max_tokens,
                                          stop=list(stop), top2=top2, until=until is not None, callback=until,
                                          sampling=sampling.to_dict() if sampling else None))
        self.stats.add(g)
        return g

    def score(self, prompt: Sequence[int], continuation: Sequence[int], top_k: int | None = None) -> Scored | None:
        import numpy as np

        s = self.worker.call("score", sid=self.id, prompt=list(prompt), continuation=list(continuation), top_k=top_k)
        if s is None:
            return None
        arrays = {k: None if s[k] is None else np.asarray(s[k], dtype=np.int64 if k == "ids" else np.float32)
                  for k in ("logprobs", "token_logprobs", "ids")}
        return Scored(tokens=s["tokens"], kind=s["kind"], cached_tokens=s["cached_tokens"], **arrays)

    def split(self, prompt: Sequence[int], at: int) -> tuple[list[Top2], list[Top2]] | None:
        rows = self.worker.call("split", sid=self.id, prompt=list(prompt), at=at)
        return None if rows is None else (rows[0], rows[1])

    def pin(self, prefix: Sequence[int]) -> None:
        source = self.worker.call("pin", sid=self.id, prefix=list(prefix))
        if source is not None:  # where the worker's session got the state (computed, loaded, recomputed)
            self.pin_sources[tuple(prefix)] = source

    def held(self) -> tuple[int | None, int | None]:
        n, size = self.worker.call("held", sid=self.id)
        return n, size

    def snapshot_stats(self) -> dict[str, Any] | None:
        return self.worker.call("snapshot_stats", sid=self.id)

    def close(self) -> None:
        if self.worker.alive:
            self.worker.call("close_session", sid=self.id)


class WorkerEngine(Engine):
    """The adapter a profile names, run by a worker process under the profile's ``python``."""

    session_class = WorkerSession
    fault_session_class = WorkerSession

    def __init__(self, profile: EngineProfile, *, workspace_root: Path | None = None):
        super().__init__(profile, workspace_root=workspace_root)
        assert profile.python is not None  # registry builds a worker only for a profile that names one
        self.python = interpreter(profile.python)
        env = child_env(PYTHONPATH=os.pathsep.join(filter(None, [str(PACKAGE_ROOT), os.environ.get("PYTHONPATH")])))
        self._proc = subprocess.Popen([self.python, "-m", "gatekeeper.engines.worker_main"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True, bufsize=1)
        self._said: deque[str] = deque(maxlen=20)  # the worker's last lines on stderr, for the error that names them
        threading.Thread(target=self._drain, daemon=True).start()
        self._lock = threading.Lock()
        try:
            declared = self.call("load", profile=profile.model_copy(update={"python": None}).model_dump(mode="json"),
                                 name=profile.name, root=str(workspace_root) if workspace_root else None)
        except WorkerError as e:  # that environment's runtime cannot load this model: nothing has run yet
            self.close()
            raise GatekeeperError(f"{profile.where}: the {profile.adapter} adapter under {self.python} cannot load the "
                                  f"model: {e}; check the model against that environment's library versions") from None
        except BaseException:
            self.close()
            raise
        # what the adapter declares, as its own class says it (the worker's check_fault refuses what it cannot plant)
        for k in DECLARED:
            setattr(self, k, declared[k])
        for k in ("observes", "eos_ids", "faults"):
            setattr(self, k, frozenset(declared[k]))
        self.notices = tuple(declared["notices"])
        self._unscored = declared["unscored"]
        self._unreferenced = declared["unreferenced"]
        self.weights = Path(declared["weights"]) if declared["weights"] else None

    @property
    def alive(self) -> bool:
        return self._proc.poll() is None

    def _drain(self) -> None:
        assert self._proc.stderr is not None
        for line in self._proc.stderr:
            self._said.append(line.rstrip())

    def call(self, op: str, callback: Until | None = None, **args: Any) -> Any:
        """One request to the worker and its answer (answering its ``until`` questions on the way)."""
        assert self._proc.stdin is not None and self._proc.stdout is not None
        with self._lock:
            try:
                self._proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
                self._proc.stdin.flush()
                while True:
                    line = self._proc.stdout.readline()
                    if not line:
                        raise EOFError
                    answer = json.loads(line)
                    if "until" not in answer:
                        break
                    stop = callback is not None and bool(callback(*answer["until"]))
                    self._proc.stdin.write(json.dumps({"stop": stop}) + "\n")
                    self._proc.stdin.flush()
            except (EOFError, BrokenPipeError, OSError):
                raise self._died(op) from None
        if "crash" in answer:
            raise EngineCrash(answer["error"], **answer["crash"])
        if "internal" in answer:  # gatekeeper's own code raised in the worker: a bug, never this side's crash
            raise InternalError(answer["error"], answer["internal"])
        if "error" in answer and not answer["gatekeeper"] and op in RUNS:  # the runtime failed a request: this side's
            tokens = args.get("prompt") or args.get("prefix") or []
            raise EngineCrash.raised(f"worker:{self.python}", answer["error"], len(tokens), args.get("max_tokens", 0))
        if "error" in answer:
            raise (GatekeeperError if answer["gatekeeper"] else WorkerError)(answer["error"])
        return answer["ok"]

    def _died(self, op: str) -> GatekeeperError:
        try:
            code = self._proc.wait(5)
        except subprocess.TimeoutExpired:
            code = None
        said = " | ".join(list(self._said)[-5:]) or "nothing"
        return GatekeeperError(f"the engine's worker under {self.python} died during {op!r} (exit {code}); its last "
                               f"lines: {said}")

    def check_fault(self, fault: Fault) -> None:
        self.call("check_fault", fault=fault.to_dict())

    def unscored(self) -> str | None:
        return self._unscored

    def reference(self, sequence: Sequence[int], steps: int, asked: Sequence[Sequence[int]],
                  batch: int = 1, own: bool = False) -> Referenced | None:
        read = self.call("reference", sequence=list(sequence), steps=steps, asked=[list(a) for a in asked], batch=batch,
                         own=own)
        return None if read is None else Referenced(**read)

    def stepped(self, sequence: Sequence[int], steps: int, asked: Sequence[Sequence[int]]) -> Referenced | None:
        read = self.call("stepped", sequence=list(sequence), steps=steps, asked=[list(a) for a in asked])
        return None if read is None else Referenced(**read)

    def unreferenced(self) -> str | None:
        return self._unreferenced

    def render(self, messages: Sequence[dict[str, str]]) -> str:
        return self.call("render", messages=list(messages))

    def tokenize(self, text: str) -> list[int]:
        return self.call("tokenize", text=text)

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self.call("detokenize", tokens=list(tokens))

    def identity(self) -> dict[str, Any]:
        """The worker's adapter's identity (its own environment's library versions) and the interpreter it ran."""
        return {**self.call("identity"), "python": self.call("python")}

    def close(self) -> None:
        if self.alive:
            try:
                self.call("close")
            except GatekeeperError:
                pass
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
