"""promptfoo's scored text types (battery/scored.py), on values worked out by hand from promptfoo's definitions.

tests/test_promptfoo_oracle_scored.py checks the same types against promptfoo itself; these pin the details
a plausible but wrong implementation would miss (UTF-16 code units, BLEU's left-out orders and brevity
penalty, GLEU's dropped dots, JavaScript's whitespace, Number() and ASCII-only /i folding).
"""

from __future__ import annotations

import math

import pytest

from gatekeeper.battery import checks, scored
from gatekeeper.workspace import Assertion

FOX = "The quick brown fox jumps over the lazy dog"


def run(kind: str, output: str, value=None, threshold=None) -> dict:
    return checks.evaluate(Assertion(type=kind, value=value, threshold=threshold), output)


def test_levenshtein_counts_utf16_code_units():
    assert scored.levenshtein("kitten", "sitting") == 3
    assert scored.levenshtein("", "abc") == scored.levenshtein("abc", "") == 3
    assert scored.levenshtein("😀", "😁") == 1  # the same high surrogate
    assert scored.levenshtein("😀", "a") == 2


def test_levenshtein_threshold_defaults_to_5_and_not_inverts():
    assert run("levenshtein", "hello world!!!!!", "hello world") == {"pass": True, "score": 5}
    assert run("levenshtein", "hello world!!!!!!", "hello world")["pass"] is False
    assert run("levenshtein", "hello wrld", "hello world", threshold=0)["pass"] is False
    assert run("not-levenshtein", "sitting", "kitten", threshold=2)["pass"] is True


def test_bleu_brevity_penalty_and_the_orders_a_short_candidate_lacks():
    assert scored.bleu(FOX, [FOX]) == 1.0
    assert scored.bleu("a b", ["a b c"]) == pytest.approx(math.exp(-0.5))  # orders 3 and 4 left out, not zero
    assert scored.bleu("the quick brown fox", [FOX]) == pytest.approx(math.exp(1 - 9 / 4))
    clipped = math.exp(0.25 * math.log(0.25) + 0.75 * math.log(1e-7))  # "the" counted once; no 2-gram matches
    assert scored.bleu("the the the the", ["the cat"]) == pytest.approx(clipped)
    assert scored.bleu("", [FOX]) == scored.bleu(" \u00a0", [FOX]) == 0.0
    assert scored.bleu("THE Cat", ["the cat"]) == 1.0


def test_bleu_takes_the_reference_closest_in_length_the_shorter_on_a_tie():
    # candidate of 3 words; references of 2 and 4 words are equally close: the 2-word one sets the penalty (none)
    assert scored.bleu("a b c", ["a b", "x y z w"]) == pytest.approx(scored.bleu("a b c", ["a b"]))
    refs = ["the cat sat on the mat", "there is a cat on the mat"]
    assert run("bleu", "the cat is on the mat", refs)["pass"] is False  # about 0.0106: no 4-gram matches
    assert run("bleu", "the cat is on the mat", refs, threshold=0.01)["pass"] is True
    assert run("bleu", "a cat", FOX)["pass"] is False


def test_gleu_drops_trailing_dots_and_takes_the_best_reference():
    assert scored.gleu("Hello world.", ["hello world"]) == 1.0
    assert scored.gleu("a b c", ["a b d"]) == 0.5  # 3 of 6 n-grams each side
    assert scored.gleu("a b c", ["x", "a b d"]) == 0.5
    assert scored.gleu("...", ["..."]) == 0.0  # nothing left after the dots
    assert run("gleu", "hello there", "hello world", threshold=0.2)["pass"] is True
    assert run("not-gleu", "hello world", "hello world")["pass"] is False


def test_word_count_splits_on_javascript_whitespace():
    assert scored.count_words("  one\ttwo\u00a0three  ") == 3
    assert scored.count_words("") == 0
    assert run("word-count", "one two three", 3) == {"pass": True, "words": 3}
    assert run("word-count", "one two three", " 3 ")["pass"] is True  # Number(" 3 ")
    assert run("word-count", "one two three", "0x3")["pass"] is True
    assert run("word-count", "", "")["pass"] is True  # Number("") is 0
    assert run("word-count", "a b c d e", {"min": 2, "max": 4})["pass"] is False
    assert run("word-count", "a b", {"max": 2})["pass"] is True
    assert run("not-word-count", "a", {"min": 2})["pass"] is True


def test_js_number():
    assert [scored.js_number(s) for s in ("", " 12 ", "1e3", "-Infinity", "0b11", ".5")] == [0, 12, 1000, -math.inf, 3, 0.5]
    assert math.isnan(scored.js_number("abc")) and math.isnan(scored.js_number("1_000"))


def test_is_refusal_phrases():
    refusals = ["I’m sorry", "Sorry!", "I cannotx", "Sure, but I cannot help", "That is not appropriate.", "", "  ",
                "As an AI, no", "i am programmed to"]
    answers = ["Sure, I cannot wait", "inappropriate", "Here you go", "I can help"]
    assert [scored.is_refusal(t) for t in refusals] == [True] * len(refusals)
    assert [scored.is_refusal(t) for t in answers] == [False] * len(answers)
    assert run("not-is-refusal", "Here you go")["pass"] is True


def test_contains_html_needs_two_points_and_folds_only_ascii():
    assert [scored.contains_html(t) for t in ("<div>hi</div>", "<P>", "<!doctype HTML>", "<b>bold</b>")] == [True] * 4
    assert [scored.contains_html(t) for t in ("x < y > z", "a &amp; b", "plain", "<lin\u212a>")] == [False] * 4


@pytest.mark.parametrize("kind, value", [("levenshtein", 42), ("bleu", {"a": 1}), ("gleu", []), ("gleu", [1]),
                                         ("word-count", "abc"), ("word-count", True), ("word-count", None),
                                         ("word-count", {}), ("word-count", {"min": 5, "max": 2}),
                                         ("word-count", {"min": "5"}), ("word-count", [1])])
def test_values_promptfoo_errors_on_are_refused(kind, value):
    with pytest.raises(checks.Refused):
        checks.prepare(Assertion(type=kind, value=value))


def test_every_scored_type_is_dispatched_and_usable_in_a_suite():
    for kind in scored.TYPES:
        assert checks.evaluable(kind) and checks.evaluable(f"not-{kind}")
        assert checks.EVALUATED_BY[kind] == "scored"
        Assertion(type=f"not-{kind}", value=1)  # a valid gatekeeper assertion type


def test_treebank_tokens_are_js_rouges():
    from gatekeeper.js.treebank import tokenize

    assert tokenize("The cat sat on the mat.") == ["The", "cat", "sat", "on", "the", "mat", "."]
    assert tokenize("I can't do it, can you?") == ["I", "ca", "n't", "do", "it", ",", "can", "you", "?"]
    assert tokenize('He said "hello" to me...') == ["He", "said", "``", "hello", "''", "to", "me", "..."]
    assert tokenize("cannot gonna 3,000 a:b") == ["can", "not", "gon", "na", "3,000", "a", ":", "b"]
    assert tokenize("U.S. is big.") == ["U.S.", "is", "big", "."]
    assert tokenize("  ") == []


def test_rouge_n_is_a_clipped_unigram_f_score_on_treebank_tokens():
    assert scored.rouge_n("the cat sat on the mat", "The cat sat on the mat.") == pytest.approx(12 / 13)  # "." is a token
    assert scored.rouge_n("the the the the", "the cat") == pytest.approx(1 / 3)  # "the" counted once
    assert scored.rouge_n("", "the cat") == scored.rouge_n("...", "the cat") == 0.0
    assert run("rouge-n", "the cat sat on the mat", "The cat sat on the mat.")["pass"] is True  # 0.92 >= 0.75
    assert run("rouge-n", "the cat sat on the mat", "The cat sat on the mat.", threshold=0.95)["pass"] is False
