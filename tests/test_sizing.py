"""``gatekeeper battery size``: the cases a policy's margin needs at its alpha and power, from an evaluation's
discordance or, before any, from the battery as it is; and the margin the battery supports now."""

import gzip
import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gatekeeper.cli import app

DATA = Path(__file__).parent / "data" / "old_ledger"
HALF = "flag: half_precision\ngate: non_inferiority\nmargin: 0.05\nchange: {profile: {dtype: bfloat16}}\n"


@pytest.fixture
def ws(tmp_path):
    """A workspace whose ledger holds evaluation 3 of half_precision: 4 assertion pairs, no flips."""
    from gatekeeper.setup.scaffold import init_workspace

    ws = tmp_path / "ws"
    init_workspace(ws)
    (ws / "ledger" / "evidence.db").write_bytes(gzip.decompress((DATA / "ledger" / "evidence.db.gz").read_bytes()))
    shutil.copy(DATA / "ledger" / "checkpoints.jsonl", ws / "ledger")
    (ws / "policies" / "half_precision.yaml").write_text(HALF)
    return ws


def size(ws, *args):
    result = CliRunner().invoke(app, ["--workspace", str(ws), "battery", "size", *map(str, args), "--json"])
    return result.exit_code, json.loads(result.stdout)


def test_the_cases_a_margin_needs_from_the_last_evaluation(ws):
    code, out = size(ws, "--flag", "half_precision")
    assert code == 0 and out["evaluation_id"] == 3 and (out["pairs"], out["cases"], out["discordance"]) == (4, 4, 0.0)
    # sized for the change's next look: its first (evaluation 3 compared exactly and spent nothing), at alpha/2
    assert (out["look"], out["policy_alpha"], out["alpha"]) == (1, 0.05, 0.025)
    # no flips: the fewest pairs whose zero-discordance bound z^2/(n+z^2) reaches 0.05 at one-sided alpha 0.025
    z2 = 1.959963984540054 ** 2
    assert out["needed_pairs"] == 73 and z2 / (72 + z2) > 0.05 >= z2 / (73 + z2)
    assert out["supported_margin"] == pytest.approx(z2 / (4 + z2), abs=1e-3)
    code, out = size(ws, "--flag", "half_precision", "--margin", "0.02")
    assert code == 0 and out["needed_pairs"] > 73 and out["margin"] == 0.02


def test_a_second_look_is_sized_at_its_own_share_of_alpha(ws, monkeypatch):
    """After one look at the change, the next spends alpha/4: more pairs for the same margin."""
    from gatekeeper.gate.stats import looks

    code, first = size(ws, "--flag", "half_precision")
    monkeypatch.setattr(looks, "is_look", lambda row: True)  # evaluation 3 as if judged by a bound
    code, second = size(ws, "--flag", "half_precision")
    assert code == 0 and (second["look"], second["alpha"]) == (2, 0.0125)
    assert second["needed_pairs"] > first["needed_pairs"]


def test_before_any_evaluation_the_battery_is_sized_as_it_is(ws):
    (ws / "ledger" / "evidence.db").unlink()
    code, out = size(ws, "--flag", "half_precision")
    from gatekeeper.battery import suites
    from gatekeeper.workspace import Workspace

    items = suites.read(Workspace(ws))
    assert code == 0 and out["evaluation_id"] is None and out["discordance"] == 0
    assert (out["cases"], out["pairs"]) == (len(items), sum(len(i.case.assert_) for i in items))
    # several assertions per case are not independent: more pairs than 73 independent ones (design effect > 1)
    assert out["deff"] > 1 and out["needed_pairs"] > 73


def test_a_byte_equivalence_flag_has_no_margin_to_size(ws):
    code, out = size(ws, "--flag", "prefix_cache")
    assert code == 2 and "byte_equivalence" in out["error"]
    code, out = size(ws, "--flag", "half_precision", "--margin", "1.5")
    assert code == 2 and "--margin" in out["error"]


def test_a_battery_from_country_data_supports_the_margin_the_shipped_examples_ask(ws, monkeypatch):
    """bench/world_battery.py: 250 countries' facts from a data package, three cases each, clustered by country;
    sized before any run it supports kv_q8's margin of 0.02 where the workspace's own battery cannot."""
    (ws / "ledger" / "evidence.db").unlink()
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "bench"))
    from world_battery import write

    (ws / "policies" / "half_precision.yaml").write_text(HALF.replace("0.05", "0.02") + "cluster: var:country\n")
    code, before = size(ws, "--flag", "half_precision")
    assert code == 0 and before["supported_margin"] > 0.1
    n = write(ws, ["capital", "continent", "demonym"])
    rows = (ws / "world" / "world.csv").read_text().splitlines()
    assert n == len(rows) - 1 > 700 and "France,capital,What is the capital of France?,icontains:Paris" in rows
    code, after = size(ws, "--flag", "half_precision")
    assert code == 0 and after["pairs"] == before["pairs"] + n
    # clustered: the countries (and the workspace's own cases) count, not the pairs
    assert after["cases"] == before["cases"] + 250 and after["deff"] > 1
    assert after["supported_margin"] < 0.02 < before["supported_margin"], after
