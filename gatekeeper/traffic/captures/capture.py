"""Prompt captures: one request a line of local JSONL, written by the runtime, read by analyze and replay.

A line holds ``stage``, ``stream`` (conversation id; the turns of one conversation share it),
``t`` (seconds since the capture started), ``duration_s`` (the call's wall time, where the writer
measured it), ``tokens`` (ids) and/or ``text``, and, where known,
``segments``: ``[{static, start, end}]``, offsets into ``tokens`` when the line has them, else
byte offsets into the UTF-8 ``text``. Other keys are kept for later readers and ignored here.
Nothing is sent anywhere: the file stays where the caller put it.

A line may carry the call's telemetry as the server reported it (``prompt_tokens``,
``cached_tokens``, ``prefill_s``, ``decode_s``); a figure the server did not report is left out,
never written as 0. A metadata-only line (``gatekeeper proxy --no-text``) has no ``tokens`` or
``text`` but ``bytes`` (the rendered prompt's UTF-8 length), ``digest`` and ``blocks``: salted
SHA-256 digests of every ``BLOCK``-byte prefix, enough to find shared prefixes without the text.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator, Sequence, TypeGuard

from ...battery.partition import Piece, Rendered
from ...engines.served.telemetry import Telemetry
from ...errors import GatekeeperError

BLOCK = 64  # bytes per prefix digest on metadata-only lines
TELEMETRY = ("prompt_tokens", "cached_tokens", "prefill_s", "decode_s")


@dataclass(frozen=True)
class Segment:
    static: bool
    start: int
    end: int

    def to_dict(self) -> dict[str, Any]:
        return {"static": self.static, "start": self.start, "end": self.end}


@dataclass(frozen=True)
class Request:
    """One captured request; ``line`` is its 1-based line number, for messages."""

    stage: str
    stream: str
    t: float
    tokens: list[int] | None
    text: str | None
    segments: list[Segment] | None
    line: int
    telemetry: Telemetry = Telemetry()
    size: int | None = None  # UTF-8 bytes of a metadata-only line's prompt
    blocks: list[str] | None = None  # a metadata-only line's prefix digests
    duration_s: float | None = None  # the call's wall time, from ``t`` to its answer's end

    @property
    def length(self) -> int:
        """The request's size in the unit its segments use: tokens if present, else text bytes."""
        if self.tokens is not None:
            return len(self.tokens)
        return len(self.text.encode()) if self.text is not None else self.size or 0


# --- writing -----------------------------------------------------------------------------------


def check_path(path: str | Path) -> Path:
    """The capture file's path, refused before anything is written if it cannot be created."""
    p = Path(path)
    if p.is_dir():
        raise GatekeeperError(f"capture path {p} is a folder; name a file such as {p / 'capture.jsonl'}")
    if not p.parent.is_dir():
        raise GatekeeperError(f"capture path {p}: folder {p.parent} does not exist; create it or pick another path")
    return p


class CaptureWriter:
    """Appends one JSON line per request and flushes it, so a crash loses at most the call in flight.

    The file is started afresh: ``t`` counts from this writer's creation, and one time base per file
    is what makes the inter-arrival times of a replay meaningful.
    """

    def __init__(self, path: str | Path):
        self.path = check_path(path)
        self._file = self.path.open("w", encoding="utf-8")
        self._t0 = time.perf_counter()

    def now(self) -> float:
        """Seconds since this capture started: a request's ``t``."""
        return round(time.perf_counter() - self._t0, 6)

    def write(self, stage: str, stream: str, rendered: Rendered, segments: Sequence[Segment], t: float) -> None:
        """One call that started at ``t`` (``now()`` then) and has just been answered."""
        self.write_record({"stage": stage, "stream": stream, "t": t, "duration_s": round(self.now() - t, 6),
                           "tokens": list(rendered.tokens), "text": rendered.text,
                           "segments": [s.to_dict() for s in segments]})

    def write_record(self, record: dict[str, Any], telemetry: Telemetry | None = None) -> None:
        """One line as given, plus the telemetry figures the server reported (absent ones left out)."""
        if telemetry is not None:
            record.update({k: round(v, 6) if isinstance(v, float) else v
                           for k, v in telemetry.to_dict().items() if v is not None})
        self._file.write(json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def metadata(text: str, salt: bytes) -> dict[str, Any]:
    """What a metadata-only line keeps of a prompt: its length and salted digests of its prefixes."""
    data = text.encode()
    h, blocks = hashlib.sha256(salt), []
    for start in range(0, len(data) - len(data) % BLOCK, BLOCK):
        h.update(data[start:start + BLOCK])
        blocks.append(h.copy().hexdigest()[:16])
    h.update(data[len(data) - len(data) % BLOCK:])
    return {"bytes": len(data), "digest": h.hexdigest(), "blocks": blocks}


def _token_offset(engine, text: str, tokens: Sequence[int], chars: int) -> int:
    """How many of ``tokens`` cover exactly ``text[:chars]``: a token merging across the cut stays out."""
    n = 0
    for a, b in zip(engine.tokenize(text[:chars]), tokens):
        if a != b:
            break
        n += 1
    return n


def segments(engine, rendered: Rendered, ordered: Sequence[Piece], first_turn: bool) -> list[Segment]:
    """Token segments of a rendered prompt, static or dynamic, covering it end to end.

    A segment runs from its piece's first byte to the next piece's first byte, so the chat template's
    framing between two pieces goes with the one before it, and the framing ahead of the first piece
    is static: the boundaries fall where ``partition.render`` ends the static prefix. Later turns
    carry a transcript whose pieces are merged into earlier messages: there only the static prefix
    is known.
    """
    n = len(rendered.tokens)
    bounds: list[tuple[int, bool]] = []  # (char offset, static) where each piece starts
    if first_turn:
        cursor = 0
        for piece in ordered:
            if not piece.text:
                continue
            at = rendered.text.find(piece.text, cursor)
            if at < 0:  # a template that rewrites content: fall back to the static prefix alone
                bounds = []
                break
            bounds.append((at, piece.static))
            cursor = at + len(piece.text)
    if not bounds:
        out = [Segment(True, 0, rendered.static_tokens), Segment(False, rendered.static_tokens, n)]
        return [s for s in out if s.end > s.start]
    if bounds[0][0] > 0:
        bounds.insert(0, (0, True))
    starts = [0] + [_token_offset(engine, rendered.text, rendered.tokens, c) for c, _ in bounds[1:]] + [n]
    merged: list[Segment] = []
    for (_, static), start, end in zip(bounds, starts, starts[1:]):
        if end <= start:
            continue
        if merged and merged[-1].static == static:
            merged[-1] = Segment(static, merged[-1].start, end)
        else:
            merged.append(Segment(static, start, end))
    return merged


# --- reading -----------------------------------------------------------------------------------


def _bad(path: Path, line: int, field: str, problem: str) -> GatekeeperError:
    return GatekeeperError(f"{path}:{line}: field '{field}' {problem}; each line needs "
                           "stage, stream, t and tokens or text (see docs/measuring.md)")


def _utf8(s: str) -> bool:
    try:
        s.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _int(v: Any) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def _telemetry(path: Path, n: int, d: dict[str, Any]) -> Telemetry:
    """The line's telemetry; a figure left out or null is not reported, anything else must be a number >= 0."""
    values = {}
    for key in TELEMETRY:
        v = d.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0):
            raise _bad(path, n, key, "is not a number >= 0 (leave it out when the server did not report it)")
        if v is not None and key.endswith("_tokens") and not _int(v):
            raise _bad(path, n, key, "is not a whole number of tokens")
        values[key] = v
    return Telemetry(**values)


def _metadata(path: Path, n: int, d: dict[str, Any]) -> tuple[int, list[str]]:
    size, blocks = d.get("bytes"), d.get("blocks")
    if not _int(size) or size < 0:
        raise _bad(path, n, "bytes", "is missing or not a byte count (a line without tokens or text needs it)")
    if not isinstance(blocks, list) or not all(isinstance(b, str) for b in blocks) or len(blocks) > size // BLOCK:
        raise _bad(path, n, "blocks", f"is missing or not the prefix digests of every {BLOCK} bytes")
    return size, blocks


def _parse(path: Path, n: int, raw: str, content: bool = True) -> Request:
    try:
        d = json.loads(raw)
    except json.JSONDecodeError as e:
        raise GatekeeperError(f"{path}:{n}: not JSON ({e.msg} at column {e.colno}); each line is one JSON object") from None
    except ValueError as e:  # e.g. an integer of more digits than Python converts
        raise GatekeeperError(f"{path}:{n}: not usable JSON ({e}); each line is one JSON object") from None
    except RecursionError:
        raise GatekeeperError(f"{path}:{n}: not usable JSON: nested too deeply; each line is one flat JSON object") from None
    if not isinstance(d, dict):
        raise GatekeeperError(f"{path}:{n}: a line must be a JSON object, not {type(d).__name__}")
    if not isinstance(d.get("stage"), str) or not d["stage"]:
        raise _bad(path, n, "stage", "is missing or not a non-empty string")
    if not (isinstance(d.get("stream"), str) or _int(d.get("stream"))):
        raise _bad(path, n, "stream", "is missing or not a string or integer")
    t = d.get("t")
    if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t):
        raise _bad(path, n, "t", "is missing or not a finite number of seconds")
    tokens, text = d.get("tokens"), d.get("text")
    size = blocks = None
    if tokens is None and text is None:
        if content or "bytes" not in d:
            raise _bad(path, n, "tokens", "and 'text' are both missing; give at least one"
                       + (" (a metadata-only line from 'proxy --no-text' holds no prompt)" if "bytes" in d else ""))
        size, blocks = _metadata(path, n, d)
    if tokens is not None and (not isinstance(tokens, list) or not all(_int(x) and 0 <= x < 2**63 for x in tokens)):
        raise _bad(path, n, "tokens", "is not a list of token ids (whole numbers, 0 or more)")
    if text is not None and not isinstance(text, str):
        raise _bad(path, n, "text", "is not a string")
    for key in ("stage", "stream", "text"):
        if isinstance(d.get(key), str) and not _utf8(d[key]):
            raise _bad(path, n, key, "holds an unpaired surrogate escape (such as \\ud800), which is not text")
    duration = d.get("duration_s")
    if duration is not None and (not isinstance(duration, (int, float)) or isinstance(duration, bool)
                                 or not math.isfinite(duration) or duration < 0):
        raise _bad(path, n, "duration_s", "is not a non-negative number of seconds")
    request = Request(d["stage"], str(d["stream"]), float(t), tokens, text, None, n, _telemetry(path, n, d), size, blocks,
                      None if duration is None else float(duration))
    raw_segments = d.get("segments")
    if raw_segments is None:
        return request
    if not isinstance(raw_segments, list):
        raise _bad(path, n, "segments", "is not a list of {static, start, end}")
    segs = []
    for i, s in enumerate(raw_segments):
        where = f"segments[{i}]"
        if not isinstance(s, dict):
            raise _bad(path, n, where, "is not an object {static, start, end}")
        if not isinstance(s.get("static"), bool):
            raise _bad(path, n, f"{where}.static", "is missing or not true/false")
        for key in ("start", "end"):
            if not _int(s.get(key)) or s[key] < 0:
                raise _bad(path, n, f"{where}.{key}", "is missing or not a non-negative integer")
        if s["end"] < s["start"] or s["end"] > request.length:
            raise _bad(path, n, where, f"runs from {s['start']} to {s['end']}, outside the request's {request.length} "
                       f"{'tokens' if tokens is not None else 'text bytes'}")
        segs.append(Segment(s["static"], s["start"], s["end"]))
    return replace(request, segments=segs)


def read(path: str | Path, *, content: bool = True) -> list[Request]:
    """Every request in a capture file, in file order; a bad line is an error naming file, line and field.
    ``content=False`` also takes metadata-only lines (no tokens or text), which only ``analyze`` can use."""
    return list(requests(path, content=content))


def requests(path: str | Path, *, content: bool = True) -> Iterator[Request]:
    """``read``, one request at a time (a large capture need not be held whole)."""
    p = Path(path)
    if not p.is_file():
        raise GatekeeperError(f"capture file {p} does not exist; write one with 'gatekeeper measure --capture FILE'")
    try:
        f = p.open("rb")
    except OSError as e:
        raise GatekeeperError(f"capture file {p}: cannot be read ({e.strerror or e})") from None
    some = False
    with f:
        for n, data in enumerate(f, 1):
            try:
                raw = data.decode("utf-8")
            except UnicodeDecodeError as e:
                raise GatekeeperError(f"{p}:{n}: not UTF-8 text (byte 0x{data[e.start]:02x} at column {e.start + 1}); "
                                      "a capture is JSONL, UTF-8 text") from None
            if raw.strip():
                some = True
                yield _parse(p, n, raw, content)
    if not some:
        raise GatekeeperError(f"{p}: no requests in the file; a capture has one JSON object a line")


def prompts(path: str | Path) -> list[list[int] | str]:
    """Each captured call's prompt, ids where the line has them, else text: traffic to send again."""
    out: list[list[int] | str] = []
    for r in read(path, content=False):
        if r.tokens is None and r.text is None:
            raise GatekeeperError(f"{path}:{r.line}: a metadata-only line (proxy --no-text) holds no prompt to send "
                                  "again; capture the traffic without --no-text, or draw the load from the battery")
        out.append(list(r.tokens) if r.tokens is not None else r.text)  # type: ignore[arg-type]
    return out
