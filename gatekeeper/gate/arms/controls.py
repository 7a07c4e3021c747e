"""Controls in every sampled evaluation: the gate is shown to say no where it says yes.

At the end of the flag-on run, on its session (its cache as the cases left it), the first sampled case's first turn
is drawn twice more and set against the flag-off answer drawn under the case's key:

- ``unpaired``: under a fresh key, no seed shared. It must part from that answer wherever the declared decoding gives
  an independent draw less than ``alpha`` chance to repeat it (the product of its tokens' declared probabilities);
  identical, the engine's draws do not follow their keys, and agreement under shared keys shows nothing.
- ``planted``: under the case's key with the temperature doubled, a sampler defect. The coupling must see it: tokens
  that part, or the same raw log-probability weighed otherwise (``coupling.PROCESSED``) where the side records what
  its draws weighed.

Each is ``seen``, ``missed`` or ``undecided`` (a decoding too peaked to tell: for ``planted``, a nucleus of one token
at every step at both temperatures, where no temperature changes what is drawn or how it is weighed; or a server
that records no weights and whose tokens happened to agree). A missed control turns a PASS into INCONCLUSIVE
(``control_missed:``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ...battery import partition
from ...engines import sampler
from ...engines.base import Session, labelled
from ...evidence import Ruling, Run
from ...summaries import ControlsSummary
from ..run import runs
from ..run.plans import Plan
from ..stats.coupling import PROCESSED


@dataclass
class Controls:
    case: str
    unpaired: str  # seen | missed | undecided
    planted: str
    chance: float  # the chance an independent draw gives the flag-off answer's tokens

    def line(self) -> str:
        return (f"controls: on {self.case}, a draw with no shared seed {self._said(self.unpaired)} (chance of agreeing "
                f"at most {self.chance:.2g}); the temperature doubled under the shared seed {self._said(self.planted)}")

    @staticmethod
    def _said(outcome: str) -> str:
        return {"seen": "parted, as it must", "missed": "did NOT part",
                "undecided": "could not tell"}[outcome]

    def judge(self) -> Ruling:
        """A control that missed makes a PASS INCONCLUSIVE (agreement proves nothing), and is said beside any other."""
        if "missed" not in (self.unpaired, self.planted):
            return Ruling(notes=[self.line()])
        return Ruling("INCONCLUSIVE", [f"control_missed: {self.line().removeprefix('controls: ')}: the pairing cannot "
                                       "show a sampled change on this engine, so agreement proves nothing; check that it "
                                       "honours per-request seeds and records its draws"], over=("PASS",))

    def to_dict(self) -> ControlsSummary:
        return ControlsSummary(case=self.case, unpaired=self.unpaired, planted=self.planted, chance=self.chance)


def run(session: Session, p: Plan, mode: partition.Mode) -> dict[str, Any] | None:
    """The two control draws on the flag-on ``session`` (after its cases); None where no suite samples."""
    item = next((i for i in p.items if not i.suite.decoding.plain and i.sample == 0), None)
    if item is None:
        return None
    d = item.suite.decoding
    values = {**item.case.vars, **(item.case.turns[0] if item.case.turns else {})}
    prompt = partition.render(session.model, partition.pieces(p.ws, item.suite, values), mode).tokens
    hotter = d.model_copy(update={"temperature": min(2 * d.temperature, 100.0)})
    out: dict[str, Any] = {"case": item.case_id}
    keyed = runs.draw(item, 0)
    assert keyed is not None  # a sampled item
    for name, draw in (("unpaired", sampler.Draw(d, sampler.fresh())), ("planted", sampler.Draw(hotter, keyed.key))):
        with labelled(stage=item.suite.stage, stream="gatekeeper-controls"):
            out[name] = session.generate(prompt, max_tokens=d.max_tokens, stop=list(d.stop), top2=True,
                                         sampling=draw).to_dict()
    return out


def judge(drawn: dict[str, Any] | None, off: Run, alpha: float) -> Controls | None:
    """What the two control draws show against the flag-off answer of their case; None where none ran."""
    if drawn is None or (answer := off.get(drawn["case"])) is None or "crash" in answer:
        return None
    ref = answer["turns"][0]
    chance = math.exp(sum(w[1] for w in ref["draws"])) if ref.get("draws") else 1.0  # one draw giving those tokens
    same = drawn["unpaired"]["tokens"] == ref["tokens"]
    unpaired = "seen" if not same else "missed" if chance < alpha else "undecided"
    return Controls(drawn["case"], unpaired, _planted(drawn["planted"], ref), chance)


def _planted(g: dict[str, Any], ref: Any) -> str:
    """``seen`` where the planted draw parts or weighs a token otherwise; ``missed`` only where it had a chance to:
    a step where either draw gave its token less than all the processed mass. A nucleus of one token at both
    temperatures (processed log-probability 0 on both sides at every step) leaves nothing a temperature can
    change, so the control is ``undecided`` there, as with no weights recorded."""
    if g["tokens"] != ref["tokens"]:
        return "seen"
    pairs = list(zip(g.get("draws") or [], ref.get("draws") or []))
    if any(a[0] == b[0] and abs(a[1] - b[1]) > PROCESSED for a, b in pairs):
        return "seen"
    chance = any(min(a[1], b[1]) < -PROCESSED for a, b in pairs)
    return "missed" if chance else "undecided"
