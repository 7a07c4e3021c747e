"""Sampled decoding that two arms can pair: the declared chain applied to a step's logits, and a draw whose
randomness is keyed by (seed, case, sample, turn) and counted by step, never by call order or batch.

The draw is Gumbel-max: the token maximising its processed log-probability plus Gumbel noise from a Philox
stream keyed as above, at counter = step. Two arms given the same key draw the same noise: where their processed
distributions are equal they emit the same token, and where they differ the tokens part with probability at
least their total-variation distance (any coupling does), so counting coupled steps and mismatches bounds it.

The chain, in order (as transformers' and vLLM's samplers apply it): the repetition penalty over the prompt and
the answer so far, presence and frequency penalties over the answer so far, temperature, top-k, top-p, min-p
(min-p relative to the likeliest token after temperature). At temperature 0 the likeliest processed token is taken.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    import numpy as np

    from ..workspace import Decoding

CHAIN = ("repetition_penalty", "presence_penalty", "frequency_penalty", "temperature", "top_k", "top_p", "min_p")
# what each penalty counts: the repetition penalty every token it has seen, presence and frequency the answer's
WINDOW = {"repetition_penalty": "prompt+answer", "presence_penalty": "answer", "frequency_penalty": "answer"}


def chain() -> dict[str, Any]:
    """gatekeeper's own sampler as the identity records it (an in-process engine's chain order and windows)."""
    return {"sampler": "gatekeeper", "chain": list(CHAIN), "window": WINDOW, "draw": "gumbel-max, philox(seed, case, sample, turn) at step"}


def describe(d: "Decoding") -> str:
    """A decoding in one line, as a report names it: what differs from greedy."""
    knobs = {k: v for k, v in d.model_dump().items() if k not in ("max_tokens", "stop")}
    return ", ".join(f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}" for k, v in knobs.items()) or "greedy"


def key(seed: int, case: str, sample: int, turn: int) -> tuple[int, int]:
    """The 128-bit Philox key of one turn of one sampled answer."""
    h = hashlib.sha256(f"{seed}\0{case}\0{sample}\0{turn}".encode()).digest()
    return int.from_bytes(h[:8], "little"), int.from_bytes(h[8:16], "little")


@dataclass(frozen=True)
class Draw:
    """One turn's sampling: the decoding it follows and its key (``key``). Engines that decode in process take the
    draw's tokens (``Sampler.pick``); served engines send ``seed`` (the key folded to the server's seed width)."""

    decoding: "Decoding"
    key: tuple[int, int]

    @property
    def seed(self) -> int:
        """The key as a 31-bit request seed (the narrowest width a server takes)."""
        return (self.key[0] ^ self.key[1]) & 0x7FFFFFFF

    def sampler(self) -> "Sampler":
        return Sampler(self.decoding, self.key)

    def to_dict(self) -> dict[str, Any]:
        return {"decoding": self.decoding.model_dump(mode="json"), "key": list(self.key)}

    @classmethod
    def of(cls, d: dict[str, Any]) -> "Draw":
        from ..workspace import Decoding

        return cls(Decoding.model_validate(d["decoding"]), (int(d["key"][0]), int(d["key"][1])))


class Sampler:
    """One turn's chain and noise: ``pick`` takes a step's raw logits and the history, and returns the token with the
    log-probabilities the raw and the processed distributions give it (an arm's record for pairing)."""

    def __init__(self, decoding: "Decoding", key: tuple[int, int]):
        self.d = decoding
        self.key = key

    def processed(self, logits: "np.ndarray", prompt: Sequence[int], answer: Sequence[int]) -> "np.ndarray":
        """The processed log-probabilities (float64; -inf where a filter removed the token)."""
        import numpy as np

        x = np.asarray(logits, dtype=np.float64).copy()
        d = self.d
        if d.repetition_penalty != 1.0:
            seen = np.unique(np.asarray([*prompt, *answer], dtype=np.int64))
            v = x[seen]
            x[seen] = np.where(v > 0, v / d.repetition_penalty, v * d.repetition_penalty)
        if (d.presence_penalty or d.frequency_penalty) and len(answer):
            ids, counts = np.unique(np.asarray(answer, dtype=np.int64), return_counts=True)
            x[ids] -= d.presence_penalty + d.frequency_penalty * counts
        if d.sampled:
            x /= d.temperature
        lp = _log_softmax(x)
        if not d.sampled:
            return lp
        if d.top_k and d.top_k < len(lp):
            kth = np.partition(lp, -d.top_k)[-d.top_k]
            lp[lp < kth] = -np.inf
        if d.top_p < 1.0:
            order = np.argsort(-lp, kind="stable")
            mass = np.cumsum(np.exp(lp[order]))
            keep = int(np.searchsorted(mass, d.top_p)) + 1  # the fewest likeliest tokens holding top_p
            lp[order[keep:]] = -np.inf
        if d.min_p:
            lp[lp < np.max(lp) + np.log(d.min_p)] = -np.inf
        return _log_softmax(lp)

    def noise(self, step: int, vocab: int) -> "np.ndarray":
        """Gumbel noise of one step: a function of the key and the step alone."""
        import numpy as np

        bits = np.random.Philox(key=np.array(self.key, dtype=np.uint64), counter=np.array([step, 0, 0, 0], dtype=np.uint64))
        u = np.random.Generator(bits).random(vocab)
        return -np.log(-np.log(np.maximum(u, 1e-300)))

    def pick(self, logits: "np.ndarray", prompt: Sequence[int], answer: Sequence[int]) -> tuple[int, list[float]]:
        """The next token after ``prompt + answer``, and the raw and the processed log-probability of it with the
        processed one of the likeliest token (what a draw weighed: ``Generation.draws``)."""
        import numpy as np

        lp = self.processed(logits, prompt, answer)
        token = int(np.argmax(lp + self.noise(len(answer), len(lp)) if self.d.sampled else lp))
        raw = _log_softmax(np.asarray(logits, dtype=np.float64))
        return token, [float(raw[token]), float(lp[token]), float(np.max(lp))]


def _log_softmax(x: "np.ndarray") -> "np.ndarray":
    import numpy as np

    top = np.max(x)
    return x - top - np.log(np.sum(np.exp(x - top)))
