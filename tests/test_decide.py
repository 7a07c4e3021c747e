"""The decision as an ordered list of judges (issue #62): the fold's precedence, and the table in docs/verdicts.md
that states it, held to ``JUDGES``. The judges themselves are tested where their evidence is (test_statistics_*,
test_probes, test_gate, the engine and sampled tests): this is the order they are heard in."""

from __future__ import annotations

import re
from pathlib import Path

from gatekeeper.evidence import UNDECIDED, Ruling
from gatekeeper.gate.decide import JUDGES, decide

ROOT = Path(__file__).resolve().parent.parent


def judges(*rulings: Ruling):
    return [lambda c, verdict, r=r: r for r in rulings]


def test_among_the_judges_of_no_verdict_yet_the_first_that_rules_wins():
    verdict, reasons = decide(None, judges(Ruling(), Ruling("INCONCLUSIVE", ["baseline_unstable: x"], over=UNDECIDED),
                                           Ruling("PASS", ["equal: y"], over=UNDECIDED)))
    assert (verdict, reasons) == ("INCONCLUSIVE", ["baseline_unstable: x", "equal: y"])


def test_a_ruling_leads_where_it_overrules_and_follows_where_it_does_not():
    short = Ruling("INCONCLUSIVE", ["control_missed: z"], ["controls: line"], over=("PASS",))
    assert decide(None, judges(Ruling("PASS", ["equal"], over=UNDECIDED), short)) == (
        "INCONCLUSIVE", ["control_missed: z", "equal", "controls: line"])
    assert decide(None, judges(Ruling("FAIL", ["inferior"], over=UNDECIDED), short)) == (
        "FAIL", ["inferior", "control_missed: z", "controls: line"])
    void = Ruling("INCONCLUSIVE", ["base_defect: b"])  # over any verdict: a broken base voids a FAIL too
    assert decide(None, judges(Ruling("FAIL", ["inferior"], over=UNDECIDED), void))[0] == "INCONCLUSIVE"


def test_the_docs_table_names_every_judge_in_the_order_they_are_heard():
    text = (ROOT / "docs" / "verdicts.md").read_text()
    rows = re.findall(r"^\| (\d+) \| `(\w+)` \|", text, re.M)
    assert [int(n) for n, _ in rows] == list(range(1, len(rows) + 1))
    assert [name for _, name in rows] == [j.__name__ for j in JUDGES]
