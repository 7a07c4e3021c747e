"""gatekeeper's Python assertion worker: one request per stdin line, one reply per line on the file
descriptor named by argv[1] (stdout and stderr are the user's, and go nowhere).

An assertion request is {code | file + fn, output, context}; a call request (a transform) is
{call: true, file + fn, args}. The reply is {"value": what the function returned, as JSON} or {"error": why it
failed}. Code and files run as promptfoo 0.123.1 runs them (src/python/wrapper.py):
inline code becomes the body of ``main(output, context)`` in a module that imports json; a file is loaded
afresh for every call, its folder first on sys.path, and its function (``get_assert`` by default,
``Class.method`` allowed, a coroutine run to its end) called with the output and the context.
"""

import asyncio
import importlib.util
import inspect
import json
import os
import re
import sys
import traceback


def inline(code: str) -> str:
    """promptfoo's buildPythonScript: one line is returned; several lines are the body, each indented
    like the first indented line (or by four spaces)."""
    if "\n" not in code:
        return f"import json\n\ndef main(output, context):\n    return {code}\n"
    indent = re.search(r"^(?!\s*$)\s+", code, re.M)
    step = indent.group(0) if indent else "    "
    return "import json\n\ndef main(output, context):\n" + "\n".join(step + line for line in code.split("\n")) + "\n"


def function(request: dict):
    if request.get("code") is not None:
        namespace = {"__name__": "script"}
        exec(compile(inline(request["code"]), "<python assertion>", "exec"), namespace)
        return namespace["main"]
    path = request["file"]
    folder = os.path.dirname(os.path.abspath(path))
    if folder not in sys.path:
        sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location(os.path.basename(path).rsplit(".", 1)[0], path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path} as a Python module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    name = request.get("fn") or "get_assert"
    if "." in name:
        owner, method = name.split(".")
        return getattr(getattr(module, owner), method)
    return getattr(module, name)


def answer(request: dict) -> dict:
    try:
        fn = function(request)
        args = request["args"] if request.get("call") else (request["output"], request["context"])
        value = asyncio.run(fn(*args)) if inspect.iscoroutinefunction(fn) else fn(*args)
        return {"value": json.loads(json.dumps(value, allow_nan=False))}  # what JSON carries back to promptfoo
    except BaseException as e:  # noqa: BLE001 - the user's exception (or exit) is the assertion's failure
        if isinstance(e, KeyboardInterrupt):
            raise
        line = traceback.format_exception_only(type(e), e)[-1].strip()
        return {"error": line}


def main() -> None:
    replies = os.fdopen(int(sys.argv[1]), "w", encoding="utf-8")
    for line in sys.stdin:
        replies.write(json.dumps(answer(json.loads(line)), ensure_ascii=False) + "\n")
        replies.flush()


if __name__ == "__main__":
    main()
