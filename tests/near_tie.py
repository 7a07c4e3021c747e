"""A flag-on side whose logits move by a known construction, not by one CPU's rounding.

``NoisyHit`` is the real torch adapter whose cache-on sessions restore every hit with the package's
own planted fault (``gatekeeper/engines/faults.py``: relative Gaussian noise of size ``noise``,
seeded by ``seed``), loaded by a profile as ``adapter: near_tie:NoisyHit`` with
``options: {noise: S, seed: K}``. Under the aligned plan in float32 the flag-off and flag-on runs
are otherwise bit-exact, so every drift is the fault's, and its size is fixed by the seeded noise,
the same on every CPU to float32 rounding (orders of magnitude below the margins the tests rely on):
a small ``noise`` moves the logits without flipping a token, a larger one flips a near-tie.
The cache-off session takes no hit, so the fault never touches the baseline.
"""

from __future__ import annotations

from gatekeeper.engines.faults import Fault
from gatekeeper.engines.greedy import FaultSession
from gatekeeper.engines.torch import TorchEngine


def noisy_hit_profile(model, *, noise: float, seed: int = 0, dtype: str = "float32", chunk: int = 256) -> str:
    return (f"adapter: near_tie:NoisyHit\nmodel: {model}\ndtype: {dtype}\ndevice: cpu\nprefill: aligned\nchunk: {chunk}\n"
            f"options: {{noise: {noise!r}, seed: {seed}}}\n")


class NoisyHitSession(FaultSession):
    def __init__(self, model, *, cache=False, results=None):
        opts = model.profile.options
        super().__init__(model, cache=cache, fault=Fault("noise", float(opts["noise"]), int(opts.get("seed", 0))),
                         results=results)


class NoisyHit(TorchEngine):
    options = {**TorchEngine.options,
               "noise": "relative size of the noise planted on every restored state",
               "seed": "seed of that noise (default 0)"}
    session_class = NoisyHitSession
