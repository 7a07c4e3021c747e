"""A ledger written before the typed evidence records (tests/data/old_ledger, made by its make.py) verifies,
exports and diffs exactly as it did then: the records are a change of the inside, not of the ledger."""

import gzip
import shutil
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data" / "old_ledger"
EXPECTED = DATA / "expected"


@pytest.fixture(scope="module")
def old(tmp_path_factory):
    from gatekeeper.setup.scaffold import init_workspace

    ws = tmp_path_factory.mktemp("old") / "ws"
    init_workspace(ws)
    (ws / "ledger" / "evidence.db").write_bytes(gzip.decompress((DATA / "ledger" / "evidence.db.gz").read_bytes()))
    shutil.copy(DATA / "ledger" / "checkpoints.jsonl", ws / "ledger" / "checkpoints.jsonl")
    return ws


def cli(ws, *args):
    from typer.testing import CliRunner

    from gatekeeper.cli import app

    result = CliRunner().invoke(app, ["--workspace", str(ws), *map(str, args)], catch_exceptions=False)
    return result.exit_code, result.stdout


def expected(name: str) -> str:
    path = EXPECTED / name
    return gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()


def test_an_old_ledger_verifies_with_its_checkpoint(old):
    code, out = cli(old, "ledger", "verify", "--json")
    assert code == 0
    assert out.replace(str(old), "/tmp/oldledger/ws") == expected("verify.json")


@pytest.mark.parametrize("fmt", ["md", "json", "html", "junit"])
@pytest.mark.parametrize("evaluation", [1, 2, 3, 4])
def test_an_old_ledger_exports_as_it_did(old, evaluation, fmt):
    code, out = cli(old, "ledger", "export", evaluation, "--format", fmt)
    assert code == 0
    assert out == expected(f"export-{evaluation}.{fmt}" + (".gz" if fmt == "json" else ""))


def test_an_old_ledger_diffs_and_lists_as_it_did(old):
    assert cli(old, "ledger", "diff", 1, 2, "--format", "md") == (0, expected("diff-1-2.md"))
    assert cli(old, "ledger", "diff", 1, 2, "--json") == (0, expected("diff-1-2.json"))
    assert cli(old, "ledger", "list", "--json") == (0, expected("list.json"))


def test_a_changed_byte_in_an_old_ledger_is_found(old, tmp_path):
    """The comparison above can fail: one edited figure in the old database breaks its chain."""
    import sqlite3

    ws = tmp_path / "ws"
    shutil.copytree(old, ws)
    with sqlite3.connect(ws / "ledger" / "evidence.db") as db:
        for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'trigger'").fetchall():
            db.execute(f"DROP TRIGGER {name}")  # the append-only guard, as someone with the file could
        db.execute("UPDATE case_result SET result = replace(result, '\"prompt_tokens\": ', '\"prompt_tokens\": 1') "
                   "WHERE id = (SELECT min(id) FROM case_result)")
    code, out = cli(ws, "ledger", "verify", "--json")
    assert code != 0 and out != expected("verify.json")
