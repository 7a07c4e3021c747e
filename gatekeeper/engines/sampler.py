"""Sampled decoding that two arms can pair: the declared chain applied to a step's logits, and a draw whose
randomness is keyed by (seed, case, sample, turn) and counted by step, never by call order or batch.

The draw is Gumbel-max: the token maximising its processed log-probability plus Gumbel noise from a Philox
stream keyed as above, one stream per step (``stream``). Two arms given the same key draw the same noise: where their
processed distributions are equal they emit the same token, and where they differ the tokens part with probability
at least their total-variation distance (any coupling does), so counting coupled steps and mismatches bounds it.

The chain, in order (as transformers' and vLLM's samplers apply it): the repetition penalty over the prompt and
the answer so far, presence and frequency penalties over the answer so far, temperature, top-k, top-p, min-p
(min-p relative to the likeliest token after temperature). At temperature 0 the likeliest processed token is taken.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from ..summaries import SamplerChain

if TYPE_CHECKING:
    import numpy as np

    from ..workspace import Decoding

CHAIN = ("penalties", "temperature", "top_k", "top_p", "min_p")
# what each penalty counts: the repetition penalty every token seen, presence and frequency the answer's
WINDOW = {"repetition_penalty": "prompt+answer", "presence_penalty": "answer", "frequency_penalty": "answer"}
EDGE = 1e-3  # nats: a token this far outside the declared support's lowest raw log-probability is outside, read anywhere


def chain() -> SamplerChain:
    """gatekeeper's own sampler as the identity records it (an in-process engine's chain order and windows)."""
    return {"sampler": "gatekeeper", "chain": list(CHAIN), "window": WINDOW,
            "draw": "gumbel-max, philox(seed, case, sample, turn), one stream per step"}


def describe(d: "Decoding") -> str:
    """A decoding in one line, as a report names it: what differs from greedy."""
    knobs = {k: v for k, v in d.model_dump().items() if k not in ("max_tokens", "stop")}
    return ", ".join(f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}" for k, v in knobs.items()) or "greedy"


def key(seed: int, case: str, sample: int, turn: int) -> tuple[int, int]:
    """The 128-bit Philox key of one turn of one sampled answer."""
    h = hashlib.sha256(f"{seed}\0{case}\0{sample}\0{turn}".encode()).digest()
    return int.from_bytes(h[:8], "little"), int.from_bytes(h[8:16], "little")


def fresh() -> tuple[int, int]:
    """A key at random: a live draw, paired with nothing."""
    import secrets

    return secrets.randbits(64), secrets.randbits(64)


@dataclass(frozen=True)
class Draw:
    """One turn's sampling: the decoding it follows and its key (``key``). Engines that decode in process take the
    draw's tokens (``Sampler.pick``); served engines send ``seed`` (the key folded to the server's seed width), or
    none where ``seeded`` is False (load traffic: a server's unseeded requests in flight beside the seeded ones)."""

    decoding: "Decoding"
    key: tuple[int, int]
    seeded: bool = True

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
    """One turn's chain and noise: ``pick`` takes a step's raw logits and the history, and returns the token with
    what the draw weighed. ``spec``: the chain order and penalty windows (``chain()``'s keys; a server's own, as its
    dialect states them, to read its draws against)."""

    def __init__(self, decoding: "Decoding", key: tuple[int, int], spec: SamplerChain | None = None):
        self.d = decoding
        self.key = key
        self.spec = spec or chain()
        self.chain, self.window = self.spec["chain"], self.spec["window"]

    def processed(self, logits: "np.ndarray", prompt: Sequence[int], answer: Sequence[int]) -> "np.ndarray":
        """The processed log-probabilities (float64; -inf where a filter removed the token)."""
        import numpy as np

        x = np.asarray(logits, dtype=np.float64).copy()
        d = self.d
        for stage in self.chain:
            if stage == "penalties":
                self._penalise(x, prompt, answer)
            elif not d.sampled:  # greedy: the likeliest penalised token; the rest change nothing
                continue
            elif stage == "temperature":
                x /= d.temperature
            elif stage == "top_k" and 0 < d.top_k < len(x):
                x[x < np.partition(x, -d.top_k)[-d.top_k]] = -np.inf
            elif stage == "top_p" and d.top_p < 1.0:
                order = np.argsort(-x, kind="stable")
                mass = np.cumsum(np.exp(log_softmax(x)[order]))
                x[order[int(np.searchsorted(mass, d.top_p)) + 1:]] = -np.inf  # the fewest likeliest holding top_p
            elif stage == "min_p" and d.min_p:
                x[x < np.max(x) + np.log(d.min_p)] = -np.inf
        return log_softmax(x)

    def _penalise(self, x: "np.ndarray", prompt: Sequence[int], answer: Sequence[int]) -> None:
        import numpy as np

        d = self.d

        def counted(penalty: str) -> "np.ndarray":
            return np.asarray([*(prompt if self.window[penalty] == "prompt+answer" else ()), *answer], dtype=np.int64)

        if d.repetition_penalty != 1.0 and len(seen := np.unique(counted("repetition_penalty"))):
            v = x[seen]
            x[seen] = np.where(v > 0, v / d.repetition_penalty, v * d.repetition_penalty)
        for name, per in (("presence_penalty", False), ("frequency_penalty", True)):
            if getattr(d, name) and len(tokens := counted(name)):
                ids, counts = np.unique(tokens, return_counts=True)
                x[ids] -= getattr(d, name) * (counts if per else 1)

    def noise(self, step: int, vocab: int) -> "np.ndarray":
        """Gumbel noise of one step: a function of the key and the step alone."""
        import numpy as np

        u = stream(self.key, step, NOISE).random(vocab)
        return -np.log(-np.log(np.maximum(u, 1e-300)))

    def pick(self, logits: "np.ndarray", prompt: Sequence[int],
             answer: Sequence[int]) -> tuple[int, list[float], "np.ndarray"]:
        """The next token after ``prompt + answer``; the raw and the processed log-probability of it with the
        processed one of the likeliest token (what a draw weighed: ``Generation.draws``); the processed row."""
        import numpy as np

        lp = self.processed(logits, prompt, answer)
        token = int(np.argmax(lp + self.noise(len(answer), len(lp)) if self.d.sampled else lp))
        raw = log_softmax(np.asarray(logits, dtype=np.float64))
        return token, [float(raw[token]), float(lp[token]), float(np.max(lp))], lp


def transform(lp: "np.ndarray", token: int | None, key: tuple[int, int], step: int) -> float:
    """The randomized probability-integral transform of ``token`` under the declared decoding's processed row ``lp``
    (whatever sampler drew it): tokens ordered likeliest first (lowest id on a tie), F(tokens before it) + V p(token),
    V uniform from the key's own stream for it at ``step``. Over the steps of draws that follow the declared decoding it
    is uniform on [0, 1) (a sharper sampler gathers it near 0, a flatter one near 1); -1.0 where the declared
    decoding gives the token no chance (or it is not among the tokens read)."""
    import numpy as np

    if token is None or lp[token] == -np.inf:
        return -1.0
    before = (lp > lp[token]) | ((lp == lp[token]) & (np.arange(len(lp)) < token))
    v = float(stream(key, step, UNIFORM).random())
    return float(np.exp(lp[before]).sum() + v * np.exp(lp[token]))


NOISE, UNIFORM = 0, 1  # the counter's top word: a step's Gumbel noise, or the transform's uniform


def stream(key: tuple[int, int], step: int, lane: int) -> "np.random.Generator":
    """One step's own random stream under ``key``: Philox from counter (0, 0, step, lane). The generator counts its
    blocks in the counter's low words (the first, carrying into the second), which never reach the step's word or the
    lane's, so no two steps and no two lanes share a block. (Keyed at counter (step, 0, 0, 0), as before, step s + 1's
    stream was step s's one block, four token ids, on: consecutive draws correlated.)"""
    import numpy as np

    counter = np.array([0, 0, step, lane], dtype=np.uint64)
    return np.random.Generator(np.random.Philox(key=np.array(key, dtype=np.uint64), counter=counter))


def log_softmax(x: "np.ndarray") -> "np.ndarray":
    import numpy as np

    top = np.max(x)
    return x - top - np.log(np.sum(np.exp(x - top)))


def reread(decoding: "Decoding", key: tuple[int, int], spec: SamplerChain | None, rows: "np.ndarray",
           prompt: Sequence[int], answer: Sequence[int]) -> list[float | None]:
    """Each token of a sampled ``answer`` transformed under the declared decoding applied (through ``spec``'s chain)
    to a reference's full rows, one per answer position: what a side that gives no full rows drew, read from another
    computation of the same model. None where the token falls outside the declared support too narrowly for another
    arithmetic to tell (within ``EDGE`` of its boundary, or anywhere a penalty reorders it)."""
    import numpy as np

    sampler, out = Sampler(decoding, key, spec), []
    penalised = decoding.repetition_penalty != 1.0 or decoding.presence_penalty or decoding.frequency_penalty
    for j, (row, token) in enumerate(zip(rows, answer)):
        lp = sampler.processed(row, prompt, answer[:j])
        u = transform(lp, int(token), key, j)
        if u < 0:
            kept = np.isfinite(lp)
            clear = not penalised and kept.any() and row[int(token)] < np.min(row[kept]) - EDGE
            out.append(u if clear else None)
        else:
            out.append(u)
    return out


def untouched(d: "Decoding") -> bool:
    """Whether the declared decoding draws from the model's own distribution (temperature 1, no filter, no penalty):
    then a server's raw log-probability of a token is the probability the draw gave it."""
    return (d.temperature == 1.0 and d.top_k == 0 and d.top_p == 1.0 and d.min_p == 0.0 and d.repetition_penalty == 1.0
            and not d.presence_penalty and not d.frequency_penalty)


def served(decoding: "Decoding", key: tuple[int, int], spec: SamplerChain, tokens: Sequence[int],
           tops: Sequence[dict[int, float]]) -> list[list[float]] | str:
    """What each draw of a served answer weighed (``Sampler.pick``'s row, the transform included), read from the top
    raw log-probabilities the server returned per step through its own chain (``spec``); or why they cannot be
    read exactly: only where a declared top-k keeps no more tokens than the server lists and no penalty moves a
    token into the list from outside (a log-probability hides the sign a repetition penalty reads)."""
    import numpy as np

    d = decoding
    k = min((len(t) for t in tops), default=0)
    if not 0 < d.top_k <= k:
        return f"top_k {d.top_k} is not within the {k} log-probabilities the server lists per step"
    if d.repetition_penalty != 1.0 or d.presence_penalty or d.frequency_penalty:
        return "a penalty can move a token the server does not list into the top-k"
    rows = []
    for j, (token, top) in enumerate(zip(tokens, tops)):
        ids = sorted(top)
        x = np.array([top[i] for i in ids], dtype=np.float64)
        lp = Sampler(d, key, spec).processed(x, [], [])
        at = ids.index(token) if token in top else None
        u = transform(lp, at, key, j)
        raw = top.get(token, float(np.min(x)))  # outside the list: at most its least
        rows.append([raw, float(lp[at]) if u >= 0 and at is not None else raw, float(np.max(lp)), u])
    return rows
