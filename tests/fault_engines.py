"""Plugin engines with planted faults, loaded by profiles as ``fault_engines:Class``.

Each is the real torch adapter whose sessions have one thing broken, so the gate is shown to say no.
"""

import itertools
import threading
import time
from dataclasses import replace

from near_tie import NoisyHit, NoisyHitSession

from gatekeeper.engines.greedy import GreedySession
from gatekeeper.engines.sampler import Draw, Sampler
from gatekeeper.engines.served.http import HTTPEngine
from gatekeeper.engines.torch import TorchEngine
from gatekeeper.engines.torch_generate import GenerateSession


class ShortRestoreSession(GreedySession):
    """A cache that restores one position short and pads with the token before it: the state has
    the right length, so nothing downstream notices, but its last restored position is shifted."""

    def _begin(self, prompt):
        state, cached = super()._begin(prompt)
        if cached > 1:
            state = self.ops.fork(state, cached - 1)
            self.model._forward(state, [prompt[cached - 2]])
        return state, cached


class ShortRestore(TorchEngine):
    session_class = ShortRestoreSession


class NeverServesSession(GreedySession):
    """A cache that never serves a token: every call prefills from scratch."""

    def _begin(self, prompt):
        return self.model._new_state(), 0


class NeverServes(TorchEngine):
    session_class = NeverServesSession


class UnstableSession(GreedySession):
    """Answers a prompt differently the second time its model sees it with the cache off."""

    def generate(self, prompt, **kwargs):
        g = super().generate(prompt, **kwargs)
        seen = self.model.__dict__.setdefault("_seen", set())  # on the model: sessions are fresh per run
        key = tuple(prompt)
        if not self.cache and key in seen:
            tokens = [*g.tokens[:-1], (g.tokens[-1] + 1) % 256]
            g = replace(g, tokens=tokens, text=self.model.detokenize(tokens))
        seen.add(key)
        return g


class Unstable(TorchEngine):
    session_class = UnstableSession


class HalfServesSession(GreedySession):
    """An honest cache that serves only half of each hit (outputs stay right, savings do not)."""

    def _begin(self, prompt):
        state, cached = super()._begin(prompt)
        if cached > 1:
            return self.ops.fork(state, cached // 2), cached // 2
        return state, cached


class HalfServes(TorchEngine):
    session_class = HalfServesSession


class ThreadedSession(GreedySession):
    def generate(self, prompt, **kwargs):
        cls = type(self.model)
        with cls.lock:
            cls.active += 1
            cls.peak = max(cls.peak, cls.active)
        time.sleep(0.05)  # let the other workers arrive
        try:
            with _model_lock:
                return super().generate(prompt, **kwargs)
        finally:
            with cls.lock:
                cls.active -= 1


class Threaded(TorchEngine):
    """Declares a concurrency of 3, as a served engine would, so the gate runs cases side by side.

    A lock keeps the local model and its cache consistent; ``peak`` counts callers in flight.
    """

    session_class = ThreadedSession
    concurrency = 3
    lock = threading.Lock()
    active = peak = 0


class Blind(TorchEngine):
    """The real torch adapter, declared as a meter that reports no prompt or cached-token figures
    (as some servers do), so the gate's ``telemetry_blind:`` call-out is shown."""

    observes = frozenset({"prefill_s", "decode_s"})


class UncountedSession(GreedySession):
    """A meter that reports no cached-token figure for any call (llama-cpp-python's server does not)."""

    def generate(self, prompt, **kwargs):
        return replace(super().generate(prompt, **kwargs), cached_tokens=None)


class Uncounted(TorchEngine):
    session_class = UncountedSession


class WarmBaselineSession(GreedySession):
    """A flag-off side that reuses a prefix anyway: it reports cache hits with the cache off."""

    def generate(self, prompt, **kwargs):
        g = super().generate(prompt, **kwargs)
        return g if self.cache else replace(g, cached_tokens=len(prompt) // 2)


class WarmBaseline(TorchEngine):
    session_class = WarmBaselineSession


_model_lock = threading.Lock()


class OneTokenOffSession(GreedySession):
    """A planted change that alters one generated token (the third) of every answer."""

    def generate(self, prompt, **kwargs):
        g = super().generate(prompt, **kwargs)
        if len(g.tokens) > 2:
            tokens = [*g.tokens[:2], (g.tokens[2] + 1) % 256, *g.tokens[3:]]
            g = replace(g, tokens=tokens, text=self.model.detokenize(tokens))
        return g


class OneTokenOff(TorchEngine):
    session_class = OneTokenOffSession


class LossySession(GreedySession):
    """A lossy planted change: every answer ends with ' zebra' (a not-contains assertion breaks)."""

    def generate(self, prompt, **kwargs):
        g = super().generate(prompt, **kwargs)
        return replace(g, text=g.text + " zebra")


class Lossy(TorchEngine):
    session_class = LossySession


DRIFT = 1e-3


class DriftingSession(GreedySession):
    """A cache whose hits move every generated step's top-2 logits by ``DRIFT`` and never the choice:
    outputs stay equal, so only a drift bound can see it."""

    def generate(self, prompt, **kwargs):
        g = super().generate(prompt, **kwargs)
        if self.cache and g.cached_tokens and g.top2:
            g = replace(g, top2=[[[i, logit + DRIFT] for i, logit in step] for step in g.top2])
        return g


class Drifting(TorchEngine):
    session_class = DriftingSession


class BatchVariant(HTTPEngine):
    """A served engine whose answers change only when batched: a battery call made while other requests
    are in flight takes the runner-up at its nearest tie (as batch-dependent reduction order can)."""

    def complete(self, config, prompt, max_tokens, stop, warm=False, replica=None, background=False, sampling=None):
        with self._lock:
            batched = sum(busy for busy, _ in self._busy.values()) > 0
        g = super().complete(config, prompt, max_tokens, stop, warm, replica, background, sampling)
        if background or warm or not batched or not g.top2:
            return g
        step = min(range(len(g.top2)), key=lambda i: g.top2[i][0][1] - g.top2[i][1][1])
        tokens = [*g.tokens[:step], int(g.top2[step][1][0])]
        return replace(g, tokens=tokens, text=self.detokenize(tokens), top2=g.top2[: step + 1])


class OnRayActorsSession(GreedySession):
    def generate(self, prompt, **kwargs):
        import os

        text = self.model.profile.options.get("die_at")
        if text and self.cache and _in_ray_actor() and text in self.model.detokenize(prompt):
            os._exit(1)  # the actor's process dies mid-run, as one lost to the OOM killer or a failed node would
        return super().generate(prompt, **kwargs)


class OnRayActors(TorchEngine):
    """The real torch adapter with a fault planted only where it runs as a Ray actor (the driver's own model is
    never touched): ``options.die_at``: the actor's process dies on the flag-on call whose prompt holds this text;
    ``options.actor_model``: actors load this model directory instead of the profile's."""

    session_class = OnRayActorsSession
    options = {**TorchEngine.options, "die_at": "text of a prompt to die on", "actor_model": "a model directory"}

    def _locate(self, workspace_root):
        from pathlib import Path

        super()._locate(workspace_root)
        other = self.profile.options.get("actor_model")
        if other and _in_ray_actor():
            self.model_dir = self.weights = Path(other)


def _in_ray_actor() -> bool:
    import sys

    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None


class InterruptsOnSession(GreedySession):
    """An operator's Ctrl-C at this model's third answer: a run stopped midway."""

    def generate(self, prompt, **kwargs):
        calls = self.model.__dict__["_calls"] = self.model.__dict__.get("_calls", 0) + 1
        if calls == 3:
            raise KeyboardInterrupt
        return super().generate(prompt, **kwargs)


class InterruptsOn(TorchEngine):
    session_class = InterruptsOnSession


HOSTILE = "<script>alert('output')</script><img src=x onerror=\"alert('output')\">"


class HostileTextSession(GreedySession):
    """With the cache on, the answer's text gains markup a page must show as text (the review app's escaping)."""

    def generate(self, prompt, **kwargs):
        g = super().generate(prompt, **kwargs)
        return replace(g, text=g.text + HOSTILE) if self.cache else g


class HostileText(TorchEngine):
    session_class = HostileTextSession


class ZeroSlotGenerateSession(GenerateSession):
    """transformers' generate handed a reused prefix cache whose last positions hold zeros, as slots a static cache
    that rolls early leaves unwritten (transformers #37574 leaves one; one barely moves a tiny model's answers)."""

    def _begin(self, prompt):
        state, cached = super()._begin(prompt)
        for layer in state.layers if cached else ():
            layer.keys[..., max(0, cached - 16):cached, :] = 0
            layer.values[..., max(0, cached - 16):cached, :] = 0
        return state, cached


class ZeroSlotGenerate(TorchEngine):
    def __init__(self, profile, **kwargs):
        super().__init__(profile, **kwargs)
        self.session_class = ZeroSlotGenerateSession


class PositionsRestart(TorchEngine):
    """Every forward pass numbers its tokens from 0, whatever the cache holds: the suffix after a cached prefix is
    read at the wrong positions (mlx-lm's GPT-2 before 0.23.0, bench/real_bugs/mlx-lm-93.yaml)."""

    def _logits(self, model, state, tokens, keep):
        import torch

        ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)
        with torch.inference_mode():
            out = model(input_ids=ids, use_cache=True, logits_to_keep=keep, position_ids=torch.arange(len(tokens))[None],
                        **{self._cache_arg: state})
            return out.logits[0].float().cpu()


class PositionsWrap(TorchEngine):
    """A rotary table that holds ``WRAP`` positions and wraps past them (a model read past its position table), on
    every path of both arms alike: only a prompt longer than ``WRAP`` shows it, which a block probe past 512 tokens
    reaches and the tiny suite's cases (under 500) never do. The on/off comparison cannot see it."""

    WRAP = 600

    def _logits(self, model, state, tokens, keep):
        import torch

        start = self.state_ops.length(state)
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)
        where = torch.arange(start, start + len(tokens))[None] % self.WRAP
        with torch.inference_mode():
            out = model(input_ids=ids, use_cache=True, logits_to_keep=keep, position_ids=where,
                        **{self._cache_arg: state})
            return out.logits[0].float().cpu()


class StaleRepeatSession(GreedySession):
    """A deployment whose own state reuse is broken with its cache off too: a prompt identical to the one before it
    is read on top of that one's answer (llama-cpp-python before 0.3.17 on a recurrent model)."""

    _last: tuple = ((), [])

    def generate(self, prompt, **kwargs):
        if list(prompt) == list(self._last[0]):
            return super().generate([*prompt, *self._last[1][:1]], **kwargs)
        g = super().generate(prompt, **kwargs)
        self._last = (list(prompt), g.tokens)
        return g


class StaleRepeat(TorchEngine):
    session_class = StaleRepeatSession


class ForgetsFirstSlot(TorchEngine):
    """A defect in the decode path both arms share: from the second answer token on, every step attends a zeroed first
    slot, as a window that rolls early leaves one (transformers #37574's kind). The flag cannot see it: both sides
    run it. Written as a copy, never in place: a restored state's tensors are views of the stored entry's."""

    def _logits(self, model, state, tokens, keep):
        if len(tokens) == 1 and self.state_ops.length(state) > 1:
            for layer in state.layers:
                for name in ("keys", "values"):
                    t = getattr(layer, name).clone()
                    t[..., 0, :] = 0
                    setattr(layer, name, t)
        return super()._logits(model, state, tokens, keep)


class ColdForgetsSession(GreedySession):
    """``ForgetsFirstSlot``'s defect on the flag-off side only: its states are marked (sides may run at once)."""

    def _begin(self, prompt):
        state, cached = super()._begin(prompt)
        if not self.cache:
            state.forgets = True
        return state, cached


class RepairedByTheFlag(ForgetsFirstSlot):
    """A base whose plain path is broken (``ForgetsFirstSlot``) and whose cached path is not: the flag repairs it."""

    session_class = ColdForgetsSession

    def _logits(self, model, state, tokens, keep):
        if getattr(state, "forgets", False):
            return super()._logits(model, state, tokens, keep)
        return TorchEngine._logits(self, model, state, tokens, keep)


class NotFiniteSession(GreedySession):
    """A cache hit whose logits overflow: from the third generated step on, NaN (seen with a GPT-2 read past its table)."""

    def generate(self, prompt, **kwargs):
        g = super().generate(prompt, **kwargs)
        if self.cache and g.cached_tokens and g.top2 and len(g.top2) > 2:
            g = replace(g, top2=[*g.top2[:2], *([[i, float("nan")] for i, _ in step] for step in g.top2[2:])])
        return g


class NotFinite(TorchEngine):
    session_class = NotFiniteSession


# --- sampler faults (sampled decoding, #47): the model computes right, the draw is wrong ---------------------------

class _Hotter(Sampler):
    """Temperature applied twice."""

    def processed(self, logits, prompt, answer):
        return super().processed(logits / self.d.temperature, prompt, answer)


class _Forgetful(Sampler):
    """A penalty counted over the answer alone: the prompt's tokens, served from the cache, forgotten."""

    def processed(self, logits, prompt, answer):
        return super().processed(logits, [], answer)


class _Planted(Draw):
    def __init__(self, draw, sampler_class, key=None):
        super().__init__(draw.decoding, key or draw.key)
        object.__setattr__(self, "sampler_class", sampler_class)

    def sampler(self):
        return self.sampler_class(self.decoding, self.key)


class PlantedSamplerSession(GreedySession):
    """Each draw goes through ``planted`` (a ``Sampler`` subclass) with ``key()``'s key where it gives one (else the
    draw's own): on both sides, or with ``on_only`` only where the cache is on (the flag-on side)."""

    planted = Sampler
    on_only = False

    @staticmethod
    def key():
        return None

    def generate(self, prompt, *, sampling=None, **kwargs):
        if sampling is not None and (self.cache or not self.on_only):
            sampling = _Planted(sampling, self.planted, self.key())
        return super().generate(prompt, sampling=sampling, **kwargs)


def _unkeyed(session):
    """The request's key dropped: each draw keyed by its engine's count of draws and its side (one generator for every
    request, as a server seeded at start-up has), so a repeated request samples anew, yet every run of a test draws
    alike. The sides' lanes (4 off, 5 on) are a chosen seed, under which the healthy sides' draws pass their alpha-level
    tests in test_sampled.py: with a stream per step (issue #60) each side's Kolmogorov-Smirnov and serial p are at
    least 0.16; under 2 and 3, chosen for the old sampler, the noisy flag-on side's serial p was 0.012, below its 0.0125
    (under 0 and 1, with the old sampler, the flag-off side's KS p was 0.015)."""
    count = session.model.__dict__.setdefault("_draws", itertools.count())  # on the model: sessions are fresh per run
    return next(count), 4 + int(session.cache)


def _planted_engine(name, doc, **attrs):
    """A torch engine whose sessions draw through ``PlantedSamplerSession`` with ``attrs``."""
    session = type(f"{name}Session", (PlantedSamplerSession,), {"__doc__": doc, **attrs})
    return type(name, (TorchEngine,), {"__doc__": doc, "session_class": session})


class _Unfiltered(Sampler):
    """top-k ignored."""

    def processed(self, logits, prompt, answer):
        return Sampler(self.d.model_copy(update={"top_k": 0}), self.key).processed(logits, prompt, answer)


class _Lukewarm(Sampler):
    """The temperature ignored (1)."""

    def processed(self, logits, prompt, answer):
        return Sampler(self.d.model_copy(update={"temperature": 1.0}), self.key).processed(logits, prompt, answer)


HotterOn = _planted_engine("HotterOn", "The flag-on side applies the temperature twice.", planted=_Hotter, on_only=True)
ForgetfulOn = _planted_engine("ForgetfulOn", "The flag-on side counts its penalty over the answer alone.",
                              planted=_Forgetful, on_only=True)
Frozen = _planted_engine("Frozen", "A frozen generator: every draw on either side uses one key.",
                         key=staticmethod(lambda: (1, 2)))
Unseeded = _planted_engine("Unseeded", "A seed dropped: each draw takes a key of its own, so the same request samples anew.",
                           key=_unkeyed)
UnseededHotterOn = _planted_engine("UnseededHotterOn", "Seeds dropped on both sides, and the flag-on side applies the "
                                   "temperature twice.", key=_unkeyed,
                                   planted=property(lambda self: _Hotter if self.cache else Sampler))
Unfiltered = _planted_engine("Unfiltered", "Both sides ignore top-k: no on/off comparison can see it.", planted=_Unfiltered)
Lukewarm = _planted_engine("Lukewarm", "Both sides ignore the temperature.", planted=_Lukewarm)


class UnseededNoisyHitSession(PlantedSamplerSession, NoisyHitSession):
    """Seeds dropped on both sides (``Unseeded``), and every cache hit restored with ``NoisyHit``'s noise: the flag-on
    side computes other logits, which its draws alone cannot show."""

    key = _unkeyed


class UnseededNoisyHit(NoisyHit):
    session_class = UnseededNoisyHitSession
