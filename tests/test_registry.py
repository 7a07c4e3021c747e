"""The registry of assertion types (battery/types.py): the one list a suite's types are checked against, and
each family's declaration exactly what its module evaluates (a type added to one and not the other fails here)."""

from __future__ import annotations

import importlib

import pytest
from pydantic import ValidationError

from gatekeeper.battery import checks, graded, scored, scripted, similar, types
from gatekeeper.workspace import Assertion


def test_the_registry_refuses_an_unknown_type():
    with pytest.raises(ValueError, match=r"unknown assertion type 'sounds-right'; use one of: equals, contains"):
        types.check("sounds-right")
    assert not types.known("sounds-right") and types.family("sounds-right") is None
    with pytest.raises(ValidationError, match="unknown assertion type 'sounds-right'"):
        Assertion(type="sounds-right", value="x")


@pytest.mark.parametrize("kind", ["not-one-of", "not-max-length", "not-factuality", "not-model-graded-closedqa", "not-not-equals"])
def test_not_forms_of_types_not_inverted_are_unknown(kind):
    with pytest.raises(ValidationError, match=f"unknown assertion type '{kind}'"):
        Assertion(type=kind, value="x")


def test_every_registered_type_loads_and_is_evaluated():
    for kind in types.TYPES:
        Assertion(type=kind)  # the workspace takes every type the registry holds
        assert checks.evaluable(kind), kind
    assert len(types.TYPES) == len(set(types.TYPES))


def test_each_type_is_in_one_family_and_its_properties_are_its_own():
    declared = [t for f in types.FAMILIES.values() for t in f.types]
    assert len(declared) == len(set(declared)) == len(types.BY_TYPE)
    for f in types.FAMILIES.values():
        for prop in (f.invertible, f.engine, f.embedding, f.own):
            assert set(prop) <= set(f.types), (f.module, prop)


def test_each_family_module_takes_its_declaration_from_the_registry():
    for name, family in types.FAMILIES.items():
        module = importlib.import_module(f"gatekeeper.battery.{name}")
        assert module.FAMILY is family
        if name != "checks":
            assert callable(module.prepare) and callable(module.evaluate)
            assert {checks.EVALUATED_BY[t] for t in family.types} == {name}


def test_checks_evaluates_exactly_its_declared_types():
    f = types.CHECKS
    assert set(checks.SHARED) | set(checks.GATEKEEPER_ONLY) == set(f.types)
    assert set(checks.SHARED) == set(f.invertible)  # promptfoo's not- inverts every type it shares
    assert set(checks.GATEKEEPER_ONLY) == set(f.own)
    assert set(checks.CHECKS) == {t for t in types.TYPES if types.family(t) is f}
    assert not set(checks.EVALUATED_BY) & set(f.types)


def test_graded_judges_exactly_its_declared_types():
    assert set(graded.JUDGES) == set(types.GRADED.types) == set(types.GRADED.engine)
    assert graded.TYPES == types.GRADED.types and graded.INVERTIBLE == types.GRADED.invertible
    # a not- form of a type promptfoo does not invert is refused by graded too, should it get past the registry
    for kind in set(graded.TYPES) - set(graded.INVERTIBLE):
        with pytest.raises(checks.Refused, match="promptfoo ignores the not- prefix"):
            graded.prepare(Assertion.model_construct(type=f"not-{kind}", value="x", options={}))


def test_scored_computes_exactly_its_declared_types():
    assert set(scored._SCORED) == set(types.SCORED.types)


def test_similar_measures_exactly_its_declared_types():
    assert {"similar", *(f"similar:{m}" for m in similar.METRICS)} == set(types.SIMILAR.types)
    assert all(similar._metric(t) in similar.METRICS for t in types.SIMILAR.types)
    assert set(types.SIMILAR.embedding) == set(types.SIMILAR.types)


def test_scripted_runs_exactly_its_declared_languages():
    assert set(scripted.SUFFIXES) == set(scripted.LABEL) == set(types.SCRIPTED.types)


def test_what_the_graders_open_agrees_with_the_registry():
    from gatekeeper.gate.run import graders

    assert set(graders.NEEDS_EMBEDDING) == {t for f in types.FAMILIES.values() for t in f.embedding}
    assert set(graded.TYPES) == {t for f in types.FAMILIES.values() for t in f.engine}


def test_the_registry_is_plain_data():
    """workspace.py imports it at the CLI's start-up: it may import nothing of gatekeeper's."""
    import ast
    from pathlib import Path

    tree = ast.parse(Path(types.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert imported <= {"__future__", "dataclasses"}
