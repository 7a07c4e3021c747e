"""The torch adapter on the transformers releases the project admits (``transformers>=5.0`` in pyproject.toml), each
in an environment ``gatekeeper runtime prepare`` makes once under $GATEKEEPER_HOME: the oldest (5.0.0, whose cache has
no recurrent layers of its own) and one that keeps a recurrent layer's state as one tensor per kind (5.10.4); the
newest (dict layout) is the project's own environment, tested everywhere else. A tiny hybrid model's prefix is served
from the cache on each release that can run it, and its verdict is the one of this environment."""

from __future__ import annotations

import pytest
from conftest import evaluate, profile
from runtimes import RELEASES, release
from tiny_models import tiny_hybrid  # noqa: F401  (fixture)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pythons() -> dict[str, str]:
    return {k: release(v) for k, v in RELEASES.items()}


def served(result) -> int:
    return sum(row["cached_tokens"] or 0 for row in result["telemetry"]["on"].values())


def test_the_oldest_admitted_release_evaluates_a_plain_model(tiny_ws, tiny_llama, run_cli, pythons):
    (tiny_ws / "engines" / "old.yaml").write_text(profile("torch", tiny_llama) + f"python: {pythons['oldest']}\n")
    code, result = evaluate(run_cli, tiny_ws, "old")
    assert (code, result["verdict"]) == (0, "PASS"), result["reasons"]
    assert served(result) > 0


def test_a_hybrid_model_on_the_single_state_layout_is_served_from_its_cache(tiny_ws, tiny_hybrid, run_cli,  # noqa: F811
                                                                             pythons):
    here = profile("torch", tiny_hybrid).replace("prefill: monolithic", "prefill: aligned\nchunk: 32")
    (tiny_ws / "engines" / "hybrid.yaml").write_text(here)
    (tiny_ws / "engines" / "hybrid_old.yaml").write_text(here + f"python: {pythons['single']}\n")
    code, there = evaluate(run_cli, tiny_ws, "hybrid_old")
    assert (code, there["verdict"]) == (0, "PASS"), there["reasons"]
    assert served(there) > 0
    code, mine = evaluate(run_cli, tiny_ws, "hybrid")
    assert (code, mine["verdict"]) == (0, "PASS") and served(mine) == served(there)


def test_a_hybrid_model_the_oldest_release_cannot_load_is_exit_2(tiny_ws, tiny_hybrid, run_cli, pythons):  # noqa: F811
    (tiny_ws / "engines" / "hybrid_oldest.yaml").write_text(profile("torch", tiny_hybrid) + f"python: {pythons['oldest']}\n")
    code, out, err = run_cli("--workspace", tiny_ws, "evaluate", "--flag", "prefix_cache", "--engine", "hybrid_oldest",
                             "--operator", "ci", "--json")
    assert code == 2 and "qwen3_5" in out, out
    assert not (tiny_ws / "ledger" / "evidence.db").exists() or "evaluation" not in out
