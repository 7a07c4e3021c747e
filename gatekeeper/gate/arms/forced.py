"""How far the flag moved the model, teacher-forced (``gate/stats/distance.py``): after the battery, a fresh session
of each configuration reads every case's flag-off conversation (off#0's answers) in one pass per turn, and the
flag-on side's next-token distributions are compared with the flag-off side's at every position of those
answers. A second flag-off session gives the A/A floor: what the engine's own nondeterminism moves.

It costs one prefill per turn and side, no decoding (a server with no prompt log-probabilities: three forced
requests per turn and side, ``engines/served/http.py``). Where an engine gives no distributions (llama-cpp-python's
server) nothing is measured and the record says ``not_observable``, as it does where the two
sides read different vocabularies or tokenizers.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

from ...engines.base import Engine
from ...evidence import Run
from ..run import runs
from ..run.plans import Plan
from ..stats import distance

# Text both sides must tokenize alike for the flag-off answers' token ids to mean the same to the flag-on model
SAMPLE = "The quick brown fox, 0123456789 times: jumps over the lazy dog!\n\t{\"k\": [1.5]} ¿Qué? Straße 東京 🙂"


def measure(p: Plan, models: dict[str, Engine], reference: Run, progress: Callable[[str], None]) -> distance.Compared | str:
    """The distance and its A/A floor over every case that did not crash; or why it cannot be measured."""
    if models["off"].tokenize(SAMPLE) != models["on"].tokenize(SAMPLE):  # a migration to another model family
        return (f"the two sides tokenize text differently ({models['off'].name} and {models['on'].name}), so the "
                "flag-off answers' token ids mean other text to the flag-on model")
    sides: list[tuple[str, Any]] = [("off", p.configs["off"]), ("off", p.configs["off"]), ("on", p.configs["on"])]
    pooled: dict[str, list[distance.PerPosition]] = {"distance": [], "floor": []}
    with contextlib.ExitStack() as stack:
        sessions = [stack.enter_context(models[name].session(cache=c.cache)) for name, c in sides]
        for session, (_, c) in zip(sessions, sides):
            runs.pin_stage_prefixes(session, p, c.render)  # as in the runs: a cache hit reads what a run reads
        for item in p.items:
            ref = reference[item.case_id]
            if "crash" in ref:
                continue
            progress(f"distance {item.case_id}")
            a, a2, b = (runs.forced(s, p.ws, item, c.render, ref) for s, (_, c) in zip(sessions, sides))
            if a is None or a2 is None or b is None:
                which = "flag-off" if a is None else "flag-on"
                return (f"the {which} engine ({models['off' if a is None else 'on'].name}) gives no next-token "
                        "distributions to read teacher-forced")
            try:
                pooled["distance"].append(distance.positions(a, b))
                pooled["floor"].append(distance.positions(a, a2))
            except ValueError as e:  # rows of different widths: the sides read different vocabularies
                return f"the two sides' distributions cannot be compared position by position ({e})"
    caveat = "; ".join(dict.fromkeys(m.score_caveat for m in models.values() if m.score_caveat)) or None
    return distance.Compared(_pool(pooled["distance"]).summary(), _pool(pooled["floor"]).summary(), caveat=caveat)


def _pool(parts: list[distance.PerPosition]) -> distance.PerPosition:
    import numpy as np

    cols = {k: np.concatenate([getattr(x, k) for x in parts]) if parts else np.zeros(0)
            for k in ("kld", "same", "delta_p", "nll_a", "nll_b")}
    ks = [x.k for x in parts if x.k is not None]
    tv = np.concatenate([x.tv for x in parts]) if parts and all(x.tv is not None for x in parts) else None
    return distance.PerPosition(**cols, k=min(ks) if ks else None, tv=tv)
