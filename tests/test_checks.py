"""Each assertion type says yes and no on real outputs."""

import pytest

from gatekeeper.checks import CHECKS, check
from gatekeeper.workspace import Assertion

CASES = [
    ("equals", "Paris", "Paris", "Paris."),
    ("contains", "4", "It is 4.", "It is four."),
    ("icontains", "paris", "PARIS!", "Lyon"),
    ("not-contains", "sorry", "Sure.", "sorry, no"),
    ("not-icontains", "sorry", "Sure.", "SORRY"),
    ("starts-with", "Yes", "Yes, it is", "I think yes"),
    ("regex", r"\b\d{2}\b", "about 42 days", "about 4 days"),
    ("not-regex", r"\d", "no digits", "d1git"),
    ("one-of", ["A", "B"], " B\n", "C"),
    ("contains-any", ["cat", "dog"], "a dog", "a bird"),
    ("contains-all", ["cat", "dog"], "cat and dog", "cat only"),
    ("icontains-any", ["CAT"], "a cat", "a dog"),
    ("icontains-all", ["CAT", "DOG"], "Cat, dog", "cat"),
    ("is-json", None, ' {"a": 1} ', "{a: 1}"),
    ("contains-json", None, 'result: {"a": [1]} ok', "result: {a: 1}"),
    ("max-length", 5, "short", "too long"),
    ("min-length", 3, "long", "no"),
]


@pytest.mark.parametrize("kind, value, good, bad", CASES)
def test_assertion_says_yes_and_no(kind, value, good, bad):
    a = Assertion(type=kind, value=value)
    assert check(a, good) is True
    assert check(a, bad) is False


def test_every_type_is_covered():
    assert {c[0] for c in CASES} == set(CHECKS)
