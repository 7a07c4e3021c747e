"""Plugin engines with planted faults, loaded by profiles as ``fault_engines:Class``.

Each is the real torch adapter with one thing broken, so the gate is shown to say no.
"""

import threading
import time
from dataclasses import replace

from gatekeeper.engines.torch import TorchEngine


class ShortRestore(TorchEngine):
    """A cache that restores one position short and pads with the token before it: the state has
    the right length, so nothing downstream notices, but its last restored position is shifted."""

    def _begin(self, prompt):
        state, cached = super()._begin(prompt)
        if cached > 1:
            state = self.state_ops.fork(state, cached - 1)
            self._forward(state, [prompt[cached - 2]])
        return state, cached


class NeverServes(TorchEngine):
    """A cache that never serves a token: every call prefills from scratch."""

    def _begin(self, prompt):
        return self._new_state(), 0


class Unstable(TorchEngine):
    """An engine that answers a prompt differently the second time it sees it with the cache off."""

    def generate(self, prompt, **kwargs):
        g = super().generate(prompt, **kwargs)
        seen = self.__dict__.setdefault("_seen", set())
        key = tuple(prompt)
        if not self.cache_enabled and key in seen:
            tokens = [*g.tokens[:-1], (g.tokens[-1] + 1) % 256]
            g = replace(g, tokens=tokens, text=self.detokenize(tokens))
        seen.add(key)
        return g


class HalfServes(TorchEngine):
    """An honest cache that serves only half of each hit (outputs stay right, savings do not)."""

    def _begin(self, prompt):
        state, cached = super()._begin(prompt)
        if cached > 1:
            return self.state_ops.fork(state, cached // 2), cached // 2
        return state, cached


class Threaded(TorchEngine):
    """Declares a concurrency of 3, as a served engine would, so the gate runs cases side by side.

    A lock keeps the local model and its cache consistent; ``peak`` counts callers in flight.
    """

    concurrency = 3
    lock = threading.Lock()
    active = peak = 0

    def generate(self, prompt, **kwargs):
        cls = type(self)
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


_model_lock = threading.Lock()
