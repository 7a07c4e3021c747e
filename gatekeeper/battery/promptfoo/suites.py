"""A promptfoo config's suites: one per prompt, running every test the prompt is selected for.

A config is ``assertions/NAME.promptfoo.yaml``, or any config a pointer suite names (``assertions/NAME.yaml``
holding ``suite: NAME`` and ``promptfoo: FOLDER/promptfooconfig.yaml``, no prompt). Each of its prompts
(battery/promptfoo/prompts.py) becomes its own suite and stage running every test its ``prompts:`` allows:
NAME alone for one prompt, NAME.LABEL for several. A gatekeeper suite with its own prompt and
``promptfoo: FILE`` takes only FILE's tests.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from ...errors import GatekeeperError
from ...workspace import Decoding, Suite
from . import templates
from .cases import _test_cases
from .config import _default_test, _mapping, _read
from .files import _at, warn
from .prompts import matches, read_prompts
from .tests import _tests
from .variables import _var_value


def load_suites(path: Path, name: str, shown: str | None = None, decoding: Decoding | None = None) -> list[Suite]:
    """A config's suites: one per prompt, running every test the prompt is selected for. One prompt makes
    suite and stage ``name``; several make ``name.LABEL`` each (the label as a name, made unique).
    ``shown``: how the config is named in the suite (its file name, or a pointer's ``promptfoo:``)."""
    config = _read(path)
    prompts = read_prompts(config, path)
    tests = _test_cases(config, path)
    custom = templates.custom_filters(config, path)
    # the raw tests, aligned with ``tests``: a template must see each var as promptfoo passes it
    raw_tests = _tests(config, path) if any(templates.template_vars(p) for p in prompts) else []
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
        read = templates.template_vars(prompt)
        for test, t in zip(raw_tests, tests) if read else ():
            if not any(t is c for c in chosen):
                continue
            own = _mapping(test.raw.get("vars"), test.where, "vars")
            vars = {**_mapping(default.get("vars"), str(path), "defaultTest.vars"), **own}
            expand = not {**_mapping(default.get("options"), str(path), "defaultTest.options"),
                          **_mapping(test.raw.get("options"), test.where, "options")}.get("disableVarExpansion")
            for var in sorted(read & set(vars)):
                value = _var_value(vars[var], test.base or path.parent, test.where, expand)
                if not templates.is_text_var(value, expand):
                    where = test.where if var in own else f"{path}: defaultTest (applies to {test.where.removeprefix(str(path) + ', ')})"
                    raise GatekeeperError(f"{where}: field 'vars.{var}': {json.dumps(value, ensure_ascii=False)[:60]} is not text, "
                                          f"and the prompt ({prompt.where.removeprefix(str(path) + ': ')}) reads it with nunjucks, "
                                          "where promptfoo sees the value itself and gatekeeper its text; quote it so that it is "
                                          "text, or write a list or mapping as JSON text and read it with '| load' in the prompt")
            for case in t.cases:
                nested = templates.var_template(prompt, case.vars)
                if nested is not None:
                    raise GatekeeperError(f"{test.where}: field 'vars.{nested}' (case {case.id!r}) holds nunjucks, which "
                                          "promptfoo renders before it fills the text prompt in, and gatekeeper does not; "
                                          "write out the text the var should be")
        suite = Suite(suite=suite_name, stage=suite_name, prompt=prompt.segments, promptfoo=shown or path.name, path=path,
                      decoding=decoding or Decoding(), filters=templates.prompt_filters(prompt, custom, config))
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
    if suite.promptfoo is None:
        raise GatekeeperError(f"{suite.path}: field 'promptfoo': the path of a promptfoo config; fix it")
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
