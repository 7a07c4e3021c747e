"""The registry of assertion types: every type a suite may name, and the family of types it belongs to.

A family is the module of this package that evaluates its types: ``checks`` (pure functions of the output
text), ``graded`` (the policy's grader engine judges), ``similar`` (its embedding model), ``scored``
(promptfoo's text metrics) and ``scripted`` (the suite's own code). Each family is declared once, below, as
plain data: its type names, those promptfoo's ``not-`` prefix inverts, and those that need the policy's
grader engine or embedding model. The family's module takes its declaration from here (``FAMILY``), and
tests/test_registry.py proves that each declares exactly the types its module evaluates.

The declarations live here, not in the family modules, because workspace.py checks a suite's types against
``TYPES`` as it loads, and the family modules import workspace.py (a circle) and load what they evaluate
with (jinja2, node, ...), which the CLI's start-up must not. So this module imports nothing of gatekeeper.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    module: str  # gatekeeper.battery.<module> evaluates these types
    types: tuple[str, ...]  # base types, each in one family only
    invertible: tuple[str, ...] = ()  # the types a not- prefix inverts (not-TYPE is a type of its own)
    engine: tuple[str, ...] = ()  # the types judged by the policy's grader engine ('grader: {engine: NAME}')
    embedding: tuple[str, ...] = ()  # the types that need its embedding model ('grader: {embedding: ...}')
    own: tuple[str, ...] = ()  # gatekeeper's own types: promptfoo has no such type


_SHARED_CHECKS = ("equals", "contains", "icontains", "starts-with", "regex", "contains-any", "contains-all",
                  "icontains-any", "icontains-all", "is-json", "contains-json")
CHECKS = Family("checks", (*_SHARED_CHECKS, "one-of", "max-length", "min-length"), invertible=_SHARED_CHECKS,
                own=("one-of", "max-length", "min-length"))
# promptfoo ignores not- on factuality and closedqa (it grades them as if it were not there)
_GRADED = ("llm-rubric", "model-graded-closedqa", "factuality", "model-graded-factuality", "g-eval", "answer-relevance",
           "context-faithfulness", "context-recall", "context-relevance")
GRADED = Family("graded", _GRADED, engine=_GRADED, embedding=("answer-relevance",), invertible=(
    "llm-rubric", "g-eval", "answer-relevance", "context-faithfulness", "context-recall", "context-relevance"))
_SIMILAR = ("similar", "similar:cosine", "similar:dot", "similar:euclidean")
SIMILAR = Family("similar", _SIMILAR, invertible=_SIMILAR, embedding=_SIMILAR)
_SCORED = ("levenshtein", "bleu", "gleu", "rouge-n", "word-count", "is-refusal", "contains-html")
SCORED = Family("scored", _SCORED, invertible=_SCORED)
SCRIPTED = Family("scripted", ("javascript", "python"), invertible=("javascript", "python"))

FAMILIES: dict[str, Family] = {f.module: f for f in (CHECKS, GRADED, SIMILAR, SCRIPTED, SCORED)}
BY_TYPE: dict[str, Family] = {t: f for f in FAMILIES.values() for t in f.types}  # base type -> its family
# every type a suite may name: each family's types, then their not- forms
TYPES: tuple[str, ...] = tuple(t for f in FAMILIES.values() for t in (*f.types, *(f"not-{k}" for k in f.invertible)))
_KNOWN = frozenset(TYPES)


def base_type(kind: str) -> str:
    return kind[4:] if kind.startswith("not-") else kind


def known(kind: str) -> bool:
    """Whether a suite may name this type (``not-`` forms only of invertible types)."""
    return kind in _KNOWN


def family(kind: str) -> Family | None:
    """The family that evaluates this type (``not-`` forms included, invertible or not); None for none."""
    return BY_TYPE.get(base_type(kind))


def check(kind: str) -> str:
    """``kind``, or ValueError naming the types a suite may use."""
    if kind not in _KNOWN:
        raise ValueError(f"unknown assertion type {kind!r}; use one of: {', '.join(TYPES)}")
    return kind
