"""The assertion battery: selected suites and cases, validated before anything runs.

Assertion values are templated from the case's vars here (``{{ var }}``, as promptfoo does); promptfoo
suites arrive templated already, from their typed vars. A promptfoo assertion gatekeeper cannot
evaluate stops the load (exit 2), in any case of the chosen suites whatever ``--limit`` runs, unless the
workspace skips them (``evaluate --skip-unsupported``); the skipped ones are then listed in the evaluation's
reasons (``skipped:``), as are ``cost`` and ``latency`` assertions, which are always left out.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any
from weakref import WeakKeyDictionary

from ..errors import GatekeeperError
from ..identity import digest, sha256_hex
from ..js import nunjucks
from ..workspace import ASSERTIONS, Case, Suite, Workspace, parse, read_yaml
from . import promptfoo
from .checks import validate_suite
from .partition import missing_vars

_SUITES: WeakKeyDictionary = WeakKeyDictionary()


def all_suites(ws: Workspace) -> dict[str, Suite]:
    """The workspace's suites by name, each read once: gatekeeper YAML suites and promptfoo configs alike."""
    if ws not in _SUITES:
        _SUITES[ws] = _read(ws)
    return _SUITES[ws]


def _read(ws: Workspace) -> dict[str, Suite]:
    """``assertions/*.yaml``: promptfoo configs (``*.promptfoo.yaml``), suites that point at one (``promptfoo:``),
    and gatekeeper suites; a file a promptfoo config reads (its tests beside it) is none of them."""
    configs: list[tuple[Path, Any]] = []
    pointers: list[tuple[Path, Any]] = []
    rest: list[tuple[Path, Any]] = []
    for path in ws.files(ASSERTIONS):
        data = None if promptfoo.is_config(path) else read_yaml(path)
        (configs if data is None else pointers if isinstance(data, dict) and "promptfoo" in data else rest).append((path, data))
    found: list[Suite] = []
    used: set[Path] = set()
    for path, _ in configs:
        found += promptfoo.load_suites(path, promptfoo.config_name(path))
        used |= promptfoo.referenced(path)
    for path, data in pointers:
        if "prompt" in data:  # its own prompt: only the config's tests are read
            found.append(promptfoo.with_cases(parse(Suite, path, path=path), ws.root))
        else:
            found += promptfoo.pointed(path, data, ws.root)
        config = promptfoo.config_file(data["promptfoo"], path, ws.root)
        used |= {config.resolve(), *promptfoo.referenced(config)}
    found += [parse(Suite, path, path=path) for path, _ in rest if path.resolve() not in used]
    out: dict[str, Suite] = {}
    for suite in found:
        assert suite.path is not None  # each was read from a file
        path = suite.path
        if suite.suite in out:
            raise GatekeeperError(f"{path}: suite {suite.suite!r} is already defined by {out[suite.suite].path}; rename one"
                                  + (" (a promptfoo config's suites are named after it and its prompts' labels)" if suite.promptfoo else ""))
        for seg_no, seg in enumerate(suite.prompt):
            if seg.file and not (path.parent / seg.file).is_file() and not (ws.root / seg.file).is_file():
                raise GatekeeperError(f"{path}: field 'prompt.{seg_no}.file': {seg.file} not found (relative to the workspace or the suite's folder)")
        out[suite.suite] = suite
    if not out:
        raise GatekeeperError(f"{ws.root / ASSERTIONS}: no suites (*.yaml); add one or run 'gatekeeper init'")
    return out


@dataclass(frozen=True)
class Item:
    """One case to run; under sampled decoding with several ``samples``, one sample of it (its own draws)."""

    suite: Suite
    case: Case
    sample: int = 0  # 0-based; a key of every draw, beside the seed and the case

    @property
    def case_key(self) -> str:
        """The case, whatever the sample: what its samples share (their cluster, the key of their draws)."""
        return f"{self.suite.suite}/{self.case.id}"

    @property
    def case_id(self) -> str:
        """What results are recorded under: the case, and ``~N`` (1-based) where a suite samples it several times."""
        return self.case_key + (f"~{self.sample + 1}" if self.suite.decoding.samples > 1 else "")


def read(ws: Workspace, suites: list[str] | None = None, limit: int | None = None, *,
         skip_unsupported: bool = False) -> list[Item]:
    """Cases of the chosen suites in file order; ``limit`` caps the cases per suite; ``skip_unsupported``
    leaves out promptfoo assertions gatekeeper cannot evaluate instead of refusing them."""
    available = all_suites(ws)
    chosen = suites or list(available)
    unknown = [s for s in chosen if s not in available]
    if unknown:
        raise GatekeeperError(f"unknown suite {unknown[0]!r} (suites in {ws.root / 'assertions'}: {', '.join(available)}); fix --suite")
    rendered = {name: _templated(available[name]) for name in chosen}
    problems = [p for name in chosen for p in rendered[name][1] + validate_suite(rendered[name][0]) + missing_vars(available[name])]
    if problems:
        where = ", ".join(str(available[n].path) for n in chosen)
        raise GatekeeperError(f"battery invalid ({where}):\n  " + "\n  ".join(problems))
    if limit is not None and limit < 1:
        raise GatekeeperError("--limit must be at least 1")
    # every case of the chosen suites is checked, whatever --limit runs: a clean run means the suites load
    unsupported = list(dict.fromkeys(f"{available[name].path}: {s}" for name in chosen for s in available[name].skipped))
    if unsupported and not skip_unsupported:
        raise GatekeeperError("promptfoo assertions gatekeeper cannot evaluate deterministically:\n  " + "\n  ".join(unsupported)
                              + "\nremove them, or pass --skip-unsupported to evaluate without them")
    return [Item(available[name], case, k) for name in chosen for case in rendered[name][0].cases[:limit]
            for k in range(available[name].decoding.samples)]


def skipped(items: list[Item]) -> list[str]:
    """``skipped:`` reasons: the promptfoo assertions of these cases that were left out (cost and latency always)."""
    ids = {(i.suite.suite, i.case.id) for i in items}
    suites = {i.suite.suite: i.suite for i in items}
    return [f"skipped: {name}/{s}" for name, suite in suites.items() for s in (*suite.skipped, *suite.call_metrics)
            if (name, s.split(": assertion ")[0]) in ids]


def _templated(suite: Suite) -> tuple[Suite, list[str]]:
    """The suite with each case's assertion values rendered from its vars (the last turn's win), and problems."""
    if suite.promptfoo is not None:
        return suite, []
    cases, problems = [], []
    for case in suite.cases:
        vars = {**case.vars, **{k: v for turn in case.turns for k, v in turn.items()}}
        asserts = []
        for n, a in enumerate(case.assert_, 1):
            try:
                asserts.append(a.model_copy(update={"value": nunjucks.render_value(a.value, vars)}))
            except ValueError as e:
                problems.append(f"suite {suite.suite!r}, case {case.id!r}, assertion {n} ({a.name or a.type}): {e}")
                asserts.append(a)
        cases.append(case.model_copy(update={"assert_": asserts}))
    return suite.model_copy(update={"cases": cases}), problems


def battery_digest(ws: Workspace, items: list[Item]) -> str:
    """Content digest of exactly what runs: suites (with segment file texts and assertion scripts) and the
    chosen cases."""
    suites = {i.suite.suite: i.suite for i in items}
    out = {}
    for name, s in sorted(suites.items()):
        dumped, scripts = _scripts(ws, s.model_dump(mode="json", by_alias=True))
        out[name] = {"suite": dumped, "texts": [ws.segment_text(s, seg) for seg in s.prompt], "scripts": scripts,
                     "cases": [i.case.id for i in items if i.suite.suite == name]}
    if not any(v["scripts"] for v in out.values()):  # batteries without scripts keep the digest they always had
        for v in out.values():
            del v["scripts"]
    return digest(out)


def _scripts(ws: Workspace, suite: dict) -> tuple[dict, dict[str, str]]:
    """The suite with its script paths (javascript/python values, transforms, nunjucks filters) made relative to
    the workspace (evidence survives a moved checkout), and each script's content digest (an edited script
    makes the evidence stale)."""
    scripts: dict[str, str] = {}

    def relative(ref: str) -> str:
        path = Path(ref[len("file://"):].partition(":")[0])
        if path.is_relative_to(ws.root):
            ref = "file://" + ref[len("file://"):].replace(str(ws.root) + "/", "", 1)
            path = path.relative_to(ws.root)
        file = ws.root / path
        scripts[str(path)] = sha256_hex(file.read_bytes()) if file.is_file() else ""
        return ref

    if "filters" in suite:  # a promptfoo config's nunjucks filters (absent when it has none)
        suite["filters"] = {name: relative(ref) for name, ref in suite["filters"].items()}
    for case in suite.get("cases", []):
        for a in case.get("assert", []):
            value = a.get("value")
            if a["type"].removeprefix("not-") in ("javascript", "python") and isinstance(value, str) and value.startswith("file://"):
                a["value"] = relative(value)
            for key in ("output_transform", "transform"):
                ref = a.get("options", {}).get(key)
                if isinstance(ref, str) and ref.startswith("file://"):
                    a["options"][key] = relative(ref)
    return suite, scripts
