"""Server-log forensics: what a llama.cpp-family server did with its prompt cache, from its log alone.

Production often allows no payload capture, but the server's own log says, per request, how many
prompt tokens it re-used and re-computed, and, for hybrid/SWA models, the life cycle of its context
checkpoints (created, restored, erased and why) and every forced full re-processing. Reconstructed
here per slot and in total, with the common prefix each request shared with the slot's cached prompt
(the bound on what the slot could have re-used) and the *silent* full re-processings: a request that
shared at least a unit with an earlier request yet re-computed its whole prompt without any forcing
line. With a capture of the same traffic (its prompts' token ids, which no log holds), reuse across
requests, whichever slot ran them, and its losses by cause (``reuse.py``), and what each server
setting would have re-used on this traffic (``advice.py``).

Read: upstream llama-server (``slot <fn>: id S | task T | ...`` lines; checkpoint and prefix lines
are trace level, so run it with ``-lv 4`` or ``--verbose``), older upstream builds (``kv cache rm``,
``n_past = ``) and ik_llama.cpp (``INFO [fn] msg | key=value`` lines, ``======== Cache:`` lines,
``took X ms`` checkpoint lines), plain or with ``--log-prefix`` timestamps, colours or JSON lines.
Formats drift between builds, so lines are matched by their key phrases and ``key = value`` pairs,
not by whole-line templates; a line that looks relevant but matches nothing is reported, not
guessed at. A figure the log does not show is absent (None), never 0. A truncated or garbled log
gives a partial report that says what is missing.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from ...errors import GatekeeperError
from ..captures.analyze import distribution
from . import advice, reuse

MAX_LINE = 1 << 20  # a "line" longer than this (binary garbage, no newline) is read in pieces
EXAMPLES = 20  # unparsed lines quoted in the report

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_SLOT = re.compile(r"\bslot\s+[\w()~<>:. -]{0,40}?:\s+id\s+(\d+)\s+\|\s+task\s+(-?\d+)\s+\|\s?(.*)")
_SRV = re.compile(r"\b(?:srv|que)\s+[\w()~<>:. -]{0,40}?:\s?(.*)")
_IK = re.compile(r"^(?:INFO|WARN|WARNING|ERR|ERROR|VERB|DEBUG)\s*\[\s*[\w:~<>()-]+\]\s(.*?)(?:\s\|\s(.*))?$")
_KV = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)')
_NUM = re.compile(r"(\w+)\s*=\s*(-?\d+(?:\.\d+)?)")
_TOOK = re.compile(r"took\s+(-?\d+(?:\.\d+)?)\s*ms")
_SIZE = re.compile(r"size\s*=\s*(\d+(?:\.\d+)?)\s*MiB")

# One search per line decides whether it can matter at all (most of a verbose log cannot).
_RELEVANT = re.compile(
    r"checkpoint|re-?process|from scratch|eval time|memory_seq_rm|kv cache rm|lcp =|checking sim|"
    r"Cache: cache_size|stop processing|slot released|new prompt|processing task|n_past|saving prompt|"
    r"better prompt|initializing|prompt tokenized|slot is empty|prompt cache is|context checkpoints enabled|"
    r"llama_kv_cache: size")
_EVENTS: list[tuple[str, re.Pattern]] = [(name, re.compile(p)) for name, p in [
    ("restore_failed", r"failed to restore context checkpoint"),
    ("created", r"created context checkpoint\s+(\d+)\s+of\s+(\d+)"),
    ("restored", r"restored context checkpoint"),
    ("erased:invalidated", r"erased invalidated context checkpoint"),
    ("erased:limit", r"erasing old context checkpoint"),
    ("erased:too_close", r"erasing context checkpoint too close"),
    ("erased:superseded", r"superseding context checkpoint"),
    ("forced", r"forcing full prompt re-?processing|no usable hybrid/recurrent checkpoint|re-?processing from scratch"),
    ("sim", r"checking sim = [\d.]+ \((\d+)/(\d+)\)"),
    ("empty", r"skipping, slot is empty"),
    ("candidate", r"prompt with length\s+(\d+), lcp =\s+(\d+), f_keep = ([\d.]+), f_sim = ([\d.]+)"),
    ("cache_load", r"found better prompt with f_keep = ([\d.]+), f_sim = ([\d.]+)"),
    ("cache_save", r"saving prompt with length\s+(\d+)"),
    ("ik_cache", r"Cache: cache_size = (\d+), n_past0? = +(\d+)(?:, n_past1 = +(\d+))?"),
    ("start", r"^(?:processing task|slot is processing task|new prompt)"),
    ("prompt_tokenized", r"^prompt tokenized"),
    ("kept", r"(?:n_tokens|n_past)\s*=\s*(\d+),\s*memory_seq_rm|kv cache rm \[(p0|\d+), end\)"),
    ("prefill", r"prompt eval time\s*=\s*([\d.]+) ms /\s*(\d+) tokens"),
    ("decode", r"eval time\s*=\s*([\d.]+) ms /\s*(\d+) (?:tokens|runs)"),
    ("release", r"stop processing: (?:n_tokens|n_past) = (\d+)|^slot released"),
    ("restart", r"initializing, n_slots = (\d+)|^initializing slots"),
    ("cache_ram", r"prompt cache is (?:enabled, size limit: (-?\d+) MiB|disabled)"),
    ("checkpoint_limits", r"context checkpoints enabled, max = (\d+)(?:, min spacing = (\d+))?"),
    ("kv_size", r"llama_kv_cache: size =\s*([\d.]+) MiB \(\s*(\d+) cells"),
]]
# The server's settings some of these lines show (None where the log does not say).
SETTINGS = ("slots", "n_ctx_slot", "cache_ram_mib", "ctx_checkpoints", "checkpoint_min_step", "kv_bytes_per_token")
# Relevant-looking lines that carry nothing this report uses.
_KNOWN = re.compile(
    r"checking checkpoint with|do_checkpoint|speculative checkpoint|checkpoints (?:enabled|disabled)|use checkpoints|"
    r"tokens, checkpoints:|cache state:|looking for better prompt|launching slot|decode token|n_past was set|"
    r"need to evaluate at least|prompt processing|prompt done|initializing tokenizer|^initializing \.\.\.|"
    r"context shift|only caching to alora|after context reuse|trying to reuse chunks|n_past_old|failed to truncate|"
    r"slot\.prompt\.tokens\.size\(\)|cache_tokens\.size\(\)|restoring speculative|draft tokens")


@dataclass
class Call:
    """One request as the log shows it; None where the log does not say."""

    slot: int
    task: int | None
    file: str
    line: int
    prompt_tokens: int | None = None
    lcp: int | None = None  # common prefix with the slot's cached prompt before this request
    reused: int | None = None
    processed: int | None = None
    prefill_ms: float | None = None
    decode_ms: float | None = None
    generated: int | None = None
    forced: bool = False
    reason: str | None = None  # the server's own words when it forced a full re-processing
    cache_load: bool = False  # the slot's cached prompt was swapped for one from the prompt cache
    restored: dict[str, float] | None = None
    restore_failed: int = 0
    created: list[dict[str, float]] = field(default_factory=list)
    erased: Counter = field(default_factory=Counter)
    wiped: bool = False  # this request erased every checkpoint the slot held
    ended: bool = False
    epoch: int = 0  # server starts before this request: a restart empties every slot
    # across requests (``reuse.measure``, from the prompts' ids): the longest prefix shared with
    # any earlier request, the reuse that was possible, and the lost part by cause
    shared: int | None = None
    possible: int | None = None
    lost_to: dict[str, int] | None = None

    def finish(self) -> None:
        if self.reused is None and self.prompt_tokens is not None and self.processed is not None:
            self.reused = self.prompt_tokens - self.processed
        if self.prompt_tokens is None and self.reused is not None and self.processed is not None:
            self.prompt_tokens = self.reused + self.processed

    @property
    def full(self) -> bool:
        return self.reused == 0 and bool(self.prompt_tokens or self.processed)

    def silent(self, unit: int) -> bool:
        """A whole prompt re-processed, no forcing line, though an earlier request shared at least
        ``unit`` tokens of it (across requests when the prompts' ids are known, else the slot's)."""
        known = self.shared if self.shared is not None else self.lcp
        return self.full and not self.forced and (known or 0) >= unit

    @property
    def reusable(self) -> int | None:
        """What the slot's cache could have served: the common prefix, less the one token every
        request must compute to get logits."""
        if self.lcp is None or self.prompt_tokens is None:
            return None
        return max(0, min(self.lcp, self.prompt_tokens - 1))

    def to_dict(self, unit: int) -> dict[str, Any]:
        lost = None if self.reusable is None or self.reused is None else max(0, self.reusable - self.reused)
        return {
            "slot": self.slot, "task": self.task, "file": self.file, "line": self.line,
            "prompt_tokens": self.prompt_tokens, "common_prefix": self.lcp, "reused": self.reused,
            "processed": self.processed, "lost": lost,
            "prefill_s": None if self.prefill_ms is None else round(self.prefill_ms / 1000, 6),
            "decode_s": None if self.decode_ms is None else round(self.decode_ms / 1000, 6),
            "generated": self.generated, "forced": self.forced, "forced_reason": self.reason,
            "silent": self.silent(unit), "shared": self.shared, "possible": self.possible, "lost_to": self.lost_to,
            "prompt_cache_load": self.cache_load, "restored": self.restored, "restore_failed": self.restore_failed,
            "created": len(self.created), "erased": dict(self.erased), "wiped": self.wiped, "complete": self.ended,
        }


@dataclass
class _Slot:
    live: int | None = 0  # checkpoints the slot holds, while the log lets us know
    pending_lcp: int | None = None
    pending_load: bool = False
    candidates: list[tuple[int, str, str]] = field(default_factory=list)


def _fields(text: str) -> dict[str, float]:
    out: dict[str, float] = {k: float(v) for k, v in _NUM.findall(text)}
    if m := _TOOK.search(text):
        out["ms"] = float(m.group(1))
    if m := _SIZE.search(text):
        out["size_mib"] = float(m.group(1))
    return out


class Reader:
    """Feeds log lines, one at a time, into per-slot state; ``report()`` at any point."""

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self.slots: dict[int, _Slot] = {}
        self.current: dict[int, Call] = {}  # the request each slot is serving
        self.last: Call | None = None  # for lines that name no slot (ik's ``======== Cache``)
        self.selecting: int | None = None  # the slot a prompt-cache lookup is for
        self.saved = 0
        self.unparsed: list[dict[str, Any]] = []
        self.unparsed_count = 0
        self.problems: list[str] = []
        self.lines = self.bytes = self.recognized = self.garbled = self.starts = 0
        self.files: list[str] = []
        self.server: dict[str, Any] = dict.fromkeys(SETTINGS)

    # --- lines -----------------------------------------------------------------------------------
    def feed_file(self, path: Path) -> None:
        name = str(path)
        self.files.append(name)
        recognized, n, tail = self.recognized, 0, b""
        with path.open("rb") as f:
            while True:
                data = f.readline(MAX_LINE)
                if not data:
                    break
                n += 1
                self.bytes += len(data)
                tail = data
                self.feed(data.decode("utf-8", errors="replace"), name, n)
        if n and not tail.endswith(b"\n"):
            self.problems.append(f"truncated: {name} ends mid-line (line {n}); the log was cut while being written")
        if self.recognized == recognized:
            raise GatekeeperError(f"{name}: not a llama.cpp-family server log (no llama-server or ik_llama.cpp line in "
                                  f"{n} lines); pass the server's own log, e.g. 'llama-server ... -lv 4 2> server.log'")

    def feed(self, raw: str, file: str = "-", n: int = 0) -> None:
        self.lines += 1
        line = raw.rstrip("\r\n")
        if "\x1b" in line:
            line = _ANSI.sub("", line)
        if "\x00" in line or line.count("\ufffd") > max(8, len(line) // 4):
            self.garbled += 1  # a verbose log quotes partial UTF-8 token pieces: a few are normal
        slot, task, msg, kv = self._split(line)
        if slot is not None or kv is not None or _SRV.search(line):
            self.recognized += 1
        if not _RELEVANT.search(msg):
            return
        for name, pattern in _EVENTS:
            m = pattern.search(msg)
            if m:
                self._event(name, m, msg, kv or {}, slot, task, file, n)
                return
        if _KNOWN.search(msg):
            return
        self.unparsed_count += 1
        if len(self.unparsed) < EXAMPLES:
            self.unparsed.append({"file": file, "line": n, "text": line[:300]})

    def _split(self, line: str) -> tuple[int | None, int | None, str, dict[str, str] | None]:
        """(slot, task, message, key=value fields) of one line in any of the known layouts."""
        if m := _SLOT.search(line):
            return int(m.group(1)), int(m.group(2)), m.group(3), None
        if line.lstrip().startswith("{"):
            try:
                d = json.loads(line)
            except ValueError:
                d = None
            if isinstance(d, dict) and isinstance(d.get("msg"), str):
                kv = {k: str(v) for k, v in d.items()}
                return _int(kv.get("id_slot")), _int(kv.get("id_task")), d["msg"], kv
        if m := _IK.match(line.lstrip()):
            kv = {k: v.strip('"') for k, v in _KV.findall(m.group(2) or "")}
            return _int(kv.get("id_slot")), _int(kv.get("id_task")), m.group(1), kv
        if m := _SRV.search(line):
            return None, None, m.group(1), None
        return None, None, line, None

    # --- events ----------------------------------------------------------------------------------
    def _slot(self, slot: int | None) -> _Slot:
        return self.slots.setdefault(slot if slot is not None else 0, _Slot())

    def _call_for(self, slot: int | None, task: int | None, file: str, n: int, start: bool = False) -> Call | None:
        if slot is None:
            return self.last
        call = self.current.get(slot)
        if call is not None and (task is None or task < 0 or call.task in (None, task)) and not (start and call.ended):
            if call.task is None and task is not None and task >= 0:
                call.task = task
            return call
        if not start:
            return None
        if call is not None and not call.ended:
            self.problems.append(f"incomplete: task {call.task} on slot {slot} ({call.file}:{call.line}) shows no "
                                 f"timings before task {task} starts at {file}:{n}; lines are missing")
        state = self._slot(slot)
        call = Call(slot, task if task is not None and task >= 0 else None, file, n,
                    lcp=state.pending_lcp, cache_load=state.pending_load, epoch=self.starts)
        if state.pending_load:
            state.live = None  # the slot now holds another prompt's checkpoints
        state.pending_lcp, state.pending_load, state.candidates = None, False, []
        self.calls.append(call)
        self.current[slot] = self.last = call
        return call

    def _event(self, name: str, m: re.Match, msg: str, kv: dict[str, str], slot: int | None, task: int | None,
               file: str, n: int) -> None:
        if name == "restart":
            self.starts += 1
            for c in self.current.values():
                if not c.ended:
                    self.problems.append(f"incomplete: task {c.task} on slot {c.slot} ({c.file}:{c.line}) "
                                         f"never finished: the server restarted at {file}:{n}")
            self.slots, self.current, self.last, self.selecting = {}, {}, None, None
            values = _fields(msg)
            if m.group(1):
                self.server["slots"] = int(m.group(1))
            if "n_ctx_slot" in values:
                self.server["n_ctx_slot"] = int(values["n_ctx_slot"])
            return
        if name == "cache_ram":
            self.server["cache_ram_mib"] = int(m.group(1)) if m.group(1) else 0
            return
        if name == "checkpoint_limits":
            self.server["ctx_checkpoints"] = int(m.group(1))
            self.server["checkpoint_min_step"] = _int(m.group(2))
            return
        if name == "kv_size":  # the last one is the context the server kept (an earlier one may be a fit probe)
            self.server["kv_bytes_per_token"] = float(m.group(1)) * 2**20 / int(m.group(2))
            return
        if name in ("sim", "empty") and slot is not None:
            self._slot(slot).pending_lcp = int(m.group(1)) if name == "sim" else 0
            self.selecting = slot
            return
        if name == "candidate":
            self._slot(self.selecting).candidates.append((int(m.group(2)), m.group(3), m.group(4)))
            return
        if name == "cache_load":
            state = self._slot(self.selecting)
            chosen = [lcp for lcp, keep, sim in state.candidates if (keep, sim) == (m.group(1), m.group(2))]
            state.pending_lcp = chosen[0] if chosen else None
            state.pending_load = True
            return
        if name == "cache_save":
            self.saved += 1
            return
        if "selected slot" in msg:
            self.selecting = slot
        call = self._call_for(slot, task, file, n, start=name == "start")
        if call is None:
            if name in ("start", "prompt_tokenized"):
                return
            self.problems.append(f"orphan: {file}:{n} ({name}) belongs to no request the log shows starting")
            return
        self._apply(call, name, m, msg, kv)

    def _apply(self, call: Call, name: str, m: re.Match, msg: str, kv: dict[str, str]) -> None:
        state = self._slot(call.slot)
        values = {**{k: float(v) for k, v in kv.items() if _float(v) is not None}, **_fields(msg)}
        if name == "start":
            n = values.get("task.n_tokens", values.get("n_tokens", values.get("n_prompt_tokens")))
            if "new prompt" in msg and n is not None:
                call.prompt_tokens = int(n)
        elif name == "prompt_tokenized" and "n_prompt_tokens" in values:
            call.prompt_tokens = int(values["n_prompt_tokens"])
        elif name == "ik_cache":
            call.lcp = int(m.group(3) or m.group(2))
        elif name == "kept" and call.reused is None:
            kept = m.group(1) or (m.group(2) if m.group(2) != "p0" else kv.get("p0"))
            call.reused = _int(kept)
        elif name == "forced":
            call.forced = True
            call.reason = call.reason or msg.strip()[:200]
        elif name == "created":
            call.created.append(values)
            state.live = int(m.group(1))
        elif name == "restored":
            call.restored = values
        elif name == "restore_failed":
            call.restore_failed += 1
        elif name.startswith("erased:"):
            call.erased[name.split(":", 1)[1]] += 1
            if state.live is not None:
                state.live = max(0, state.live - 1)
                if state.live == 0 and name == "erased:invalidated":
                    call.wiped = True
        elif name == "prefill":
            call.prefill_ms, call.processed = float(m.group(1)), int(m.group(2))
            call.ended = True
        elif name == "decode":
            call.decode_ms, call.generated = float(m.group(1)), int(m.group(2))
        elif name == "release":
            call.ended = call.ended or call.processed is not None

    # --- the report ------------------------------------------------------------------------------
    def report(self, unit: int) -> dict[str, Any]:
        for call in self.calls:
            call.finish()
        problems = list(self.problems)
        for call in self.calls:
            if not call.ended:
                problems.append(f"incomplete: task {call.task} on slot {call.slot} ({call.file}:{call.line}) has no "
                                "timings; the log ends before it finished, or its lines are missing")
        if self.unparsed_count:
            problems.append(f"unparsed: {self.unparsed_count} line(s) look relevant but match no known format "
                            "(see 'unparsed'); their figures are missing from this report")
        if self.garbled:
            problems.append(f"garbled: {self.garbled} line(s) hold bytes that are not text")
        if self.calls and all(c.prompt_tokens is None and c.reused is None for c in self.calls):
            problems.append("no per-request prompt sizes in this log: run the server with -lv 4 (or --verbose) "
                            "for its cache and checkpoint lines")
        slots = sorted({c.slot for c in self.calls})
        return {
            "files": self.files, "lines": self.lines, "bytes": self.bytes, "server_starts": self.starts,
            "complete": not problems,
            "server": {**self.server, "slots": self.server["slots"] or (max(slots) + 1 if slots else None)},
            **summary(self.calls, unit, self.saved),
            "slots": {str(s): summary([c for c in self.calls if c.slot == s], unit) for s in slots},
            "requests_detail": [c.to_dict(unit) for c in self.calls],
            "unparsed": {"count": self.unparsed_count, "examples": self.unparsed},
            "problems": problems,
        }


def _int(v: Any) -> int | None:
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


def _float(v: Any) -> float | None:
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def _total(values: Iterable[float | int | None]) -> float | int | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def _share(part: float | None, whole: float | None) -> float | None:
    return round(part / whole, 4) if part is not None and whole else None


def _dist(values: Sequence[float | None]) -> dict[str, float] | None:
    return distribution([v for v in values if v is not None])


def summary(calls: Sequence[Call], unit: int, saved: int | None = None) -> dict[str, Any]:
    """The figures of a set of requests (a slot's, or all); sums run over the requests that show them."""
    sized = [c for c in calls if c.prompt_tokens is not None]
    bounded = [c for c in sized if c.reusable is not None and c.reused is not None]
    prompt = _total(c.prompt_tokens for c in sized)
    prefill, decode = _total(c.prefill_ms for c in calls), _total(c.decode_ms for c in calls)
    erased: Counter = Counter()
    for c in calls:
        erased.update(c.erased)
    created = [v for c in calls for v in c.created]
    restores = [c.restored for c in calls if c.restored is not None]
    out: dict[str, Any] = {
        "requests": len(calls),
        "prompt_tokens": prompt,
        "reused": _total(c.reused for c in calls),
        "processed": _total(c.processed for c in calls),
        "lost": _total(max(0, c.reusable - c.reused) for c in bounded) if bounded else None,  # type: ignore[operator]
        "reusable": _total(c.reusable for c in bounded) if bounded else None,
        "reusable_share": _share(_total(c.reusable for c in bounded), _total(c.prompt_tokens for c in bounded)),
        "reused_share": _share(_total(c.reused for c in sized), prompt),
        "common_prefix": _dist([c.lcp for c in calls]),
        "full_reprocessing": {"forced": sum(c.forced for c in calls), "silent": sum(c.silent(unit) for c in calls),
                              "total": sum(c.full for c in calls)},
        "checkpoints": {
            "created": len(created), "restored": len(restores), "restore_failed": sum(c.restore_failed for c in calls),
            "erased": sum(erased.values()), "erased_by_reason": dict(erased), "wipes": sum(c.wiped for c in calls),
            "size_mib": _dist([v.get("size_mib") for v in created]),
            "create_ms": _dist([v.get("ms") for v in created]),
            "restore_ms": _dist([v.get("ms") for v in restores]),
        },
        "prompt_cache": {"loaded": sum(c.cache_load for c in calls)},
        "prefill_s": None if prefill is None else round(prefill / 1000, 6),
        "decode_s": None if decode is None else round(decode / 1000, 6),
        "prefill_share": _share(prefill, None if prefill is None or decode is None else prefill + decode),
    }
    if saved is not None:
        out["prompt_cache"]["saved"] = saved
    return out


def read(paths: Sequence[str | Path], capture: str | Path | None = None, *, unit: int = reuse.UNIT,
         cache_ram: Sequence[int] = advice.CACHE_RAM, advise: bool = True) -> dict[str, Any]:
    """The report for one server's logs, in the order given (rotated files continue each other);
    with ``capture`` (the same traffic's prompts), reuse across requests and (``advise``) the advice too."""
    if not paths:
        raise GatekeeperError("give at least one server log file")
    if unit < 1:
        raise GatekeeperError("--unit must be at least 1 token")
    reader = Reader()
    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            raise GatekeeperError(f"{p} is a folder; pass the server's log file(s) inside it")
        if not p.is_file():
            raise GatekeeperError(f"log file {p} does not exist; pass the file llama-server writes its log to")
        try:
            reader.feed_file(p)
        except OSError as e:
            raise GatekeeperError(f"log file {p}: cannot be read ({e.strerror or e})") from None
    for call in reader.calls:
        call.finish()
    cross = tips = None
    if capture is not None:
        matched = reuse.prompts(capture, reader.calls)
        cross = reuse.measure(reader.calls, [m.tokens if m else None for m in matched], unit)
        if advise:
            found = [m for m in matched if m is not None]
            tips = advice.advise([m.tokens for m in found], [m.stage for m in found], cross["possible"], reader.server,
                                 advice.checkpoint_size([v.get("size_mib") for c in reader.calls for v in c.created]),
                                 unit=unit, cache_ram=cache_ram)
    report = reader.report(unit)
    report.update(reuse=cross, advice=tips, cannot_report=[] if capture is not None else [reuse.NEEDS])
    return report
