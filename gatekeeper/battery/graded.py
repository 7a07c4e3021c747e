"""Model-graded assertions (llm-rubric, model-graded-closedqa, factuality, g-eval, answer-relevance and the
context-* family), judged by the grader the policy names, as promptfoo 0.123.1 judges them.

The grading prompt is the one promptfoo sends, byte for byte: its default prompts are kept as data in
``grading/`` (chat prompts as their messages, sent as promptfoo's JSON text), a ``rubricPrompt`` replaces
them as promptfoo's loadRubricPrompt reads it, and vars and output are rendered in with nunjucks after
promptfoo's processContextForTemplating. The grader's reply is read as promptfoo reads it (the first JSON
object, a closing Y/N, a category letter, ...); a reply promptfoo cannot read is what promptfoo makes of
it: a failed assertion, and for ``not-`` forms a grader failure fails too (promptfoo's isGraderFailure).
``grader`` in ``Context.graders`` answers ``complete(prompt) -> str`` (and ``embed(text)`` for answer-relevance):
gate/run/graders.py opens it. tests/test_promptfoo_oracle_graded.py proves the prompts against promptfoo itself.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any, Callable

from ..errors import GatekeeperError
from ..identity import sha256_hex
from ..js import nunjucks
from ..js import yaml as jsyaml
from ..js.value import JS_SPACE, JSONError, js_number, js_string, js_trim, number_string, parse_json, stringify, truthy
from ..workspace import Assertion
from . import checks, types

FAMILY = types.GRADED  # this module's types, declared in the registry (JUDGES judges each)
TYPES, INVERTIBLE = FAMILY.types, FAMILY.invertible
PROMPTS = ("llm-rubric.json", "factuality.json", "model-graded-closedqa.json", "g-eval-steps.txt", "g-eval-evaluate.txt",
           "answer-relevance.txt", "context-recall.txt", "context-relevance.txt", "context-faithfulness-longform.txt",
           "context-faithfulness-nli.txt")
REASON_CHARS = 300  # a reason kept in the ledger is cut here (the reply itself is recorded by digest)


# --- promptfoo's default prompts --------------------------------------------------------------------


@lru_cache(maxsize=None)
def default_prompt(name: str) -> str:
    """promptfoo's default prompt ``name`` as it holds it: a chat prompt is JSON.stringify of its messages."""
    text = (resources.files(__package__) / "grading" / name).read_text(encoding="utf-8")
    return stringify(json.loads(text)) if name.endswith(".json") else text


def prompts_digest() -> str:
    """Digest of every default grading prompt: part of the grader's identity."""
    return sha256_hex("\x00".join(f"{n}\x00{default_prompt(n)}" for n in PROMPTS).encode())


# --- reading a reply ----------------------------------------------------------------------------------


def try_parse(text: str) -> Any:
    """promptfoo's tryParse: the output as JSON when it is JSON, else the text."""
    try:
        return parse_json(text)
    except JSONError:
        return text


def trim_end(s: str) -> str:
    return s.rstrip(JS_SPACE)


# --- rendering: promptfoo's loadRubricPrompt and renderLlmRubricPrompt -----------------------------------


def load_prompt(rubric_prompt: Any, default: str) -> str:
    """The grading prompt template: the default, or ``rubricPrompt`` (text, ``file://`` text, or an object sent as JSON)."""
    if not rubric_prompt or (isinstance(rubric_prompt, dict) and not rubric_prompt):
        return default
    if isinstance(rubric_prompt, str) and rubric_prompt.startswith("file://"):
        path = Path(rubric_prompt[len("file://"):])
        if path.suffix.lower() in (".js", ".cjs", ".mjs", ".ts", ".py"):
            raise checks.Refused(f"rubricPrompt {rubric_prompt}: a script; gatekeeper reads a rubricPrompt from a text or JSON file")
        if not path.is_absolute() or not path.is_file():
            raise checks.Refused(f"rubricPrompt {rubric_prompt}: not found; gatekeeper reads a file:// rubricPrompt by its "
                                 "absolute path: give one, or put the prompt inline")
        return path.read_text(encoding="utf-8")
    if isinstance(rubric_prompt, (dict, list)):
        return stringify(rubric_prompt)
    if not isinstance(rubric_prompt, str):
        raise checks.Refused(f"rubricPrompt must be text, a file:// reference or chat messages, not {rubric_prompt!r}")
    return rubric_prompt


def _for_template(v: Any) -> Any:
    """processContextForTemplating: objects become their JSON, as do the objects inside a list."""
    if isinstance(v, dict):
        return stringify(v)
    if isinstance(v, list):
        return [stringify(x) if isinstance(x, (dict, list)) else x for x in v]
    return v


def render_prompt(template: str, context: dict[str, Any]) -> str:
    """renderLlmRubricPrompt: a JSON template has each of its strings rendered and is sent as JSON again;
    any other template is rendered as nunjucks text."""
    ctx = {k: _for_template(v) for k, v in context.items()}
    try:
        parsed = parse_json(template)
    except JSONError:
        parsed = None
    else:
        try:
            return stringify(_map_strings(parsed, lambda s: nunjucks.render(s, ctx)))
        except ValueError:
            pass  # promptfoo falls back to rendering the whole text
    try:
        return nunjucks.render(template, ctx)
    except ValueError as e:
        raise checks.Refused(f"the grading prompt: {e}") from None


def _map_strings(v: Any, f: Callable[[str], str]) -> Any:
    if isinstance(v, str):
        return f(v)
    if isinstance(v, list):
        return [_map_strings(x, f) for x in v]
    if isinstance(v, dict):
        return {k: _map_strings(x, f) for k, x in v.items()}
    return v


# --- reading replies ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    """What promptfoo makes of a grader's reply; ``failure``: a grader failure (isGraderFailure), which no
    ``not-`` turns into a pass."""

    passed: bool
    score: float
    reason: str
    failure: bool = False


_verdict = Verdict


def grader_fail(reason: str) -> Verdict:
    return Verdict(False, 0.0, reason, True)


def read_json_grade(reply: str, label: str, threshold: float | None) -> Verdict:
    """runJsonGradingPrompt's reading of a reply: the first JSON object's pass, score and reason."""
    if not reply:
        return grader_fail("No output")
    objects = jsyaml.json_objects(reply)
    if not objects:
        return grader_fail(f"Could not extract JSON from {label} response")
    parsed = objects[0]
    if not isinstance(parsed, dict):
        return grader_fail(f"{label} produced malformed response. We were not able to parse the response as JSON. "
                           f"Output: {stringify(reply)}")
    passed = parsed.get("pass")
    passed = True if passed is None else passed
    if not isinstance(passed, bool):
        passed = bool(re.fullmatch(r"(?:true|yes|pass|y)", js_string(passed), re.IGNORECASE))
    score = parsed.get("score")
    if "score" not in parsed or not (isinstance(score, (int, float)) and not isinstance(score, bool)):
        number = js_number(score) if "score" in parsed else math.nan
        score = number if math.isfinite(number) else float(passed)
    if threshold is not None:
        passed = passed and score >= threshold
    reason = parsed.get("reason")
    reason = js_string(reason) if truthy(reason) else (
        "Grading passed" if passed else f"Score {js_string(score)} below threshold {js_string(threshold) if threshold is not None else 'undefined'}")
    return _verdict(passed, float(score), reason)


def read_closedqa(reply: str) -> Verdict:
    """matchesClosedQa: the reply's last character Y passes."""
    if not reply:
        return _verdict(False, 0.0, "No output")
    end = trim_end(reply)
    if end.endswith("Y"):
        return _verdict(True, 1.0, f"The submission meets the criterion:\n{reply}")
    if end.endswith("N"):
        return _verdict(False, 0.0, f"The submission does not meet the criterion:\n{reply}")
    return _verdict(False, 0.0, f"Model grader produced a malformed response:\n{reply}")


FACTUALITY = {"A": "The submitted answer is a subset of the expert answer and is fully consistent with it.",
              "B": "The submitted answer is a superset of the expert answer and is fully consistent with it.",
              "C": "The submitted answer contains all the same details as the expert answer.",
              "D": "There is a disagreement between the submitted answer and the expert answer.",
              "E": "The answers differ, but these differences don't matter from the perspective of factuality."}
_FACTUALITY_KEYS = {"A": ("subset", 1), "B": ("superset", 1), "C": ("agree", 1), "D": ("disagree", 0), "E": ("differButFactual", 1)}


def read_factuality(reply: str, scores: dict[str, Any]) -> Verdict:
    """matchesFactuality: the JSON reply's category letter, else the legacy "(A)" form; its score from the
    options' factuality weights (a letter weighing 0 fails)."""
    if not reply:
        return _verdict(False, 0.0, "No output")
    objects = jsyaml.json_objects(reply)
    category = objects[0].get("category") if objects and isinstance(objects[0], dict) else None
    why = objects[0].get("reason") if truthy(category) and isinstance(category, str) else None
    if truthy(category) and isinstance(category, str):
        option = js_trim(category).upper()
        if not re.fullmatch(r"[A-E]", option):
            return _verdict(False, 0.0, f"Invalid category value: {option}")
    if truthy(category) and isinstance(category, str) and (why is None or isinstance(why, str)):  # a reason .trim() reads
        reason = js_trim(why or "") or f"Category {option}: {FACTUALITY[option]}"
    else:
        m = re.search(r"\s*\(?([a-eA-E])\)", reply)
        if not m:
            return _verdict(False, 0.0, f"Factuality checker output did not match expected format: {reply}")
        option = m.group(1).upper()
        r = re.search(r"\)\s*(.*)", reply, re.DOTALL)
        reason = js_trim(r.group(1)) if r and r.group(1) else reply
    weight = (scores or {}).get(_FACTUALITY_KEYS[option][0])
    weight = js_number(_FACTUALITY_KEYS[option][1] if weight is None else weight)
    return _verdict(weight > 0, weight, reason)


# --- the types -------------------------------------------------------------------------------------------


def _needs_string(a: Assertion) -> None:
    if not isinstance(a.value, str):
        raise checks.Refused(f"'value' must be a string ({checks.base_type(a.type)}: promptfoo refuses {js_string(a.value)!r})")


def prepare(a: Assertion) -> Any:
    """Validation at load: the value's shape and a rubricPrompt that can be read and rendered."""
    kind = checks.base_type(a.type)
    if a.type.startswith("not-") and kind not in INVERTIBLE:
        raise checks.Refused(f"promptfoo ignores the not- prefix on {kind} (it grades as {kind}); remove 'not-'")
    if kind == "llm-rubric" and not isinstance(a.value, (str, dict, list, type(None))):
        raise checks.Refused("'value' must be a rubric: text or an object")
    if kind == "g-eval":
        if not (isinstance(a.value, str) or isinstance(a.value, list) and all(isinstance(v, str) for v in a.value)):
            raise checks.Refused("'value' must be a criterion or a list of criteria (strings)")
    elif kind in ("model-graded-closedqa", "factuality", "model-graded-factuality", "context-recall"):
        _needs_string(a)
    rubric = a.options.get("rubricPrompt")
    if kind == "context-faithfulness" and rubric and not isinstance(rubric, list):
        raise checks.Refused("rubricPrompt must be a list of two prompts for context-faithfulness (statements, then verdicts)")
    if kind == "g-eval" and isinstance(rubric, dict):
        for part in ("steps", "evaluate"):
            render_prompt(load_prompt(rubric.get(part), "{{ x }}"), {})
    elif kind != "context-faithfulness":
        render_prompt(load_prompt(rubric, "{{ x }}"), {})  # a template that cannot render is refused now
    return None


def _call(context: checks.Context, prompt: str) -> str:
    grader = context.graders
    if grader is None or grader.engine is None:
        raise GatekeeperError("a model-graded assertion needs the grader the policy names ('grader: {engine: NAME}'); "
                              "only evaluate opens it: run gatekeeper evaluate")
    return grader.complete(prompt)


NEEDS_VARS = {"context-relevance": ("query", "context"), "context-faithfulness": ("query", "context")}


def needs(a: Assertion) -> tuple[str, ...]:
    """The vars each case must hold for this assertion (checked when the battery loads)."""
    return NEEDS_VARS.get(checks.base_type(a.type), ())


def _var(context: checks.Context, name: str, kind: str) -> str:
    v = context.vars.get(name)
    if not isinstance(v, str) or not v:
        raise checks.Refused(f"{kind} needs a non-empty {name!r} var in each test; add it to the test's vars")
    return v


def evaluate(a: Assertion, output: str, context: checks.Context) -> dict[str, Any]:
    kind, inverse = checks.base_type(a.type), a.type.startswith("not-")
    replies: list[str] = []

    def ask(prompt: str) -> str:
        reply = _call(context, prompt)
        replies.append(reply)
        return reply

    verdict = JUDGES[kind](a, output, context, ask)
    passed, score = verdict.passed, verdict.score
    if inverse and not verdict.failure:
        passed, score = not passed, min(1.0, max(0.0, 1 - (score if math.isfinite(score) else 0)))
    reason = verdict.reason
    out = {"pass": passed != inverse,  # checks.evaluate inverts not- forms again: this is promptfoo's pass after it
           "score": round(score, 6) if math.isfinite(score) else None,
           "reason": reason if len(reason) <= REASON_CHARS else reason[:REASON_CHARS] + "…",
           "reply": sha256_hex("\x00".join(replies).encode())[:16]}  # the grader's replies, by digest
    if verdict.failure:
        out["grader_error"] = True
    return out


def _rubric(a: Assertion, output: str, context: checks.Context, ask) -> Verdict:
    vars_ = {**context.vars, "output": try_parse(output), "rubric": a.value or ""}
    prompt = render_prompt(load_prompt(a.options.get("rubricPrompt"), default_prompt("llm-rubric.json")), vars_)
    return read_json_grade(ask(prompt), "llm-rubric", a.threshold)


def _closedqa(a: Assertion, output: str, context: checks.Context, ask) -> Verdict:
    vars_ = {**context.vars, "input": context.prompt, "criteria": a.value, "completion": try_parse(output)}
    prompt = render_prompt(load_prompt(a.options.get("rubricPrompt"), default_prompt("model-graded-closedqa.json")), vars_)
    return read_closedqa(ask(prompt))


def _factuality(a: Assertion, output: str, context: checks.Context, ask) -> Verdict:
    vars_ = {**context.vars, "input": context.prompt, "ideal": a.value, "completion": try_parse(output)}
    prompt = render_prompt(load_prompt(a.options.get("rubricPrompt"), default_prompt("factuality.json")), vars_)
    return read_factuality(ask(prompt), a.options.get("factuality") or {})


_DOTS = "[^\n\r\u2028\u2029]+"  # JavaScript's .+ (a dot matches no line terminator)


def _json_in(reply: str, pattern: str, failure: str) -> Any:
    """The JSON the pattern finds in a G-Eval reply, or the grader failure promptfoo reports (``failure``)."""
    m = re.search(pattern, reply)
    if not m:
        return grader_fail(f"{failure}: {reply}")
    try:
        return parse_json(m.group())
    except JSONError as e:
        return grader_fail(f"{failure}: {e}\n\n{reply}")


def _geval_one(criteria: str, a: Assertion, output: str, context: checks.Context, ask, threshold: float) -> Verdict:
    rubric = a.options.get("rubricPrompt")
    parts = rubric if isinstance(rubric, dict) else {}
    steps_reply = ask(render_prompt(load_prompt(parts.get("steps"), default_prompt("g-eval-steps.txt")), {"criteria": criteria}))
    if not steps_reply:
        return grader_fail("G-Eval step-generation call to the grader returned no output")
    parsed = _json_in(steps_reply, r'\{"steps"' + _DOTS + r"\}", "LLM-proposed evaluation steps are not in JSON format")
    if isinstance(parsed, Verdict):
        return parsed
    steps = parsed.get("steps") if isinstance(parsed, dict) else None
    if not isinstance(steps, list):
        shown = stringify(steps) if isinstance(parsed, dict) and "steps" in parsed else "undefined"
        return grader_fail(f"G-Eval steps response has invalid or missing steps: {shown}")
    if not steps:
        return grader_fail("LLM does not propose any evaluation step")
    if not all(isinstance(s, str) and js_trim(s) for s in steps):
        return grader_fail(f"G-Eval steps response contains invalid steps: {stringify(steps)}")
    evaluate_vars = {"criteria": criteria, "steps": "\n- ".join(steps), "maxScore": "10",
                     "input": try_parse(context.prompt), "output": try_parse(output)}
    reply = ask(render_prompt(load_prompt(parts.get("evaluate"), default_prompt("g-eval-evaluate.txt")), evaluate_vars))
    if not reply:
        return grader_fail("G-Eval evaluation call to the grader returned no output")
    result = _json_in(reply, r"\{" + _DOTS + r"\}", "LLM-proposed evaluation result is not in JSON format")
    if isinstance(result, Verdict):
        return result
    result = result if isinstance(result, dict) else {}
    raw = result.get("score")
    score = (float(raw) if isinstance(raw, (int, float)) and not isinstance(raw, bool)
             else js_number(raw) if isinstance(raw, str) and js_trim(raw) else math.nan)
    if not math.isfinite(score):
        return grader_fail(f"G-Eval result has invalid or missing score: {stringify(raw)}")
    if score < 0 or score > 10:
        return grader_fail(f"G-Eval result score {number_string(score)} is outside the expected 0-10 range")
    why = result.get("reason")
    if not isinstance(why, str) or not js_trim(why):
        return grader_fail(f"G-Eval result has invalid or missing reason: {stringify(why)}")
    return _verdict(score / 10 >= threshold, score / 10, why)


def _geval(a: Assertion, output: str, context: checks.Context, ask) -> Verdict:
    threshold = 0.7 if a.threshold is None else a.threshold
    criteria = a.value if isinstance(a.value, list) else [a.value]
    if not criteria:
        return _verdict(False, 0.0, "G-Eval assertion requires at least one criterion string in the value array.")
    results = []
    for n, c in enumerate(criteria, 1):
        r = _geval_one(c, a, output, context, ask, threshold)
        if r.failure:
            if isinstance(a.value, list):
                return grader_fail(f"G-Eval criterion {n}/{len(criteria)} ({stringify(c)}) failed: {r.reason}")
            return r
        results.append(r)
    score = sum(r.score for r in results) / len(results)
    return _verdict(score >= threshold, score, "\n\n".join(r.reason for r in results))


def _answer_relevance(a: Assertion, output: str, context: checks.Context, ask) -> Verdict:
    threshold = 0.5 if a.threshold is None else a.threshold
    query = context.vars.get("query") if isinstance(context.vars.get("query"), str) else context.prompt
    prompt = render_prompt(load_prompt(a.options.get("rubricPrompt"), default_prompt("answer-relevance.txt")),
                           {"answer": try_parse(output)})
    questions = []
    for _ in range(3):  # promptfoo asks three times; a greedy grader answers the same each time
        reply = ask(prompt)
        if not reply:
            return grader_fail("No output")
        questions.append(reply)
    embed = context.graders.embed
    target = embed(query)
    similarity = sum(cosine(target, embed(q)) for q in questions) / len(questions)
    passed = similarity >= threshold - 2.220446049250313e-16
    word = "greater" if passed else "less"
    return _verdict(passed, similarity, f"Relevance {similarity:.2f} is {word} than threshold {js_string(threshold)}")


def cosine(a: list[float], b: list[float]) -> float:
    """promptfoo's cosineSimilarity (0 for a zero vector)."""
    dot = sum(x * y for x, y in zip(a, b))
    na, nb = math.sqrt(sum(x * x for x in a)), math.sqrt(sum(y * y for y in b))
    return 0.0 if na == 0 or nb == 0 else dot / (na * nb)


def _lines(text: str) -> list[str]:
    """splitIntoSentences: the non-blank lines."""
    return [s for s in text.split("\n") if js_trim(s)]


def _context_recall(a: Assertion, output: str, context: checks.Context, ask) -> Verdict:
    threshold = 0.5 if a.threshold is None else a.threshold
    ctx = context.vars.get("context") or context.prompt
    vars_ = {**context.vars, "context": ctx, "groundTruth": a.value}
    reply = ask(render_prompt(load_prompt(a.options.get("rubricPrompt"), default_prompt("context-recall.txt")), vars_))
    if not reply:
        return grader_fail("No output")
    lines = [s for s in _lines(reply) if "[attributed]" in s.lower() or "[not attributed]" in s.lower()]
    if not lines:
        return grader_fail("Grader returned no [Attributed]/[Not Attributed] classifications")
    score = sum("[not attributed]" not in s.lower() and "[attributed]" in s.lower() for s in lines) / len(lines)
    passed = score >= threshold - 2.220446049250313e-16
    return _verdict(passed, score, f"Recall {score:.2f} is {'>=' if passed else '<'} {js_string(threshold)}")


def _sentences(text: str) -> list[str]:
    """splitTextIntoSentences: lines when there are several, else sentences; bare list markers dropped."""
    lines = _lines(text)
    units = lines if len(lines) > 1 else re.split(r"(?<=[.!?])\s+", text)
    return [js_trim(s) for s in units if js_trim(s) and not re.fullmatch(r"\d+[.)]", js_trim(s))]


def _context_relevance(a: Assertion, output: str, context: checks.Context, ask) -> Verdict:
    threshold = 0.5 if a.threshold is None else a.threshold
    query, ctx = _var(context, "query", "context-relevance"), _var(context, "context", "context-relevance")
    reply = ask(render_prompt(load_prompt(a.options.get("rubricPrompt"), default_prompt("context-relevance.txt")),
                              {"context": ctx, "query": query}))
    if not reply:
        return grader_fail("No output")
    segmented = len(_lines(ctx)) > 1
    units = _sentences(ctx)
    insufficient = "Insufficient Information" in reply
    relevant = [] if insufficient else list(dict.fromkeys((_lines if segmented else _sentences)(reply)))
    score = min(len(relevant), len(units)) / len(units) if units else 0.0

    def norm(s: str) -> str:
        return re.sub(r"\s+", " ", s.lower()).strip()
    if relevant and not any(norm(re.sub(r"^\s*(?:\d+[.)]|[-*])\s*", "", s)) in norm(ctx) for s in relevant):
        return grader_fail("Grader output does not quote the provided context")
    passed = score >= threshold - 2.220446049250313e-16
    return _verdict(passed, score, f"Context relevance {score:.2f} is {'>=' if passed else '<'} {js_string(threshold)}")


def _context_faithfulness(a: Assertion, output: str, context: checks.Context, ask) -> Verdict:
    threshold = 0.5 if a.threshold is None else a.threshold
    query, ctx = _var(context, "query", "context-faithfulness"), _var(context, "context", "context-faithfulness")
    rubric = a.options.get("rubricPrompt") or []
    custom = [r if isinstance(r, str) or r is None else r.get("content") for r in (list(rubric) + [None, None])[:2]]
    vars_ = {**context.vars, "question": query, "answer": try_parse(output)}
    reply = ask(render_prompt(load_prompt(custom[0], default_prompt("context-faithfulness-longform.txt")), vars_))
    if not reply:
        return grader_fail("No output")
    statements = _lines(reply)
    if not statements:
        return grader_fail("Could not extract context-faithfulness statements")
    reply = ask(render_prompt(load_prompt(custom[1], default_prompt("context-faithfulness-nli.txt")),
                              {**context.vars, "context": ctx, "statements": statements}))
    if not reply:
        return grader_fail("No output")
    final, verdicts = "final verdict for each statement in order:", js_trim(reply.lower())
    score, parsed = 0.0, False
    if final in verdicts:
        parts = [p for p in verdicts[verdicts.index(final) + len(final):].split(".") if js_trim(p)]
        if parts and all(re.search(r"\b(?:yes|no)\b", p) for p in parts):
            parsed = True
            score = 1 - (sum("yes" not in p for p in parts) + max(0, len(statements) - len(parts))) / len(statements)
    else:
        no, yes = verdicts.count("verdict: no"), verdicts.count("verdict: yes")
        if no + yes:
            parsed = True
            score = 1 - (no + max(0, len(statements) - no - yes)) / len(statements)
    if not parsed:
        return grader_fail("Could not parse context-faithfulness verdicts")
    score = min(1.0, max(0.0, score))
    passed = score >= threshold - 2.220446049250313e-16
    return _verdict(passed, score, f"Faithfulness {score:.2f} is {'>=' if passed else '<'} {js_string(threshold)}")


JUDGES: dict[str, Callable[..., Verdict]] = {
    "llm-rubric": _rubric, "model-graded-closedqa": _closedqa, "factuality": _factuality,
    "model-graded-factuality": _factuality, "g-eval": _geval, "answer-relevance": _answer_relevance,
    "context-recall": _context_recall, "context-relevance": _context_relevance, "context-faithfulness": _context_faithfulness,
}
