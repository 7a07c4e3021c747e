"""javascript and python assertions evaluated per second: one kept-alive worker per language (what
``evaluate`` uses) against one fresh subprocess per assertion, side by side in one run.

Each language evaluates the same inline assertion and the same file assertion (a small script beside it)
on a 200-character output, ``--calls`` times per way; the per-call way starts the worker, asks once and
stops it, which is what a subprocess per assertion costs. Outcomes are checked equal between the ways.

    python bench/scripted_assertions.py [--calls 200]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from gatekeeper.battery import checks, scripted
from gatekeeper.workspace import Assertion

OUTPUT = ("The capital of Portugal is Lisbon; Porto is the second city. " * 4)[:200]
CONTEXT = checks.Context(vars={"city": "Porto"}, prompt="Where is Porto?")
FILES = {"check.js": "module.exports = (output, context) => output.includes(context.vars.city);\n",
         "check.py": "def get_assert(output, context):\n    return context['vars']['city'] in output\n"}
INLINE = {"javascript": "output.includes(context.vars.city) && output.length < 500",
          "python": "context['vars']['city'] in output and len(output) < 500"}


def per_second(assertion: Assertion, calls: int, kept: bool) -> tuple[float, dict]:
    if kept:  # the worker evaluate uses, started before the clock
        scripted.evaluate(assertion, OUTPUT, CONTEXT)
    t0 = time.perf_counter()
    for _ in range(calls):
        if kept:
            result = scripted.evaluate(assertion, OUTPUT, CONTEXT)
            continue
        once = scripted.Worker(scripted.command(checks.base_type(assertion.type)))  # a subprocess for this one call
        try:
            result = scripted.evaluate(assertion, OUTPUT, CONTEXT, once)
        finally:
            once.close()
    return calls / (time.perf_counter() - t0), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in FILES.items():
            (Path(tmp) / name).write_text(text)
        print(f"{'assertion':<28} {'per call /s':>12} {'kept-alive /s':>14} {'ratio':>7}")
        for language, suffix in (("javascript", "js"), ("python", "py")):
            for form, value in (("inline", INLINE[language]), ("file", f"file://{Path(tmp) / f'check.{suffix}'}")):
                a = Assertion(type=language, value=value)
                checks.prepare(a)
                cold, cold_result = per_second(a, max(args.calls // 10, 5), kept=False)
                warm, warm_result = per_second(a, args.calls, kept=True)
                assert cold_result == warm_result and warm_result["pass"], (cold_result, warm_result)
                print(f"{language + ' ' + form:<28} {cold:>12.1f} {warm:>14.1f} {warm / cold:>6.0f}x")


if __name__ == "__main__":
    main()
