"""promptfoo's ``transform``: the suite's own code turns the output into what its assertions grade.

A test's ``options.transform`` (or ``postprocess``; its own or defaultTest's) runs on the output before every
assertion of the case; an assertion's own ``transform`` runs after it, for that assertion only, as promptfoo
0.123.1 runs them (src/util/transform.ts, transformRunEvalResponse, runAssertionInternal). Inline code is
JavaScript called as ``(output, context)``: one line is returned, several lines are a function body.
``file://PATH[:function]`` names a JavaScript/TypeScript module (its function or default export) or a Python
file (``get_transform`` unless named). The code runs in scripted's kept-alive worker. Its result may be any
JSON value: javascript and python assertions receive it as it is, the other types its text (a string as it
is, anything else as JSON.stringify writes it). A transform that throws, or returns null or undefined, fails
every assertion it feeds, ``not-`` or not: promptfoo ends that test in an error.

They are kept on the assertion (``options``: ``output_transform`` for the test's, ``transform`` for its own),
so the battery digest covers them and each outcome says what produced it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from . import scripted
from .checks import Refused

KEYS = ("output_transform", "transform")  # in the order they run
_DONE: dict[str, tuple[Any, str]] = {}  # a test's transform runs once per output, not once per assertion
_DONE_MAX = 256


class Failed(Exception):
    """The transform threw or gave nothing: promptfoo's error, as the failed assertion's reason."""


def script(ref: str) -> scripted.Script:
    """The code a transform names; Refused for a file it cannot run."""
    if not ref.startswith("file://"):
        return scripted.Script("javascript", code=_node(ref))
    path, function = ref[len("file://"):], None
    if path.rfind(":") > 1:  # promptfoo's parseFilePathAndFunctionName: the last colon
        path, _, function = path.rpartition(":")
    suffix = Path(path).suffix.lower()
    if suffix in scripted.SUFFIXES["javascript"]:
        return scripted.Script("javascript", file=_node(path), function=function)
    if suffix == ".py":
        return scripted.Script("python", file=path, function=function or "get_transform")
    raise Refused(f"transform {ref}: promptfoo runs transforms from JavaScript, TypeScript or Python files; fix the path")


def _node(code: str) -> str:
    if not scripted.promptfoo_setup.node().is_file():
        raise Refused("transforms in JavaScript run under the node that 'make promptfoo' installs, and it is not "
                      "installed; run 'make promptfoo'")
    return code


def label(ref: str) -> str:
    """How promptfoo names a transform in its errors."""
    if ref.startswith("file://"):
        return "[file transform]"
    line = " ".join(ref.split())
    return f"[inline transform]: {line if len(line) <= 80 else line[:79] + '…'}"


def apply(options: dict, output: str, vars: dict, prompt: str) -> tuple[Any, str, Any]:
    """(the value the assertion grades, that value as text, what ``providerResponse.output`` holds) after the
    test's transform and then the assertion's; Failed when either fails."""
    value, text, response = output, output, output
    for key in KEYS:
        ref = options.get(key)
        if ref is None:
            continue
        # the test's sees promptfoo's prompt object; the assertion's sees {label: the rendered prompt}
        context = {"vars": vars, "prompt": {"raw": prompt, "label": prompt} if key == "output_transform" else {"label": prompt}}
        value, text = _run(ref, value, context)
        if key == "output_transform":
            response = value
    return value, text, response


def _run(ref: str, value: Any, context: dict) -> tuple[Any, str]:
    memo = json.dumps([ref, value, context], ensure_ascii=False, sort_keys=True)
    if memo in _DONE:
        return _DONE[memo]
    try:
        result, text = scripted.call(script(ref), [value, context], f"the transform {label(ref)}", text=True)
    except scripted.CallFailed as e:
        raise Failed(f"Transform failed ({label(ref)}): {e}") from None
    if result is None or result is scripted.UNDEFINED:
        raise Failed(f"Transform function did not return a value\n\n{label(ref)}")
    if len(_DONE) >= _DONE_MAX:
        _DONE.clear()
    _DONE[memo] = (result, text)
    return result, text
