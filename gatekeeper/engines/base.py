"""The engine adapter contract every built-in and plugin engine implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

from ..errors import GatekeeperError
from ..workspace import EngineProfile


@dataclass
class Generation:
    """One greedy call: what came out, and what it cost."""

    tokens: list[int]
    text: str
    prompt_tokens: int
    cached_tokens: int  # prompt tokens whose state came from the prefix cache
    prefill_s: float
    decode_s: float
    ttft_s: float
    # per generated step, [[best_id, best_logit], [second_id, second_logit]]; None unless asked
    top2: list[list[list[float]]] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class EngineStats:
    """Running totals over an engine instance's life."""

    calls: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0

    def add(self, g: Generation) -> None:
        self.calls += 1
        self.prompt_tokens += g.prompt_tokens
        self.cached_tokens += g.cached_tokens
        self.prefill_s += g.prefill_s
        self.decode_s += g.decode_s


def checked_request(prompt: Sequence[int], max_tokens: int) -> list[int]:
    """The prompt as plain ints, once it is known that there is something to generate."""
    if not prompt:
        raise GatekeeperError("empty prompt: there is nothing to generate from")
    if max_tokens < 1:
        raise GatekeeperError(f"max_tokens is {max_tokens}; it must be at least 1")
    return [int(t) for t in prompt]


class Engine(ABC):
    """A model behind a greedy ``generate``; the prefix cache belongs to the instance.

    ``cache=False`` means every call starts from a fresh state; ``cache=True`` means the
    instance's prefix cache serves whatever prefix it holds.
    """

    name: str = "engine"

    def __init__(self, profile: EngineProfile, *, cache: bool = False):
        self.profile = profile
        self.cache_enabled = cache
        self.stats = EngineStats()

    # --- text <-> tokens ------------------------------------------------------------------------
    @abstractmethod
    def render(self, messages: Sequence[dict[str, str]]) -> str:
        """The chat template applied to ``messages``, ending with the assistant's turn opening."""

    @abstractmethod
    def tokenize(self, text: str) -> list[int]:
        """Token ids of already-rendered text (no special tokens added)."""

    @abstractmethod
    def detokenize(self, tokens: Sequence[int]) -> str: ...

    # --- generation -----------------------------------------------------------------------------
    @abstractmethod
    def generate(
        self, prompt: Sequence[int], *, max_tokens: int, stop: Sequence[str] = (), top2: bool = False
    ) -> Generation:
        """Greedy decoding of up to ``max_tokens`` tokens; stops at EOS or a stop string."""

    # --- stop rules, for adapters that decode token by token --------------------------------------
    eos_ids: frozenset[int] = frozenset()

    def stopped(self, tokens: list[int], stop: Sequence[str]) -> bool:
        """Whether the decoded text now contains a stop string."""
        if not stop:
            return False
        text = self.detokenize(tokens)
        return any(s and s in text for s in stop)

    def final_text(self, tokens: list[int], stop: Sequence[str]) -> str:
        """The answer's text: an ending EOS left out (its id stays in ``tokens``), cut before a stop string."""
        body = tokens[:-1] if tokens and tokens[-1] in self.eos_ids else tokens
        text = self.detokenize(body)
        cuts = [text.find(s) for s in stop if s and s in text]
        return text[: min(cuts)] if cuts else text

    def pin(self, prefix: Sequence[int]) -> None:
        """Register a stage's static prefix: a boundary of the prefill plan whether the cache is on
        or off (call it in both), and with the cache on a state computed once and never evicted."""

    def persist(self, root: Path) -> None:
        """Keep pinned prefix states in the result layer under ``root``: load them from there when
        their key matches, save what had to be computed. Engines without savable states ignore it."""

    def reset_cache(self) -> None:
        """Drop every cached state except pinned prefixes."""

    def unpin(self) -> None:
        """Forget every registered prefix and drop every cached state (prompts now render otherwise)."""

    @abstractmethod
    def identity(self) -> dict[str, Any]:
        """What makes the outputs what they are: engine name/version, library versions,
        weight/tokenizer digest, adapter digest, dtype, device, prefill plan."""

    def close(self) -> None:
        """Release the model."""
