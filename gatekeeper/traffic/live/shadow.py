"""One live request seen twice: what the client got from the flag-on side, and what the flag-off side says.

The pieces the guard (``guarded.py``) puts together, each free of I/O: the answer's text read from a JSON or a
streamed (SSE) completion of any of the OpenAI-compatible shapes the proxy forwards; whether a request's decoding
can be paired (greedy, or sampled with a seed both sides are given: otherwise the two answers are independent
draws, counted and never compared); the shadow request (the same body, not streamed); the comparison and the
point where two answers part; and the shares and token budget that decide which requests are shadowed, and which
of those go to the flag-off side a second time (the A/A baseline).
"""

from __future__ import annotations

import json
import random
import time
from collections import deque
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Answer:
    text: str
    finish: str | None
    tokens: int | None  # completion tokens, where the server counted them

    def cost(self, request: dict) -> int:
        """The tokens its shadow costs: as the server counted them, else about a token per four characters."""
        return self.tokens if self.tokens is not None else max(1, len(self.text) // 4)


def _choice(d: dict) -> tuple[str, str | None]:
    """(text, finish) of one JSON completion or one SSE chunk: chat, completions or llama.cpp's /completion."""
    choices = d.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        c = choices[0]
        part = c.get("delta") if isinstance(c.get("delta"), dict) else c.get("message")
        text = part.get("content") if isinstance(part, dict) else c.get("text")
        return (text if isinstance(text, str) else ""), c.get("finish_reason")
    text = d.get("content")
    finish = d.get("stop_type") if d.get("stop") else None  # llama.cpp: stop is true on the last event
    return (text if isinstance(text, str) else ""), finish


def _tokens(d: dict) -> int | None:
    usage = d.get("usage")
    n = usage.get("completion_tokens") if isinstance(usage, dict) else d.get("tokens_predicted")
    return n if isinstance(n, int) else None


def _answer(d: dict) -> Answer:
    text, finish = _choice(d)
    return Answer(text, finish, _tokens(d))


def read(body: bytes, sse: bool) -> Answer | None:
    """The answer in a completion response, or None where it is not one (an error, a cut stream)."""
    if not sse:
        d = document(body)
        return None if d is None or "error" in d else _answer(d)
    parts, finish, tokens, done = [], None, None, False
    for event in body.replace(b"\r\n", b"\n").split(b"\n\n"):
        for line in event.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                continue
            d = document(data)
            if d is None or "error" in d:
                return None
            piece = _answer(d)
            parts.append(piece.text)
            finish = piece.finish or finish
            tokens = piece.tokens if piece.tokens is not None else tokens
            done = done or (piece.finish is not None and "choices" not in d)  # llama.cpp's /completion ends without [DONE]
    return Answer("".join(parts), finish, tokens) if done or finish is not None else None


def unpaired(request: dict) -> str | None:
    """Why this request's two answers cannot be compared token for token, or None where they can."""
    if request.get("n", 1) not in (1, None):
        return "several choices"
    if request.get("temperature") == 0 or request.get("top_k") == 1:
        return None
    if isinstance(request.get("seed"), int) and not isinstance(request.get("seed"), bool):
        return None  # both sides draw with the same seed
    return "sampled without a seed"


def shadow_body(request: dict) -> bytes:
    """The request as the flag-off side gets it: the same decoding and seed, answered in one piece."""
    out = {k: v for k, v in request.items() if k != "stream_options"}
    out["stream"] = False
    return json.dumps(out).encode()


def parting(a: str, b: str) -> int | None:
    """The first character where two answers differ (None: they do not)."""
    if a == b:
        return None
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def shape(chars: int) -> str:
    """A prompt's size class for coverage: its characters (as the request has them), in powers of two."""
    return f"chr<{1 << max(chars, 1).bit_length()}"


class Sampler:
    """Which requests are shadowed: each stage's share, and a budget of live-answer tokens per minute; and which
    shadowed requests are also compared A/A (``aa_rate``), drawn apart from the outcomes (its own random stream)."""

    def __init__(self, rate: float, stages: dict[str, float], tokens_per_minute: int | None, seed: int | None = None,
                 aa_rate: float = 0.0):
        self.rate, self.stages, self.budget, self.aa_rate = rate, stages, tokens_per_minute, aa_rate
        self.random = random.Random(seed)
        self.twin = random.Random(None if seed is None else f"{seed}/aa")
        self.spent: deque[tuple[float, int]] = deque()  # (monotonic time, tokens) within the last minute

    def pick(self, stage: str) -> bool:
        return self.random.random() < self.stages.get(stage, self.rate)

    def twice(self) -> bool:
        """This shadowed request also goes to the flag-off side a second time (an A/A comparison)."""
        return self.aa_rate > 0 and self.twin.random() < self.aa_rate

    def afford(self, tokens: int, now: float | None = None) -> bool:
        if self.budget is None:
            return True
        now = time.monotonic() if now is None else now
        while self.spent and self.spent[0][0] <= now - 60:
            self.spent.popleft()
        if sum(n for _, n in self.spent) + tokens > self.budget:
            return False
        self.spent.append((now, tokens))
        return True


def document(raw: bytes) -> dict[str, Any] | None:
    """A JSON object (a request or an answer), or None where the bytes are not one."""
    try:
        d = json.loads(raw)
    except ValueError:
        return None
    return d if isinstance(d, dict) else None
