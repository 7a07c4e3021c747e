"""``javascript`` and ``python`` assertions: the suite's own code judges the output, as promptfoo 0.123.1 runs it.

The value is inline code (one line is an expression whose value is returned; several lines are a function
body with ``return``) or ``file://PATH[:function]`` (JavaScript: the module's function or default export;
Python: ``get_assert`` unless named). It is called with the output and a context (``vars``, ``prompt``,
``test.vars``, ``providerResponse.output`` and the assertion's ``config``). What it returns decides as in
promptfoo: a boolean; a number, passing above 0 or at least ``threshold``; or a GradingResult
``{pass, score, reason}`` (a Python one also fails below ``threshold``). A thrown error or raised exception
fails the assertion with the error as its reason, ``not-`` or not.

The code runs in a worker kept alive per language (node from ``make promptfoo``; the project's Python),
outside gatekeeper's process, with the user's permissions. A call that runs past ``GATEKEEPER_SCRIPT_TIMEOUT``
seconds (default 60) stops the evaluation: it is aborted, no outcome recorded (a GatekeeperError, exit 2).
"""

from __future__ import annotations

import atexit
import json
import math
import os
import select
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import GatekeeperError
from ..js.value import JSONError, js_string, js_trim, number_string, parse_float, parse_json, stringify
from ..setup import promptfoo as promptfoo_setup
from ..workspace import Assertion
from . import types
from .checks import Context, Refused, base_type

FAMILY = types.SCRIPTED  # this module's types, declared in the registry: the languages SUFFIXES runs
SCRIPTS = Path(__file__).with_name("scripts")
TIMEOUT_ENV = "GATEKEEPER_SCRIPT_TIMEOUT"
DEFAULT_TIMEOUT = 60.0
# node 22 strips TypeScript's types itself, so .ts files load as promptfoo loads them
SUFFIXES = {"javascript": (".js", ".cjs", ".mjs", ".ts", ".cts", ".mts"), "python": (".py",)}
LABEL = {"javascript": "Custom function", "python": "Python code"}  # promptfoo's words in its reasons
REASON_CHARS = 300  # a reason is recorded in the ledger: keep it short


@dataclass(frozen=True)
class Script:
    language: str  # javascript | python
    code: str | None = None
    file: str | None = None
    function: str | None = None

    def label(self) -> str:
        if self.file:
            return f"file://{self.file}" + (f":{self.function}" if self.function else "")
        assert self.code is not None  # a script has code or a file
        code = self.code.strip()
        return code if len(code) <= 60 and "\n" not in code else code.splitlines()[0][:60] + "…"


def prepare(a: Assertion) -> Script:
    language = base_type(a.type)
    value = a.value
    if not isinstance(value, str) or not js_trim(value):
        raise Refused(f"'value' must be {language} code, or file://PATH[:function] naming a script")
    if language == "javascript" and not promptfoo_setup.node().is_file():
        raise Refused("javascript assertions run under the node that 'make promptfoo' installs, and it is not "
                      "installed; run 'make promptfoo'")
    if not value.startswith("file://"):
        return Script(language, code=value)
    path, _, function = value[len("file://"):].partition(":")  # promptfoo splits at the first colon
    suffix = Path(path).suffix.lower()
    if suffix not in SUFFIXES[language]:
        raise Refused(f"{value}: a {language} assertion's file must end in {' or '.join(SUFFIXES[language])}; fix the path")
    if not Path(path).is_absolute():
        raise Refused(f"{value}: a relative script path in a gatekeeper suite; write file:///ABSOLUTE/PATH, or put the "
                      "assertion in a promptfoo config beside the script (its paths are relative to the config)")
    if not Path(path).is_file():
        raise Refused(f"{value}: no such file; fix the path")
    return Script(language, file=path, function=function or None)


def evaluate(a: Assertion, output: Any, context: Context, worker: Worker | None = None) -> dict[str, Any]:
    """The outcome; ``output``: the text, or what a transform made of it; ``worker``: the one to ask instead of
    the language's kept-alive one."""
    script = prepare(a)
    vars = dict(context.vars)
    response = output if context.response is None else context.response
    request = {"code": script.code, "file": script.file, "fn": script.function, "output": output, "context": {
        "prompt": context.prompt, "vars": vars, "test": {"vars": vars}, "providerResponse": {"output": response},
        **({"config": a.options["config"]} if "config" in a.options else {})}}
    reply = _ask(script.language, request, f"a {a.type} assertion ({script.label()})", worker)
    inverse = a.type.startswith("not-")
    judged = _judged(script.language, reply, a.threshold, inverse)
    # checks.evaluate inverts ``pass`` for not- types; promptfoo's own rule (errors fail either way) is applied here
    return {**judged, "pass": judged["pass"] != inverse}


UNDEFINED = object()  # what a JavaScript function gave when it returned undefined


class CallFailed(Exception):
    """The user's function threw (or returned what JSON cannot carry): its message."""


def call(script: Script, args: list, what: str, text: bool = False) -> Any:
    """What the user's function (a transform, a nunjucks filter) returns for ``args``, as a JSON value, or
    UNDEFINED; CallFailed when it throws. Inline code is JavaScript called as ``(output, context)``.
    ``text``: return (value, the value as promptfoo's coerceString makes it text) instead."""
    request = {"call": True, "code": script.code, "file": script.file, "fn": script.function, "args": args}
    reply = _ask(script.language, request, what)
    if "error" in reply:
        raise CallFailed(reply["error"])
    value = UNDEFINED if reply.get("undefined") else reply["value"]
    if not text:
        return value
    if "text" in reply or value is UNDEFINED:  # JavaScript says how JSON.stringify writes it
        return value, reply.get("text")
    return value, value if isinstance(value, str) else stringify(value)


def schema_valid(schema: Any, values: list) -> list[bool]:
    """Whether each value conforms to a JSON schema, by promptfoo's own ajv (strict schemas, ajv-formats);
    CallFailed when ajv cannot compile the schema."""
    package = promptfoo_setup.entrypoint().parents[2] / "package.json"  # ajv resolved as promptfoo resolves it
    reply = _ask("javascript", {"schema": schema, "values": values, "modules": str(package)}, "a JSON schema check")
    if "error" in reply:
        raise CallFailed(reply["error"])
    return reply["valid"]


def _ask(language: str, request: dict, what: str, worker: Worker | None = None) -> dict:
    timeout = _timeout()
    try:
        return (worker or _worker(language)).call(request, timeout)
    except TimeoutError:
        raise GatekeeperError(f"{what} ran past {timeout:g} s, so it decided nothing and the evaluation stops "
                              f"without a verdict; make it faster, or raise {TIMEOUT_ENV}") from None


# --- what a result means (promptfoo's javascript.ts and scriptResultNormalization.ts) --------------


def _judged(language: str, reply: dict, threshold: float | None, inverse: bool) -> dict[str, Any]:
    try:
        kind, result = _result(language, reply, threshold)
    except ValueError as e:
        return {"pass": False, "score": 0, "reason": _short(str(e))}
    said = LABEL[language]
    if kind == "boolean":
        passed = result != inverse
        return {"pass": passed, "score": 1 if passed else 0,
                "reason": "Assertion passed" if passed else f"{said} returned {js_string(result)}"}
    if kind == "number":
        raw = result > 0 if threshold is None else result >= threshold
        passed = raw != inverse
        return {"pass": passed, "score": _score(result),
                "reason": "Assertion passed" if passed else f"{said} returned {js_string(raw)}"}
    passed = result["pass"] != inverse
    reason = result["reason"] if passed == result["pass"] else "Assertion passed" if passed else f"{said} returned {js_string(result['pass'])}"
    return {"pass": passed, "score": _score(result["score"]), "reason": _short(reason)}


def _result(language: str, reply: dict, threshold: float | None) -> tuple[str, Any]:
    """("boolean", bool), ("number", float) or ("grading", {pass, score, reason}); ValueError for an error."""
    if "error" in reply:
        raise ValueError(reply["error"] if language == "javascript" else f"Python code execution failed: {reply['error']}")
    if language == "javascript":  # the worker has applied JavaScript's typeof
        if reply["kind"] == "grading":
            return "grading", {**reply, "score": float(reply["score"])}
        return reply["kind"], (float(reply["value"]) if reply["kind"] == "number" else reply["value"])
    return _python(reply["value"], threshold)


def _python(value: Any, threshold: float | None) -> tuple[str, Any]:
    """promptfoo's normalizeScriptResult on what a Python function returned (through JSON)."""
    failed = "Python code execution failed: Python assertion must return a boolean, number, or {pass, score, reason} object"
    if value is True or (isinstance(value, str) and value.lower() == "true"):
        return "boolean", True
    if value is False or (isinstance(value, str) and value.lower() == "false"):
        return "boolean", False
    if isinstance(value, str) and value.startswith("{"):
        try:
            value = parse_json(value)
        except JSONError as e:
            raise ValueError(f"Python code execution failed: Invalid JSON ({e}) when parsing result") from None
    if isinstance(value, (dict, list)):
        result = _snake_to_camel(value) if isinstance(value, dict) else None
        if result is None or not _is_grading_result(result):
            raise ValueError(f"{failed}; got {json.dumps(value)[:120]}")
        result = {"pass": result["pass"], "score": float(result["score"]), "reason": result["reason"]}
        if threshold is not None and result["score"] < threshold:
            says = f"Python score {number_string(result['score'])} is less than threshold {number_string(threshold)}"
            result = {**result, "pass": False, "reason": f"{says}: {result['reason']}" if result["reason"] else says}
        return "grading", result
    score = parse_float(js_string(value))
    if math.isnan(score):
        raise ValueError(f"{failed}; got {js_string(value)[:120]}")
    return "number", score


def _snake_to_camel(d: dict) -> dict:
    out = dict(d)
    for snake, camel in (("pass_", "pass"), ("named_scores", "namedScores"), ("component_results", "componentResults"),
                         ("tokens_used", "tokensUsed")):
        if snake in out and camel not in out:
            out[camel] = out[snake]
    return out


def _is_grading_result(r: dict) -> bool:
    """promptfoo's isGradingResult, on JSON values (JavaScript's typeof "object" is a dict, a list or null)."""
    def obj(key: str) -> bool:
        return key not in r or r[key] is None or isinstance(r[key], (dict, list))
    number = isinstance(r.get("score"), (int, float)) and not isinstance(r.get("score"), bool)
    return (isinstance(r.get("pass"), bool) and number and isinstance(r.get("reason"), str)
            and obj("namedScores") and obj("namedScoreWeights") and obj("tokensUsed") and obj("assertion")
            and ("componentResults" not in r or isinstance(r["componentResults"], list))
            and ("comment" not in r or isinstance(r["comment"], str)))


def _score(x: float) -> float | None:
    return x if math.isfinite(x) else None  # NaN and infinities have no JSON form in the ledger


def _short(reason: str) -> str:
    return reason if len(reason) <= REASON_CHARS else reason[: REASON_CHARS - 1] + "…"


def _timeout() -> float:
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_TIMEOUT
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not (seconds > 0 and math.isfinite(seconds)):
        raise GatekeeperError(f"{TIMEOUT_ENV}={raw!r}: give the seconds a javascript or python assertion may run, above 0")
    return seconds


# --- the workers ---------------------------------------------------------------------------------


def command(language: str) -> list[str]:
    """How a worker for ``language`` starts (it takes the file descriptor it answers on as its last argument)."""
    if language == "javascript":
        return [str(promptfoo_setup.node()), str(SCRIPTS / "worker.mjs")]
    return [sys.executable, str(SCRIPTS / "worker.py")]


class Worker:
    """One interpreter kept alive to answer requests in turn (a lock serializes callers). Replies come on a
    pipe of their own, so whatever the user's code prints cannot garble them. A call that overruns its
    timeout kills the worker (TimeoutError); a worker that dies mid-call is an error reply; either way the
    next call starts a fresh one."""

    def __init__(self, argv: list[str]):
        self.argv = argv
        self._proc: subprocess.Popen | None = None
        self._replies = -1
        self._buffer = b""
        self._lock = threading.Lock()

    def _start(self) -> None:
        read, write = os.pipe()
        try:
            self._proc = subprocess.Popen([*self.argv, str(write)], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL, pass_fds=(write,))
        except OSError:
            os.close(read)
            raise
        finally:
            os.close(write)
        self._replies, self._buffer = read, b""

    def call(self, request: dict, timeout: float) -> dict:
        with self._lock:
            if self._proc is None:
                self._start()
            assert self._proc is not None and self._proc.stdin is not None  # _start opens it, stdin a pipe
            deadline = time.monotonic() + timeout
            try:
                self._proc.stdin.write(json.dumps(request, ensure_ascii=False, default=str).encode("utf-8") + b"\n")
                self._proc.stdin.flush()
            except BrokenPipeError:
                return self._died()
            while b"\n" not in self._buffer:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([self._replies], [], [], left)[0]:
                    self.close()
                    raise TimeoutError(f"no answer within {timeout:g} s")
                chunk = os.read(self._replies, 1 << 16)
                if not chunk:
                    return self._died()
                self._buffer += chunk
            line, _, self._buffer = self._buffer.partition(b"\n")
            return json.loads(line)

    def _died(self) -> dict:
        assert self._proc is not None  # only while a call runs
        code = self._proc.wait()
        self.close()
        return {"error": f"the {Path(self.argv[0]).name} process running it exited (code {code})"}

    def close(self) -> None:
        if self._proc is None:
            return
        self._proc.kill()
        self._proc.wait()
        assert self._proc.stdin is not None  # _start opens it with stdin=subprocess.PIPE
        self._proc.stdin.close()
        os.close(self._replies)
        self._proc = None


_WORKERS: dict[str, Worker] = {}
_WORKERS_LOCK = threading.Lock()


def _worker(language: str) -> Worker:
    with _WORKERS_LOCK:
        if language not in _WORKERS:
            _WORKERS[language] = Worker(command(language))
        return _WORKERS[language]


@atexit.register
def _close_workers() -> None:
    for w in _WORKERS.values():
        w.close()
