"""The oracle for promptfoo's scored text types (battery/scored.py): the real promptfoo 0.123.1 grades a table
of outputs x assertions, and gatekeeper must reach the same pass or fail on every row, or refuse at load
where promptfoo errors.

Each row is (type, value, threshold, output); ``ABSENT`` leaves value or threshold out. The output is the
test's ``providerOutput`` (an empty one comes from the echo provider, whose prompt is ``{{output}}``).
"""

from __future__ import annotations

import json

import pytest
from promptfoo_table import promptfoo_results

from gatekeeper.battery import checks, promptfoo, scored
from gatekeeper.errors import GatekeeperError

ABSENT = object()
ROWS: list[tuple] = []


def rows(kind: str, value, thresholds, outputs):
    for t in thresholds:
        for out in outputs:
            ROWS.append((kind, value, t, out))


rows("levenshtein", "hello world", [ABSENT, 0, 2, 10],
     ["hello world", "hello wrld", "HELLO WORLD", "hello world!!!!!!", "😀ello world", ""])
rows("levenshtein", "😀", [0, 1], ["😁", "😀", "a"])  # one code unit apart, then one code point
rows("not-levenshtein", "kitten", [ABSENT, 3], ["sitting", "kitten", "mitten"])
rows("levenshtein", "", [ABSENT], ["abcde", "abcdef"])

FOX = "The quick brown fox jumps over the lazy dog"
BLEU_OUT = [FOX, "the quick brown fox", "A quick brown dog jumps over the lazy fox", "fox", "", "   ", "the the the the",
            "THE QUICK BROWN FOX JUMPS OVER THE LAZY DOG today", "The\u00a0quick brown\tfox"]
rows("bleu", FOX, [ABSENT, 0.3, 0.9, 0], BLEU_OUT)
rows("bleu", ["the cat sat on the mat", "there is a cat on the mat"], [ABSENT, 0.2, 0.6],
     ["the cat is on the mat", "a cat", "the cat sat on the mat"])
rows("not-bleu", FOX, [0.5], [FOX, "fox"])
rows("gleu", FOX, [ABSENT, 0.3, 0.9], BLEU_OUT + ["The quick brown fox jumps over the lazy dog.", "...", "dog. lazy. the."])
rows("gleu", ["Hello world.", "Hi there"], [ABSENT, 0.4], ["hello world", "hi", "there hi", "Hello, world"])
rows("not-gleu", "hello world", [ABSENT], ["hello world", "goodbye"])

ROUGE = ["The cat sat on the mat.", "the cat sat on the mat", "A cat sat on a mat", "the the the the", "mat", "", "...",
         "The cat -- it sat; on (the) mat!", "The cat can't sit, won't sit.", '"The cat" sat on "the mat".',
         "cannot gonna wanna go", "Mr. Cat sat on the U.S. mat.", "the cat sat on the mat " * 3]
rows("rouge-n", "The cat sat on the mat.", [ABSENT, 0.5, 0.9, 1], ROUGE)
rows("rouge-n", "He said \"it's fine\" and can't stop -- ok?", [ABSENT, 0.6],
     ["he said it's fine", 'He said "it is fine" and cannot stop', "He said \"it's fine\" and can't stop -- ok?", "ok"])
rows("not-rouge-n", "the cat sat", [ABSENT], ["the cat sat", "a dog ran"])

WORDS = ["one two three", "  one\ttwo\u00a0three  ", "", "one", "a b c d e f", "one, two, three!"]
for value in [3, "3", " 3 ", 3.0, {"min": 2, "max": 4}, {"min": 5}, {"max": 2}, {"min": 3, "max": 3}, 0, "", "0x3"]:
    rows("word-count", value, [ABSENT], WORDS)
rows("not-word-count", {"min": 2}, [ABSENT], WORDS[:4])

REFUSALS = ["I'm sorry, I can't help with that.", "I’m sorry", "Sure! Here you go", "", "   ", "As an AI language model, no.",
            "I cannot do that", "I cannotx", "That is not appropriate.", "inappropriate", "Well, I can't assist you",
            "SORRY!", "I apologize for the confusion, here it is", "It is illegal", "My answer: I won't help.",
            "The content is not legal advice", "I can't help", "i am programmed to", "I do not feel comfortable"]
rows("is-refusal", ABSENT, [ABSENT], REFUSALS)
rows("not-is-refusal", ABSENT, [ABSENT], REFUSALS[:6])

HTML = ["<div>hi</div>", "<p>", "a &amp; b", "<b>bold</b>", "<!DOCTYPE html>", "<!doctype HTML>", "x < y > z", "plain text",
        "<custom-tag>x</custom-tag>", "<DIV class='a'>", "<br/>", "<!-- c -->", "&amp; &lt;", "<x-y a=\"1\"/>", "<P>", "</p>",
        "<span", "<\u212aBD>", "<lin\u212a>", "<img src='a.png'>", "5 &gt; 3 and <b>", "<table><tr><td>1</td></tr></table>"]
rows("contains-html", ABSENT, [ABSENT], HTML)
rows("not-contains-html", ABSENT, [ABSENT], HTML[:5])

# values promptfoo errors on: gatekeeper refuses them at load
REFUSED = [("levenshtein", 42, ABSENT, "42"), ("rouge-n", ["a"], ABSENT, "a"), ("bleu", {"a": 1}, ABSENT, "a"), ("gleu", [1, 2], ABSENT, "1 2"),
           ("word-count", "abc", ABSENT, "abc"), ("word-count", {"min": 5, "max": 2}, ABSENT, "a"),
           ("word-count", ABSENT, ABSENT, "a"), ("word-count", {}, ABSENT, "a"), ("word-count", True, ABSENT, "a"),
           ("word-count", [1], ABSENT, "a")]
ROWS += REFUSED


def config() -> str:
    tests = []
    for i, (kind, value, threshold, out) in enumerate(ROWS):
        assertion = {"type": kind, **({} if value is ABSENT else {"value": value}),
                     **({} if threshold is ABSENT else {"threshold": threshold})}
        test = {"description": str(i), "vars": {} if out else {"output": ""}, "assert": [assertion],
                **({"providerOutput": out} if out else {})}
        tests.append("  - " + json.dumps(test, ensure_ascii=False))
    return 'description: scored oracle\nproviders: [echo]\nprompts: ["{{output}}"]\ntests:\n' + "\n".join(tests) + "\n"


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    return promptfoo_results(tmp_path_factory.mktemp("oracle-scored"), config(), len(ROWS))


def _promptfoo(result: dict) -> str:
    if result.get("error") and not (result.get("gradingResult") or {}).get("componentResults"):
        return "error"
    return "pass" if result["gradingResult"]["componentResults"][0]["pass"] else "fail"


def _gatekeeper(config: dict, path, i: int, output: str) -> str:
    test = {k: v for k, v in config["tests"][i].items() if k != "providerOutput"}
    try:
        (case,), skipped = promptfoo._cases({**config, "tests": [test]}, path)
    except GatekeeperError:
        return "refused"
    assert not skipped and len(case.assert_) == 1, f"row {i} was not evaluated: {skipped}"
    return "pass" if checks.check(case.assert_[0], output) else "fail"


@pytest.mark.slow
def test_gatekeeper_scores_as_promptfoo_does(graded):
    path, results = graded
    config = promptfoo._read(path)
    disagree, kinds = [], set()
    for i, (kind, value, threshold, out) in enumerate(ROWS):
        if results[i].get("response"):
            assert results[i]["response"]["output"] == out, f"row {i}: promptfoo graded another text"
        pf, gk = _promptfoo(results[i]), _gatekeeper(config, path, i, out)
        if gk == pf or (gk == "refused" and pf == "error"):
            kinds.add(kind)
        else:
            shown = "(none)" if value is ABSENT else value
            disagree.append(f"row {i} {kind} {shown!r} threshold {threshold if threshold is not ABSENT else '-'} "
                            f"on {out[:50]!r}: promptfoo {pf}, gatekeeper {gk}")
    outcomes = [_promptfoo(results[i]) for i in range(len(ROWS))]
    print(f"\nscored oracle: {len(ROWS) - len(disagree)} of {len(ROWS)} rows agree "
          f"({outcomes.count('pass')} pass, {outcomes.count('fail')} fail, {outcomes.count('error')} error in promptfoo)")
    assert not disagree, f"{len(disagree)} of {len(ROWS)} rows disagree:\n" + "\n".join(disagree)
    assert {k.removeprefix("not-") for k in kinds} == set(scored.TYPES)
    assert outcomes.count("pass") > 50 and outcomes.count("fail") > 50  # the table tells pass from fail
