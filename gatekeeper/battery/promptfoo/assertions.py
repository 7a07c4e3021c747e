"""One promptfoo assertion as gatekeeper checks it, or why it cannot (kept aside in ``Suite.skipped``).

A type gatekeeper evaluates is kept; one promptfoo has and gatekeeper cannot evaluate is set aside
(battery.read refuses it unless ``--skip-unsupported``), and one promptfoo does not know is exit 2. Its value
is templated from the test's vars or read from its ``file://`` file, the test's grading options go under its
own (promptfoo's getFinalTest), and a test's or an assertion's ``transform`` is kept on each assertion it feeds
(battery/transform.py runs it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...errors import GatekeeperError
from ...js import nunjucks
from ...js import yaml as jsyaml
from ...js.value import js_trim
from ...workspace import Assertion, read_text, read_yaml
from .. import checks
from .config import GRADING_OPTIONS, OUTPUT_TRANSFORMS
from .files import _file

# promptfoo's assertion types (BaseAssertionTypesSchema and the special ones), for telling a type
# gatekeeper cannot evaluate (skipped with --skip-unsupported) from one promptfoo does not know (exit 2)
PROMPTFOO_TYPES = (
    "agent-rubric answer-relevance bleu classifier contains contains-all contains-any contains-html contains-json "
    "contains-sql contains-xml context-faithfulness context-recall context-relevance conversation-relevance cost "
    "equals factuality finish-reason g-eval gleu guardrails icontains icontains-all icontains-any is-html is-json "
    "is-refusal is-sql is-valid-function-call is-valid-openai-function-call is-valid-openai-tools-call is-xml "
    "javascript latency levenshtein llm-rubric pi meteor model-graded-closedqa model-graded-factuality moderation "
    "perplexity perplexity-score python regex rouge-n ruby similar similar:cosine similar:dot similar:euclidean "
    "starts-with tool-call-f1 skill-used trajectory:goal-success trajectory:tool-args-match trajectory:step-count "
    "trajectory:tool-sequence trajectory:tool-used trace-error-spans trace-span-count trace-span-duration "
    "search-rubric webhook word-count").split()
SPECIAL_TYPES = ("select-best", "human", "max-score", "assert-set")
ASSERTION_KEYS = {"type", "value", "threshold", "weight", "metric", "provider", "rubricPrompt", "config",
                  "transform", "contextTransform"}


def _assertion(raw: Any, vars: dict, config: Path, where: str, grading: dict | None = None) -> Assertion | str:
    """An Assertion gatekeeper checks, or why it cannot (a str, for Suite.skipped). ``grading``: the test's
    grading options (provider, rubricPrompt, ...), which the assertion's own override (promptfoo's getFinalTest)."""
    if not isinstance(raw, dict) or not isinstance(raw.get("type"), str):
        raise GatekeeperError(f"{where}: an assertion is a mapping with a 'type'; fix {raw!r}")
    unknown = sorted(set(raw) - ASSERTION_KEYS - ({"assert"} if raw["type"] == "assert-set" else set()))
    if unknown:
        raise GatekeeperError(f"{where}: field '{unknown[0]}': not a promptfoo assertion key; remove it or check its spelling")
    kind = raw["type"]
    base_type = checks.base_type(kind)
    if base_type not in checks.SHARED and base_type not in checks.EVALUATED_BY:
        if base_type in PROMPTFOO_TYPES or kind in SPECIAL_TYPES:
            return f"{kind}: not deterministic or not implemented in gatekeeper"
        if kind in checks.GATEKEEPER_ONLY:
            raise GatekeeperError(f"{where}: type {kind!r} is gatekeeper's own, not promptfoo's; use it in a gatekeeper suite")
        raise GatekeeperError(f"{where}: unknown assertion type {kind!r} (promptfoo has no such type); fix it")
    if raw.get("contextTransform") is not None:
        return f"{kind}: 'contextTransform' runs code on the context"
    if raw.get("weight") == 0:
        return f"{kind}: weight 0 (promptfoo passes it whatever the output)"
    value = raw.get("value")
    script = base_type in ("javascript", "python") and isinstance(value, str) and value.startswith("file://")
    if not script and isinstance(value, str) and (value.startswith("package:") or value.startswith("file://") and Path(
            value[len("file://"):].split(":")[0]).suffix.lower() not in (".txt", ".json", ".yaml", ".yml")):
        return f"{kind}: its value comes from a script ({value})"
    if script:  # the script is the value: its path resolved against the config's folder, its function kept
        assert isinstance(value, str)  # script: a str value
        script_path, colon, function = value[len("file://"):].partition(":")
        value = f"file://{_file('file://' + script_path, config.parent, config)}{colon}{function}"
    elif isinstance(value, str) and value.startswith("file://"):  # promptfoo's processFileReference: not templated
        path = _file(value, config.parent, config)
        value = js_trim(read_text(path)) if path.suffix.lower() == ".txt" else read_yaml(path, jsyaml.load)
    else:
        try:
            value = nunjucks.render_value(value, vars)
        except ValueError as e:
            raise GatekeeperError(f"{where}: {e}; fix the value") from None
    metric, threshold = raw.get("metric"), raw.get("threshold")
    if threshold is not None and (not isinstance(threshold, (int, float)) or isinstance(threshold, bool)):
        raise GatekeeperError(f"{where}: field 'threshold' must be a number, not {threshold!r}; fix it")
    options = {}
    if base_type in checks.EVALUATED_BY:  # what a graded type reads; the assertion's own win
        options = {**{k: v for k, v in (grading or {}).items() if k in GRADING_OPTIONS and v is not None},
                   **{k: raw[k] for k in ("provider", "rubricPrompt", "config") if raw.get(k) is not None}}
        rubric = options.get("rubricPrompt")
        if isinstance(rubric, str) and rubric.startswith("file://") and Path(rubric).suffix.lower() not in (".js", ".cjs", ".mjs", ".ts", ".py"):
            options["rubricPrompt"] = read_text(_file(rubric, config.parent, config))  # its text enters the battery digest
    test_transform = next(((grading or {})[k] for k in OUTPUT_TRANSFORMS if (grading or {}).get(k)), None)
    for key, ref in (("output_transform", test_transform), ("transform", raw.get("transform"))):
        if ref is not None:
            options[key] = _transform(ref, config, where)
    a = Assertion(type=kind, value=value, name=metric if isinstance(metric, str) else None,
                  threshold=threshold if base_type in checks.EVALUATED_BY else None, options=options)
    try:
        checks.prepare(a)
    except checks.Refused as e:
        raise GatekeeperError(f"{where}: {e}") from None
    return a


def _transform(ref: Any, config: Path, where: str) -> str:
    """A transform as battery/transform.py runs it: inline JavaScript, or a file:// reference made absolute
    (relative to the config, as promptfoo resolves it); a bad one is exit 2."""
    from .. import transform

    if not isinstance(ref, str) or not js_trim(ref):
        raise GatekeeperError(f"{where}: field 'transform': JavaScript code or file://PATH[:function]; fix it")
    if ref.startswith("file://"):
        path, colon, function = ref[len("file://"):], "", ""
        if path.rfind(":") > 1:
            path, colon, function = path.rpartition(":")
        ref = f"file://{_file('file://' + path, config.parent, config)}{colon}{function}"
    try:
        transform.script(ref)
    except checks.Refused as e:
        raise GatekeeperError(f"{where}: {e}") from None
    return ref
