"""Where a promptfoo config's tests come from: inline, or local YAML, JSON, JSONL and CSV files (a glob naming several).

Each test is kept as written, with where it came from (for messages) and the folder its ``file://`` vars are
relative to (the file that holds it, as promptfoo reads them); a CSV row is read as promptfoo's
testCaseFromCsvRow reads it (columns are vars, ``__expected`` columns assertions, as promptfoo's
assertionFromString reads them). Tests made by running code, fetched over the network or kept in a spreadsheet
are refused, naming the fix.
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
from pathlib import Path
from typing import Any

from ...errors import GatekeeperError
from ...js import yaml as jsyaml
from ...js.value import js_trim
from ...workspace import read_text, read_yaml
from .. import checks
from .assertions import PROMPTFOO_TYPES
from .config import _deref
from .files import SCRIPT_SUFFIXES, _at, _file, _remote, glob_files, has_magic

_CSV_EXPECTED = re.compile(r"^(not-)?(" + "|".join(re.escape(t) for t in PROMPTFOO_TYPES) + r")(?:\((\d+(?:\.\d+)?)\))?(?::([\s\S]*))?$")


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
