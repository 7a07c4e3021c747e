"""promptfoo configs as gatekeeper suites, read as promptfoo 0.123.1 reads them.

A config is ``assertions/NAME.promptfoo.yaml``, or any config a pointer suite names (``assertions/NAME.yaml``
holding ``suite: NAME`` and ``promptfoo: FOLDER/promptfooconfig.yaml``, no prompt). Each of its prompts
(battery/promptfoo_prompts.py) becomes its own suite and stage running every test its ``prompts:`` allows:
NAME alone for one prompt, NAME.LABEL for several. A gatekeeper suite with its own prompt and
``promptfoo: FILE`` takes only FILE's tests.

Tests come inline, from local YAML/JSON/JSONL/CSV files (CSV ``__expected`` columns), ``defaultTest``
merges in as promptfoo merges it, ``$ref`` pointers (``assertionTemplates``) are resolved, array vars and
globbed ``file://`` vars expand into one case each, values are templated from the test's vars, and a test's
or an assertion's ``transform`` is kept on each assertion it feeds (battery/transform.py runs it). Whatever promptfoo gives a
meaning gatekeeper cannot honour is refused (exit 2) naming the file, the field and the fix; an assertion
gatekeeper cannot evaluate is kept aside in ``Suite.skipped`` (battery.load refuses it unless
``--skip-unsupported``), and ``cost``/``latency`` (about the call, not the output) in ``Suite.call_metrics``.
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from . import checks
from ..js import yaml as jsyaml, nunjucks
from ..errors import GatekeeperError
from ..js.value import js_string, js_trim
from ..workspace import Assertion, Case, Decoding, Suite, read_text, read_yaml
from .promptfoo_prompts import SCRIPT_SUFFIXES, glob_files, has_magic, matches, read_prompts, warn

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
CALL_METRICS = {"cost": "what the call cost", "latency": "how long the call took"}  # not properties of the output
# top-level keys: read; silent (they choose or describe providers and reports, which the engine and the
# ledger replace); warned (promptfoo uses them, gatekeeper does not, what is graded stays the same);
# refused (they change what is graded and gatekeeper cannot honour them: the fix)
READ_KEYS = {"prompts", "tests", "defaultTest", "nunjucksFilters"}
SILENT_KEYS = {"description", "tags", "metadata", "providers", "targets", "outputPath", "sharing", "env",
               "writeLatestResults", "tracing", "assertionTemplates"}
WARNED_KEYS = {"evaluateOptions": "run settings (repeat, delay, concurrency); gatekeeper's own policy sets these",
               "commandLineOptions": "defaults for promptfoo's command line; gatekeeper has its own",
               "derivedMetrics": "metrics computed from assertion scores; gatekeeper records each assertion's outcome"}
REFUSED_KEYS = {"scenarios": "list the tests themselves under 'tests'",
                "extensions": "hooks run JavaScript or Python", "redteam": "generate the tests first ('promptfoo redteam generate')",
                "plugins": "generate the tests first ('promptfoo redteam generate')",
                "strategies": "generate the tests first ('promptfoo redteam generate')"}
TEST_KEYS = {"description", "vars", "assert", "options", "threshold", "metadata", "provider", "providers", "prompts"}
ASSERTION_KEYS = {"type", "value", "threshold", "weight", "metric", "provider", "rubricPrompt", "config",
                  "transform", "contextTransform"}
# test options: changing what is graded (refused), read (grading settings and expansion), and the rest promptfoo
# uses for running, not grading (ignored)
CHANGES_OUTPUT = ("prefix", "suffix", "transformVars", "storeOutputAs")
GRADING_OPTIONS = ("provider", "rubricPrompt", "factuality")
OUTPUT_TRANSFORMS = ("transform", "postprocess")  # promptfoo runs the first set on the output (battery/transform.py)
RUN_OPTIONS = {"disableVarExpansion", "disableDefaultAsserts", "disableConversationVar", "runSerially", "repeat"}
REMOTE = re.compile(r"^(https?|huggingface|hf|az|s3|gs)://", re.I)
_CSV_EXPECTED = re.compile(r"^(not-)?(" + "|".join(re.escape(t) for t in PROMPTFOO_TYPES) + r")(?:\((\d+(?:\.\d+)?)\))?(?::([\s\S]*))?$")


def is_config(path: Path) -> bool:
    return path.name.endswith(SUFFIXES)


def _read(path: Path) -> dict:
    """The config with its ``$ref`` pointers resolved; its top-level keys read, ignored, warned of or refused."""
    data = read_yaml(path, jsyaml.load)
    if not isinstance(data, dict):
        raise GatekeeperError(f"{path}: expected a promptfoo config (a mapping with 'tests', 'prompts', ...) at the top level")
    for key in data:
        if key in REFUSED_KEYS:
            raise GatekeeperError(f"{path}: field '{key}': not supported by gatekeeper; {REFUSED_KEYS[key]}, and remove it")
        if key in WARNED_KEYS:
            warn(str(path), f"field '{key}' is ignored: {WARNED_KEYS[key]}")
        elif key not in READ_KEYS | SILENT_KEYS:
            warn(str(path), f"field '{key}' is ignored: not a promptfoo config key (promptfoo ignores it too); check its spelling")
    providers = data.get("providers", data.get("targets"))
    if isinstance(providers, list) and any(isinstance(p, dict) and "prompts" in p for p in providers):
        warn(str(path), "a provider's 'prompts' is ignored: the engine profile replaces the providers, and it runs every prompt")
    return _deref(data, path)


def _deref(data: Any, path: Path) -> Any:
    """``{$ref: "#/a/b"}`` replaced by what the pointer names (its other keys merged over it), as promptfoo's
    json-schema-ref-parser does within one file; a reference to another file is refused."""

    def resolve(node: Any, trail: tuple[str, ...]) -> Any:
        if isinstance(node, list):
            return [resolve(v, trail) for v in node]
        if not isinstance(node, dict):
            return node
        ref = node.get("$ref")
        if not isinstance(ref, str):
            return {k: resolve(v, trail) for k, v in node.items()}
        if not ref.startswith("#"):
            raise GatekeeperError(f"{path}: $ref {ref!r}: gatekeeper resolves references within the file (#/...); "
                              "copy the referenced part into this file or load it with file://")
        if ref in trail:
            raise GatekeeperError(f"{path}: $ref {ref!r} refers to itself; fix the reference")
        target: Any = data
        for part in [unquote(p).replace("~1", "/").replace("~0", "~") for p in ref[1:].split("/")[1:]]:
            if isinstance(target, dict) and part in target:
                target = target[part]
            elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
                target = target[int(part)]
            else:
                raise GatekeeperError(f"{path}, line {_line(path, ref)}: $ref {ref!r}: no such entry in the file; fix the reference")
        target = resolve(target, (*trail, ref))
        extra = {k: resolve(v, trail) for k, v in node.items() if k != "$ref"}
        return {**target, **extra} if extra and isinstance(target, dict) else target

    return resolve(data, ())


def _line(path: Path, needle: str) -> int | None:
    """The line of ``path`` where ``needle`` first appears, for messages about parsed values."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    at = text.find(needle)
    return text.count("\n", 0, at) + 1 if at >= 0 else None


def _at(path: Path, needle: str) -> str:
    line = _line(path, needle)
    return f"{path}" + (f", line {line}" if line else "")


def _file(ref: str, base: Path, within: Path) -> Path:
    """A ``file://`` reference relative to the config that holds it; missing is exit 2 naming where."""
    path = (base / ref.removeprefix("file://")).resolve()
    if not path.is_file():
        raise GatekeeperError(f"{_at(within, ref)}: {ref} not found (relative to {base}); fix the path")
    return path


def _remote(ref: str, within: Path, field: str, fix: str) -> None:
    if REMOTE.match(ref):
        raise GatekeeperError(f"{_at(within, ref)}: field '{field}': {ref} is fetched over the network, which gatekeeper "
                              f"does not do (evidence must not depend on what a server returns today); {fix}")


# --- tests ---------------------------------------------------------------------------------------


class _Test:
    """One promptfoo test before merging: its raw mapping, where it came from (for messages) and the folder
    its ``file://`` vars are relative to (the file that holds it, as promptfoo reads them)."""

    def __init__(self, raw: Any, where: str, csv_line: int | None = None, base: Path | None = None):
        self.raw, self.where, self.csv_line, self.base = raw, where, csv_line, base


TESTS_FIX = "export the tests to a CSV, YAML or JSON file beside the config and point 'tests:' at it"


def _tests(config: dict, path: Path) -> list[_Test]:
    tests = config.get("tests", [{}])
    entries = tests if isinstance(tests, list) else [tests]
    out: list[_Test] = []
    for n, entry in enumerate(entries, 1):
        if isinstance(entry, dict) and isinstance(entry.get("path"), str) and not set(entry) & {"vars", "assert"}:
            if entry.get("config") is not None:  # promptfoo's TestGeneratorConfig
                raise GatekeeperError(f"{path}: field 'tests.{n - 1}.config': tests generated with a config are not supported; {TESTS_FIX}")
            entry = entry["path"]
        if isinstance(entry, str):
            out += [t for file in _test_files(entry, path, f"tests.{n - 1}" if isinstance(tests, list) else "tests")
                    for t in _test_file(file, path)]
        elif isinstance(entry, dict):
            out.append(_Test(entry, f"{path}, test {n}", base=path.parent))
        else:
            raise GatekeeperError(f"{path}: field 'tests.{n - 1}': a test is a mapping or a file reference, not {entry!r}")
    if not out:
        raise GatekeeperError(f"{path}: field 'tests': no tests; add at least one")
    return out


def _test_files(ref: str, path: Path, field: str) -> list[Path]:
    """The local files a ``tests`` string names (``file://`` optional, as in promptfoo; a glob matches several)."""
    _remote(ref, path, field, TESTS_FIX)
    local = ref.removeprefix("file://")
    name = local.split("#")[0]
    if name.lower().endswith(SCRIPT_SUFFIXES) or re.search(r"\.(c|m)?[jt]s:|\.py:", local):
        raise GatekeeperError(f"{_at(path, ref)}: field '{field}': {ref} generates tests by running code, which gatekeeper "
                              f"does not do; {TESTS_FIX}")
    if name.lower().endswith((".xlsx", ".xls")):
        raise GatekeeperError(f"{_at(path, ref)}: field '{field}': {ref}: gatekeeper reads no spreadsheets; save it as CSV "
                              "and point 'tests:' at the CSV file")
    if has_magic(local):
        matches = glob_files(path.parent, local)
        if not matches:
            raise GatekeeperError(f"{_at(path, ref)}: {ref} matches no file (relative to {path.parent}); fix the pattern")
        return matches
    return [_file(ref, path.parent, path)]


def _test_file(path: Path, config: Path) -> list[_Test]:
    suffix = path.suffix.lower()
    if suffix == ".csv":
        return _csv_tests(path)
    if suffix == ".jsonl":
        rows = []
        for n, line in enumerate(read_text(path).splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise GatekeeperError(f"{path}, line {n}: not JSON ({e.msg}); fix the line") from None
    elif suffix in (".yaml", ".yml", ".json"):
        data = _deref(read_yaml(path, jsyaml.load), path)
        rows = data if isinstance(data, list) else [data]
    else:
        raise GatekeeperError(f"{config}: {path.name}: tests are read from YAML, JSON, JSONL or CSV files; "
                              "gatekeeper runs no test generators (JavaScript, Python)")
    out = []
    for n, row in enumerate(rows, 1):
        if not isinstance(row, dict):
            raise GatekeeperError(f"{path}: test {n} is not a mapping; fix the file")
        out.append(_Test({**row, "description": row.get("description") or f"Row #{n}"}, f"{path}, test {n}", base=path.parent))
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
        configs: dict[int, float] = {}
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
            elif key.startswith("__config:"):
                index, threshold = _csv_config(key, value, where)
                configs[index] = threshold
            elif not key.startswith(("__metadata", "__threshold")):
                test["vars"][key] = value
        metric = test.pop("metric", None)
        for n, a in enumerate(test["assert"]):
            a["metric"] = metric
            if n in configs:  # counted over the non-empty __expected cells, as promptfoo counts them
                a["threshold"] = configs[n]
        out.append(_Test(test, where, csv_line=line, base=path.parent))
        line = reader.line_num + 1
    return out


_FINITE = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")


def _csv_config(key: str, value: str, where: str) -> tuple[int, float]:
    """A ``__config:__expected<N>:threshold`` column: the index of the assertion it sets, and the threshold."""
    parts = key[len("__config:"):].split(":")
    m = re.fullmatch(r"__expected(\d*)", parts[0]) if len(parts) == 2 else None
    if not m or m.group(1) and int(m.group(1)) < 1 or parts[1] != "threshold":
        raise GatekeeperError(f"{where}: column {key}: write __config:__expected:threshold or __config:__expected<N>:threshold")
    number = float(js_trim(value)) if _FINITE.fullmatch(js_trim(value)) else math.nan
    if not math.isfinite(number):
        raise GatekeeperError(f"{where}: column {key}: {value!r} is not a number; write the threshold, e.g. 0.8")
    return (int(m.group(1)) - 1 if m.group(1) else 0), number


def _from_string(expected: str, where: str) -> dict:
    """promptfoo's assertionFromString: ``type:value``, ``not-type:value`` or else ``equals`` the text."""
    if expected.startswith(("javascript:", "fn:", "eval:")) or re.fullmatch(r"file://.*\.[cm]?[jt]s", expected, re.I | re.S):
        prefix = next((p for p in ("javascript:", "fn:", "eval:") if expected.startswith(p)), "")
        return {"type": "javascript", "value": js_trim(expected[len(prefix):])}
    if expected.startswith(("grade:", "llm-rubric:")):
        return {"type": "llm-rubric", "value": expected}
    if expected.startswith("python:"):
        return {"type": "python", "value": js_trim(expected[len("python:"):])}
    if expected.startswith("file://") and (expected.endswith(".py") or ".py:" in expected):
        raise GatekeeperError(f"{where}: __expected {expected!r}: promptfoo reads it as the Python code "
                              f"{expected[len('file://'):]!r} (it drops only 'file://'), which never passes; "
                              f"write 'python:{expected}' to run the file")
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


_VAR_CODE_OR_DATA = (".js", ".mjs", ".cjs", ".ts", ".py", ".rb", ".yaml", ".yml", ".pdf", ".png", ".jpg", ".jpeg", ".gif", ".webp")


def _var_value(value: Any, base: Path, where: str, expand: bool = True) -> Any:
    """A ``file://`` var read as promptfoo reads it: the file's text, trimmed; a glob (with var expansion on)
    is the list of its files' texts, one case each (promptfoo's generateVarCombinations)."""
    if not (isinstance(value, str) and value.startswith("file://")):
        return value
    ref = value[len("file://"):]
    if has_magic(ref) and expand:
        files = glob_files(base, ref)
        if not files:
            raise GatekeeperError(f"{where}: var {value!r} matches no file (relative to {base}); fix the pattern")
        texts = [_var_file(f, value, where) for f in files]
        return texts if len(texts) > 1 else texts[0]
    if has_magic(ref) or Path(ref).suffix.lower() in _VAR_CODE_OR_DATA:
        raise GatekeeperError(f"{where}: var {value!r}: gatekeeper reads a var from text files, not a script, YAML, PDF or "
                              "image" + (", and a glob only with var expansion on" if has_magic(ref) else "")
                              + "; put the text in a .txt file")
    path = (base / ref).resolve()
    if not path.is_file():
        raise GatekeeperError(f"{where}: var {value!r} not found (relative to {base}); fix the path")
    return js_trim(read_text(path))  # promptfoo trims a text var file


def _var_file(path: Path, value: str, where: str) -> str:
    if path.suffix.lower() in _VAR_CODE_OR_DATA:
        raise GatekeeperError(f"{where}: var {value!r} matches {path.name}: gatekeeper reads a var from text files, not a "
                              "script, YAML, PDF or image; narrow the pattern to text files")
    return js_trim(read_text(path))


def _combinations(vars: dict, expand: bool) -> list[dict]:
    """promptfoo's generateVarCombinations: a var whose value is a list of strings gives one test per item."""
    keys = list(vars)
    choices = [vars[k] if expand and isinstance(vars[k], list) and vars[k] and isinstance(vars[k][0], str) else [vars[k]]
               for k in keys]
    return [dict(zip(keys, combo)) for combo in itertools.product(*choices)]


def _prompt_var(v: Any) -> str:
    return v if isinstance(v, str) else json.dumps(v, ensure_ascii=False, separators=(",", ":")) if isinstance(v, (dict, list)) else js_string(v)


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
        path, colon, function = value[len("file://"):].partition(":")
        value = f"file://{_file('file://' + path, config.parent, config)}{colon}{function}"
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
    test_transform = next((grading[k] for k in OUTPUT_TRANSFORMS if (grading or {}).get(k)), None)
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
    from . import transform

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


@dataclass(frozen=True)
class _Cases:
    """A test's cases and what was left out of them, with the prompts it runs on (None: all)."""

    cases: list[Case]
    skipped: list[str]
    call_metrics: list[str]
    prompts: list[str] | None


def _default_test(config: dict, path: Path) -> dict:
    default = config.get("defaultTest") or {}
    if isinstance(default, str):
        if not default.startswith("file://"):
            raise GatekeeperError(f"{path}: field 'defaultTest': a string must be a file:// reference (promptfoo's rule); fix it")
        file = _file(default, path.parent, path)
        default = _deref(read_yaml(file, jsyaml.load), file) or {}
    default = _mapping(default, str(path), "defaultTest")
    _test_keys(default, f"{path}: defaultTest", set(TEST_KEYS) - {"description"})
    return default


def _test_keys(raw: dict, where: str, allowed: set[str]) -> None:
    for key in sorted(set(raw) - allowed):
        if key == "assertScoringFunction":
            raise GatekeeperError(f"{where}: field 'assertScoringFunction': not supported by gatekeeper (a JavaScript or "
                                  "Python function scores the test); remove it")
        if key == "providerOutput":
            raise GatekeeperError(f"{where}: field 'providerOutput': not supported by gatekeeper (a fixed output, no model "
                                  "runs); remove it")
        raise GatekeeperError(f"{where}: field '{key}': not a promptfoo test key; remove it or check its spelling")


def _options(default: dict, raw: dict, path: Path, test: _Test) -> dict:
    """The test's options over defaultTest's; one that changes what is graded is refused, naming where it was set."""
    own = _mapping(raw.get("options"), test.where, "options")
    merged = {**_mapping(default.get("options"), str(path), "defaultTest.options"), **own}
    for key in merged:
        where = test.where if key in own else f"{path}: defaultTest (applies to every test)"
        if key in CHANGES_OUTPUT and merged[key] is not None:
            raise GatekeeperError(f"{where}: field 'options.{key}': not supported by gatekeeper (it changes what is "
                                  "rendered or graded); remove it")
        if key not in CHANGES_OUTPUT + GRADING_OPTIONS + OUTPUT_TRANSFORMS and key not in RUN_OPTIONS:
            warn(where, f"field 'options.{key}' is ignored: not a promptfoo test "
                        "option (promptfoo ignores it too); check its spelling")
    return merged


def _cases(config: dict, path: Path) -> tuple[list[Case], tuple[str, ...]]:
    """The config's cases in test order and the assertions left out of them."""
    per_test = _test_cases(config, path)
    return [c for t in per_test for c in t.cases], tuple(s for t in per_test for s in t.skipped)


def _test_cases(config: dict, path: Path) -> list[_Cases]:
    default = _default_test(config, path)
    out, seen = [], set()
    for n, test in enumerate(_tests(config, path), 1):
        raw = test.raw
        _test_keys(raw, test.where, TEST_KEYS)
        options = _options(default, raw, path, test)
        vars = {**_mapping(default.get("vars"), str(path), "defaultTest.vars"), **_mapping(raw.get("vars"), test.where, "vars")}
        expand = not options.get("disableVarExpansion")
        vars = {k: _var_value(v, test.base or path.parent, test.where, expand) for k, v in vars.items()}
        own = raw.get("assert") or []
        defaults = [] if options.get("disableDefaultAsserts") is True else default.get("assert") or []
        prompts = raw.get("prompts", default.get("prompts"))
        if prompts is not None and not (isinstance(prompts, list) and all(isinstance(p, str) for p in prompts)):
            raise GatekeeperError(f"{test.where}: field 'prompts' must be a list of prompt labels; fix it")
        combos = _combinations(vars, expand)
        cases, skipped, call_metrics = [], [], []
        for k, combo in enumerate(combos, 1):
            combo = nunjucks.prompt_vars(combo)  # promptfoo's renderPrompt prepares the vars its assertions see too
            base_id = str(raw.get("description") or f"test {n}") + (f" [{k}]" if len(combos) > 1 else "")
            case_id = base_id if base_id not in seen else f"{base_id} (test {n})"
            seen.add(case_id)
            kept = []
            for m, a in enumerate([*defaults, *own], 1):
                if m <= len(defaults):
                    where = f"{path}: defaultTest, assertion {m} (in {test.where.removeprefix(str(path) + ', ')})"
                else:
                    label = f" ({raw['description']})" if raw.get("description") and not test.csv_line else ""
                    where = f"{test.where}{label}, assertion {m - len(defaults)}"
                kind = a.get("type") if isinstance(a, dict) else None
                if isinstance(kind, str) and checks.base_type(kind) in CALL_METRICS:
                    call_metrics.append(f"{case_id}: assertion {m} ({kind}: {CALL_METRICS[checks.base_type(kind)]}, "
                                        "not a property of the output, which is what gatekeeper compares)")
                    continue
                result = _assertion(a, combo, path, where, options)
                if isinstance(result, str):
                    skipped.append(f"{case_id}: assertion {m} ({result})")
                else:
                    kept.append(result)
            cases.append(Case(id=case_id, vars={k2: _prompt_var(v) for k2, v in combo.items()}, assert_=kept))
        out.append(_Cases(cases, skipped, call_metrics, prompts))
    return out


# --- suites --------------------------------------------------------------------------------------


def config_name(path: Path) -> str:
    name = path.name
    for suffix in SUFFIXES:
        name = name.removesuffix(suffix)
    return name


def load_suites(path: Path, name: str, shown: str | None = None, decoding: Decoding | None = None) -> list[Suite]:
    """A config's suites: one per prompt, running every test the prompt is selected for. One prompt makes
    suite and stage ``name``; several make ``name.LABEL`` each (the label as a name, made unique).
    ``shown``: how the config is named in the suite (its file name, or a pointer's ``promptfoo:``)."""
    from . import promptfoo_prompts as pp

    config = _read(path)
    prompts = read_prompts(config, path)
    tests = _test_cases(config, path)
    custom = pp.custom_filters(config, path)
    # the raw tests, aligned with ``tests``: a template must see each var as promptfoo passes it
    raw_tests = _tests(config, path) if any(pp.template_vars(p) for p in prompts) else []
    default = _default_test(config, path) if raw_tests else {}
    for t in tests:
        for ref in t.prompts or []:
            if not any(matches(ref, p) for p in prompts):
                labels = ", ".join(sorted({repr(n[:60]) for p in prompts for n in (p.label, p.id) if n}))
                raise GatekeeperError(f"{_at(path, ref)}: a test's 'prompts' names {ref!r}, which is no prompt's label or id "
                                      f"(labels: {labels}); fix the name")
    parts = _unique([p.name for p in prompts])
    suites = []
    for prompt, part in zip(prompts, parts):
        chosen = [t for t in tests if t.prompts is None or any(matches(r, prompt) for r in t.prompts)]
        suite_name = name if len(prompts) == 1 else f"{name}.{part}"
        if not chosen:
            warn(str(path), f"prompt {suite_name!r} runs no test (each test's 'prompts' names another), so nothing gates it")
            continue
        read = pp.template_vars(prompt)
        for test, t in zip(raw_tests, tests) if read else ():
            if not any(t is c for c in chosen):
                continue
            own = _mapping(test.raw.get("vars"), test.where, "vars")
            vars = {**_mapping(default.get("vars"), str(path), "defaultTest.vars"), **own}
            expand = not {**_mapping(default.get("options"), str(path), "defaultTest.options"),
                          **_mapping(test.raw.get("options"), test.where, "options")}.get("disableVarExpansion")
            for var in sorted(read & set(vars)):
                value = _var_value(vars[var], test.base or path.parent, test.where, expand)
                if not pp.is_text_var(value, expand):
                    where = test.where if var in own else f"{path}: defaultTest (applies to {test.where.removeprefix(str(path) + ', ')})"
                    raise GatekeeperError(f"{where}: field 'vars.{var}': {json.dumps(value, ensure_ascii=False)[:60]} is not text, "
                                          f"and the prompt ({prompt.where.removeprefix(str(path) + ': ')}) reads it with nunjucks, "
                                          "where promptfoo sees the value itself and gatekeeper its text; quote it so that it is "
                                          "text, or write a list or mapping as JSON text and read it with '| load' in the prompt")
            for case in t.cases:
                var = pp.var_template(prompt, case.vars)
                if var is not None:
                    raise GatekeeperError(f"{test.where}: field 'vars.{var}' (case {case.id!r}) holds nunjucks, which promptfoo "
                                          "renders before it fills the text prompt in, and gatekeeper does not; write out "
                                          "the text the var should be")
        suite = Suite(suite=suite_name, stage=suite_name, prompt=prompt.segments, promptfoo=shown or path.name, path=path,
                      decoding=decoding or Decoding(), filters=pp.prompt_filters(prompt, custom, config))
        suites.append(suite.model_copy(update={
            "cases": [c for t in chosen for c in t.cases], "skipped": tuple(s for t in chosen for s in t.skipped),
            "call_metrics": tuple(s for t in chosen for s in t.call_metrics)}))
    return suites


def _unique(names: list[str]) -> list[str]:
    out: list[str] = []
    for name in names:
        candidate, k = name, 2
        while candidate in out:
            candidate, k = f"{name}-{k}", k + 1
        out.append(candidate)
    return out


def with_cases(suite: Suite, root: Path) -> Suite:
    """A gatekeeper suite with its own prompt and ``promptfoo: FILE``: its cases are FILE's tests."""
    file = config_file(suite.promptfoo, suite.path, root)
    per_test = _test_cases(_read(file), file)
    return suite.model_copy(update={"cases": [c for t in per_test for c in t.cases],
                                    "skipped": tuple(s for t in per_test for s in t.skipped),
                                    "call_metrics": tuple(s for t in per_test for s in t.call_metrics)})


def config_file(ref: str, suite_path: Path | None, root: Path) -> Path:
    """``promptfoo: FILE`` relative to the suite's folder or the workspace."""
    base = suite_path.parent if suite_path else root
    file = next((b / ref for b in (base, root) if (b / ref).is_file()), None)
    if file is None:
        raise GatekeeperError(f"{suite_path}: field 'promptfoo': {ref} not found (relative to the suite's folder or the workspace); fix the path")
    return file


POINTER_KEYS = {"suite", "promptfoo", "decoding"}


def pointed(path: Path, data: dict, root: Path) -> list[Suite]:
    """``assertions/NAME.yaml`` holding ``suite: NAME`` and ``promptfoo: FOLDER/promptfooconfig.yaml`` and no
    prompt: the config's own prompts and tests, as the suites NAME (one prompt) or NAME.LABEL (several)."""
    for key in data:
        if key not in POINTER_KEYS:
            fix = ("each of the config's prompts is its own stage, named after the suite; remove it" if key == "stage"
                   else "remove it, or give the suite its own 'prompt' (then only the config's tests are read)")
            raise GatekeeperError(f"{path}: field '{key}': a suite that takes its prompts from a promptfoo config holds "
                                  f"only {', '.join(sorted(POINTER_KEYS))}; {fix}")
    name, ref = data.get("suite"), data.get("promptfoo")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", name):
        raise GatekeeperError(f"{path}: field 'suite': required, a name of letters, digits, '_', '-' and '.'; fix it")
    if not isinstance(ref, str):
        raise GatekeeperError(f"{path}: field 'promptfoo': the path of a promptfoo config; fix it")
    try:
        decoding = Decoding.model_validate(data.get("decoding") or {})
    except ValueError as e:
        raise GatekeeperError(f"{path}: field 'decoding': {e}") from None
    return load_suites(config_file(ref, path, root), name, ref, decoding)


def referenced(path: Path, config: dict | None = None) -> set[Path]:
    """The local files a config reads (tests, prompts, vars, values), so that files kept beside a config in
    assertions/ are not taken for suites."""
    data = config if config is not None else read_yaml(path, jsyaml.load)
    out: set[Path] = set()

    def add(ref: str) -> None:
        local = ref.removeprefix("file://").split("#")[0]
        if "\n" in local or REMOTE.match(local) or not local:
            return
        out.update(m.resolve() for m in (glob_files(path.parent, local) if has_magic(local) else [path.parent / local]) if m.is_file())

    def walk(node: Any, bare: bool) -> None:
        if isinstance(node, str) and (bare or node.startswith("file://")):
            add(node)
        elif isinstance(node, dict):
            for k, v in node.items():
                walk(k, bare), walk(v, bare and k in ("id", "raw", "path"))
        elif isinstance(node, list):
            for v in node:
                walk(v, bare)

    if isinstance(data, dict):
        walk({k: v for k, v in data.items() if k not in ("prompts", "tests")}, False)
        walk(data.get("prompts"), True)
        walk(data.get("tests"), True)
    return out
