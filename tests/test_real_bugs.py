"""Real upstream cache bugs through gatekeeper's own commands (``bench/real_bugs/``): the last affected release is
never a PASS, the first fixed one PASSes. Each runs its runtime in an environment ``gatekeeper runtime prepare``
makes once (``$GATEKEEPER_HOME/runtimes/``) and a tiny model made once from the entry's config."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import real_bugs  # noqa: E402

from gatekeeper.workspace import PROBES  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("bug, refused", [
    # the static sliding-window cache rolls early: the answers that cross the window part from the dynamic cache's
    ("transformers-37574", "differs: "),
    # the draft's sliding-window layer crashes assisted generate: a crash on the flag-on side
    ("transformers-48280", "crashed: "),
])
def test_the_affected_release_is_never_passed_and_the_fixed_one_is(bug, refused):
    # the cases alone, each call's answer compared (the probes and the teacher-forced distance are tested elsewhere)
    entry = real_bugs.variant(real_bugs.entries([bug])[0], without=list(PROBES), extra="distance: false\n")
    rows = {side: real_bugs.run(entry, side, limit=1) for side in ("affected", "fixed")}
    assert rows["affected"]["verdict"] == "FAIL" and rows["affected"]["reason"].startswith(refused), rows
    assert rows["fixed"]["verdict"] == "PASS", rows
    assert real_bugs.judged(entry, rows)


def test_a_defect_both_arms_share_is_a_base_defect_on_the_affected_release_and_the_fixed_one_passes():
    """The pipeline already on the broken sliding-window class, the flag prefix caching: both arms run the broken class
    and agree, so only the reference arm (a cache-free read of each arm's answers) can see it."""
    entry = real_bugs.variant(real_bugs.entries(["transformers-37574-base"])[0], without=list(PROBES),
                              extra="distance: false\n")
    rows = {side: real_bugs.run(entry, side, limit=1) for side in ("affected", "fixed")}
    assert rows["affected"]["verdict"] == "INCONCLUSIVE", rows
    assert rows["affected"]["reason"].startswith("base_defect: both arms depart from a cache-free read"), rows
    assert "cache_implementation: sliding_window" in rows["affected"]["reason"], rows
    assert rows["fixed"]["verdict"] == "PASS", rows
