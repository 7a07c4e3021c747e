"""promptfoo configs as gatekeeper suites, read as promptfoo 0.123.1 reads them.

A suite is ``assertions/NAME.promptfoo.yaml`` (its one ``prompts`` entry becomes the stage prompt NAME)
or a gatekeeper suite with ``promptfoo: FILE`` (its own prompt; the config's tests are its cases). Tests
come inline, from ``file://`` YAML/JSON lists, or CSV rows with ``__expected`` columns; ``defaultTest``
vars and assertions merge in as promptfoo merges them, array vars expand into one case each, and
values are templated from the test's vars. An assertion gatekeeper cannot evaluate deterministically
is kept aside in ``Suite.skipped``: battery.load refuses it unless ``--skip-unsupported``.
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import re
from pathlib import Path
from typing import Any

from . import checks
from ..js import yaml as jsyaml, nunjucks
from ..errors import GatekeeperError
from ..js.value import js_string, js_trim
from ..workspace import Assertion, Case, Segment, Suite, read_text, read_yaml

SUFFIXES = (".promptfoo.yaml", ".promptfoo.yml")
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
# config keys that do not change what an assertion means
IGNORED_KEYS = {"description", "providers", "targets", "outputPath", "sharing", "env", "evaluateOptions",
                "commandLineOptions", "metadata", "tags", "writeLatestResults", "tracing", "derivedMetrics", "prompts"}
TEST_KEYS = {"description", "vars", "assert", "options", "threshold", "metadata", "provider", "providers", "prompts"}
ASSERTION_KEYS = {"type", "value", "threshold", "weight", "metric", "provider", "rubricPrompt", "config",
                  "transform", "contextTransform"}
CHANGES_OUTPUT = ("transform", "postprocess", "prefix", "suffix")  # test options that change what is graded
_CSV_EXPECTED = re.compile(r"^(not-)?(" + "|".join(re.escape(t) for t in PROMPTFOO_TYPES) + r")(?:\((\d+(?:\.\d+)?)\))?(?::([\s\S]*))?$")


def is_config(path: Path) -> bool:
    return path.name.endswith(SUFFIXES)


def _read(path: Path) -> dict:
    data = read_yaml(path, jsyaml.load)
    if not isinstance(data, dict):
        raise GatekeeperError(f"{path}: expected a promptfoo config (a mapping with 'tests', 'prompts', ...) at the top level")
    refused = {"scenarios": "list the tests themselves", "nunjucksFilters": "render the values in the config",
               "extensions": "hooks run JavaScript or Python", "redteam": "generate the tests first"}
    for key in data:
        if key in refused:
            raise GatekeeperError(f"{path}: field '{key}': not supported by gatekeeper ({refused[key]}); remove it")
        if key not in IGNORED_KEYS | {"tests", "defaultTest"}:
            raise GatekeeperError(f"{path}: field '{key}': not a promptfoo config key gatekeeper knows; remove it or check its spelling")
    return data


def _line(path: Path, needle: str) -> int | None:
    """The line of ``path`` where ``needle`` first appears, for messages about parsed values."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    at = text.find(needle)
    return text.count("\n", 0, at) + 1 if at >= 0 else None


def _file(ref: str, base: Path, within: Path) -> Path:
    """A ``file://`` reference relative to the config that holds it; missing is exit 2 naming where."""
    path = (base / ref[len("file://"):]).resolve()
    if not path.is_file():
        line = _line(within, ref)
        where = f"{within}" + (f", line {line}" if line else "")
        raise GatekeeperError(f"{where}: {ref} not found (relative to {base}); fix the path")
    return path


# --- tests ---------------------------------------------------------------------------------------


class _Test:
    """One promptfoo test before merging: its raw mapping and where it came from, for messages."""

    def __init__(self, raw: Any, where: str, csv_line: int | None = None):
        self.raw, self.where, self.csv_line = raw, where, csv_line


def _tests(config: dict, path: Path) -> list[_Test]:
    tests = config.get("tests", [{}])
    entries = tests if isinstance(tests, list) else [tests]
    out: list[_Test] = []
    for n, entry in enumerate(entries, 1):
        if isinstance(entry, str) and entry.startswith("file://") and any(c in entry for c in "*?["):
            matches = sorted(p for p in path.parent.glob(entry[len("file://"):]) if p.is_file())
            if not matches:
                raise GatekeeperError(f"{path}, line {_line(path, entry)}: {entry} matches no file (relative to {path.parent}); fix the pattern")
            out += [t for match in matches for t in _test_file(match, path)]
        elif isinstance(entry, str) and entry.startswith("file://"):
            out += _test_file(_file(entry, path.parent, path), path)
        elif isinstance(entry, dict):
            out.append(_Test(entry, f"{path}, test {n}"))
        else:
            raise GatekeeperError(f"{path}: field 'tests.{n - 1}': a test is a mapping or a file:// reference, not {entry!r}")
    if not out:
        raise GatekeeperError(f"{path}: field 'tests': no tests; add at least one")
    return out


def _test_file(path: Path, config: Path) -> list[_Test]:
    if path.suffix.lower() == ".csv":
        return _csv_tests(path)
    if path.suffix.lower() not in (".yaml", ".yml", ".json"):
        raise GatekeeperError(f"{config}: {path.name}: tests are read from YAML, JSON or CSV files; "
                              "gatekeeper runs no test generators (JavaScript, Python)")
    data = read_yaml(path, jsyaml.load)
    rows = data if isinstance(data, list) else [data]
    out = []
    for n, row in enumerate(rows, 1):
        if not isinstance(row, dict):
            raise GatekeeperError(f"{path}: test {n} is not a mapping; fix the file")
        out.append(_Test({**row, "description": row.get("description") or f"Row #{n}"}, f"{path}, test {n}"))
    return out


def _csv_tests(path: Path) -> list[_Test]:
    """promptfoo's testCaseFromCsvRow: columns are vars except __expected* (assertions), __description,
    __metric; a malformed __expected is exit 2 naming the file and line."""
    text = read_text(path).removeprefix("\ufeff")
    reader = csv.reader(io.StringIO(text, newline=""))
    try:
        header = [h.strip() for h in next(reader)]
    except StopIteration:
        raise GatekeeperError(f"{path}: empty CSV; add a header row and tests") from None
    except csv.Error as e:
        raise GatekeeperError(f"{path}, line 1: not valid CSV ({e}); fix the file") from None
    out = []
    line = reader.line_num + 1
    while True:
        try:
            row = next(reader)
        except StopIteration:
            break
        except csv.Error as e:
            raise GatekeeperError(f"{path}, line {line}: not valid CSV ({e}); fix the file") from None
        if len(row) != len(header):
            raise GatekeeperError(f"{path}, line {line}: {len(row)} fields, the header has {len(header)}; fix the row")
        where = f"{path}, line {line}"
        test: dict[str, Any] = {"vars": {}, "assert": []}
        for key, value in zip(header, row):
            if key.startswith("__expected"):
                if js_trim(value):
                    test["assert"].append(_from_string(js_trim(value), where))
            elif key == "__description":
                test["description"] = value
            elif key in ("__prefix", "__suffix", "__providerOutput"):
                raise GatekeeperError(f"{where}: column {key}: not supported by gatekeeper (it changes what is graded); remove it")
            elif key == "__metric":
                test["metric"] = value
            elif not key.startswith(("__metadata", "__config", "__threshold")):
                test["vars"][key] = value
        metric = test.pop("metric", None)
        for a in test["assert"]:
            a["metric"] = metric
        out.append(_Test(test, where, csv_line=line))
        line = reader.line_num + 1
    return out


def _from_string(expected: str, where: str) -> dict:
    """promptfoo's assertionFromString: ``type:value``, ``not-type:value`` or else ``equals`` the text."""
    if expected.startswith(("javascript:", "fn:", "eval:")) or re.match(r"file://.*\.(c|m)?(j|t)s(:|$)", expected):
        return {"type": "javascript", "value": expected}
    if expected.startswith(("grade:", "llm-rubric:")):
        return {"type": "llm-rubric", "value": expected}
    if expected.startswith("python:") or (expected.startswith("file://") and (expected.endswith(".py") or ".py:" in expected)):
        return {"type": "python", "value": expected}
    m = _CSV_EXPECTED.match(expected)
    if not m:
        return {"type": "equals", "value": expected}
    inverse, kind, _, value = m.groups()
    if kind in ("contains-all", "contains-any", "icontains-all", "icontains-any") and value:
        try:
            value = checks.comma_list(value)
        except checks.Refused as e:
            raise GatekeeperError(f"{where}: __expected {expected!r} is malformed: {e}") from None
    elif kind not in ("contains-json", "is-json") and value is not None:
        value = js_trim(value)
    return {"type": f"{inverse or ''}{kind}", "value": value}


# --- merging, vars, assertions -------------------------------------------------------------------


def _mapping(value: Any, where: str, field: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise GatekeeperError(f"{where}: field '{field}' must be a mapping (gatekeeper reads no vars files); fix it")
    return value


def _var_value(value: Any, base: Path, where: str) -> Any:
    if isinstance(value, str) and value.startswith("file://"):
        ref = value[len("file://"):]
        if any(c in ref for c in "*?[") or Path(ref).suffix.lower() in (
                ".js", ".mjs", ".cjs", ".ts", ".py", ".rb", ".yaml", ".yml", ".pdf", ".png", ".jpg", ".jpeg", ".gif", ".webp"):
            raise GatekeeperError(f"{where}: var {value!r}: gatekeeper reads a var from one text file, not a glob, "
                                  "script, YAML, PDF or image; put the text in a .txt file")
        path = (base / ref).resolve()
        if not path.is_file():
            raise GatekeeperError(f"{where}: var {value!r} not found (relative to {base}); fix the path")
        return js_trim(read_text(path))  # promptfoo trims a text var file
    return value


def _combinations(vars: dict, expand: bool) -> list[dict]:
    """promptfoo's generateVarCombinations: a var whose value is a list of strings gives one test per item."""
    keys = list(vars)
    choices = [vars[k] if expand and isinstance(vars[k], list) and vars[k] and isinstance(vars[k][0], str) else [vars[k]]
               for k in keys]
    return [dict(zip(keys, combo)) for combo in itertools.product(*choices)]


def _prompt_var(v: Any) -> str:
    return v if isinstance(v, str) else json.dumps(v, ensure_ascii=False, separators=(",", ":")) if isinstance(v, (dict, list)) else js_string(v)


def _assertion(raw: Any, vars: dict, config: Path, where: str) -> Assertion | str:
    """An Assertion gatekeeper checks, or why it cannot (a str, for Suite.skipped)."""
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
    for key in ("transform", "contextTransform"):
        if raw.get(key) is not None:
            return f"{kind}: '{key}' runs code on the output"
    if raw.get("weight") == 0:
        return f"{kind}: weight 0 (promptfoo passes it whatever the output)"
    value = raw.get("value")
    if isinstance(value, str) and (value.startswith("package:") or value.startswith("file://") and Path(
            value[len("file://"):].split(":")[0]).suffix.lower() not in (".txt", ".json", ".yaml", ".yml")):
        return f"{kind}: its value comes from a script ({value})"
    if isinstance(value, str) and value.startswith("file://"):  # promptfoo's processFileReference: not templated
        path = _file(value, config.parent, config)
        value = js_trim(read_text(path)) if path.suffix.lower() == ".txt" else read_yaml(path, jsyaml.load)
    else:
        try:
            value = nunjucks.render_value(value, vars)
        except ValueError as e:
            raise GatekeeperError(f"{where}: {e}; fix the value") from None
    if base_type in ("is-json", "contains-json") and checks.truthy(value):
        return f"{kind}: JSON schema validation (ajv) is not implemented in gatekeeper"
    metric = raw.get("metric")
    a = Assertion(type=kind, value=value, name=metric if isinstance(metric, str) else None)
    try:
        checks.prepare(a)
    except checks.Refused as e:
        raise GatekeeperError(f"{where}: {e}") from None
    return a


def _cases(config: dict, path: Path) -> tuple[list[Case], tuple[str, ...]]:
    default = config.get("defaultTest") or {}
    if isinstance(default, str) and default.startswith("file://"):
        default = read_yaml(_file(default, path.parent, path), jsyaml.load) or {}
    default = _mapping(default, str(path), "defaultTest")
    cases, skipped, seen = [], [], set()
    for n, test in enumerate(_tests(config, path), 1):
        raw = test.raw
        unknown = sorted(set(raw) - TEST_KEYS)
        if unknown:
            what = "not supported by gatekeeper" if unknown[0] in ("providerOutput", "assertScoringFunction") else "not a promptfoo test key"
            raise GatekeeperError(f"{test.where}: field '{unknown[0]}': {what}; remove it")
        options = {**_mapping(default.get("options"), str(path), "defaultTest.options"),
                   **_mapping(raw.get("options"), test.where, "options")}
        changes = [k for k in CHANGES_OUTPUT if options.get(k)]
        if changes:
            raise GatekeeperError(f"{test.where}: options.{changes[0]}: not supported by gatekeeper (it changes what is graded); remove it")
        vars = {**_mapping(default.get("vars"), str(path), "defaultTest.vars"), **_mapping(raw.get("vars"), test.where, "vars")}
        vars = {k: _var_value(v, path.parent, test.where) for k, v in vars.items()}
        asserts = [*([] if options.get("disableDefaultAsserts") is True else default.get("assert") or []), *(raw.get("assert") or [])]
        combos = _combinations(vars, not options.get("disableVarExpansion"))
        for k, combo in enumerate(combos, 1):
            base_id = str(raw.get("description") or f"test {n}") + (f" [{k}]" if len(combos) > 1 else "")
            case_id = base_id if base_id not in seen else f"{base_id} (test {n})"
            seen.add(case_id)
            kept = []
            for m, a in enumerate(asserts, 1):
                where = f"{test.where}" + (f" ({raw['description']})" if raw.get("description") and not test.csv_line else "") + f", assertion {m}"
                result = _assertion(a, combo, path, where)
                if isinstance(result, str):
                    skipped.append(f"{case_id}: assertion {m} ({result})")
                else:
                    kept.append(result)
            cases.append(Case(id=case_id, vars={k2: _prompt_var(v) for k2, v in combo.items()}, assert_=kept))
    return cases, tuple(skipped)


# --- the prompt ----------------------------------------------------------------------------------

_SIMPLE_VAR = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")


def _segment(role: str, text: str, where: str) -> Segment:
    from .partition import VAR

    literal = VAR.search(_SIMPLE_VAR.sub("", text))
    if literal:
        raise GatekeeperError(f"{where}: the prompt holds {literal.group()!r}, which gatekeeper would read as a var; "
                              "use a gatekeeper suite with 'promptfoo: FILE' and its own prompt")
    fields = _SIMPLE_VAR.sub(lambda m: "{" + m.group(1) + "}", text)
    if any(mark in fields for mark in nunjucks.MARKS):
        raise GatekeeperError(f"{where}: the prompt uses nunjucks beyond {{{{ var }}}} (tags, filters); "
                              "use a gatekeeper suite with 'promptfoo: FILE' and its own prompt")
    if role not in ("system", "user", "assistant"):
        raise GatekeeperError(f"{where}: prompt role {role!r}: use system, user or assistant")
    return Segment(role=role, static=fields == text, text=fields)


def _prompt(config: dict, path: Path) -> list[Segment]:
    prompts = config.get("prompts")
    entries = prompts if isinstance(prompts, list) else [prompts] if prompts is not None else []
    if len(entries) != 1:
        raise GatekeeperError(f"{path}: field 'prompts': gatekeeper maps one prompt onto the stage, found {len(entries)}; "
                              "keep one, or use a gatekeeper suite with 'promptfoo: FILE'")
    entry = entries[0]
    text = entry.get("raw") or entry.get("id") if isinstance(entry, dict) else entry
    if not isinstance(text, str):
        raise GatekeeperError(f"{path}: field 'prompts.0': a prompt is text, file://FILE or {{raw: TEXT}}")
    if text.startswith("file://"):
        file = _file(text, path.parent, path)
        if file.suffix.lower() not in (".txt", ".md", ".json", ".j2", ""):
            raise GatekeeperError(f"{path}: prompt {text}: gatekeeper reads text or JSON chat prompts, not scripts")
        text = read_text(file)
    try:
        messages = json.loads(text) if text.lstrip().startswith("[") else None
    except json.JSONDecodeError:
        messages = None
    where = f"{path}: field 'prompts.0'"
    if isinstance(messages, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
        return [_segment(m["role"], str(m["content"]), where) for m in messages]
    return [_segment("user", text, where)]


def load_suite(path: Path, root: Path) -> Suite:
    """``assertions/NAME.promptfoo.yaml``: suite and stage NAME, the config's prompt and tests."""
    name = path.name
    for suffix in SUFFIXES:
        name = name.removesuffix(suffix)
    config = _read(path)
    suite = Suite(suite=name, stage=name, prompt=_prompt(config, path), promptfoo=path.name, path=path)
    cases, skipped = _cases(config, path)
    return suite.model_copy(update={"cases": cases, "skipped": skipped})


def with_cases(suite: Suite, root: Path) -> Suite:
    """A gatekeeper suite with ``promptfoo: FILE``: its cases are FILE's tests (FILE relative to the suite's folder or the workspace)."""
    base = suite.path.parent if suite.path else root
    file = next((b / suite.promptfoo for b in (base, root) if (b / suite.promptfoo).is_file()), None)
    if file is None:
        raise GatekeeperError(f"{suite.path}: field 'promptfoo': {suite.promptfoo} not found (relative to the suite's folder or the workspace)")
    cases, skipped = _cases(_read(file), file)
    return suite.model_copy(update={"cases": cases, "skipped": skipped})
