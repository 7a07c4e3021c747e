"""promptfoo's own example configs, run through gatekeeper as a new user would (issue #28's table).

Each config under bench/promptfoo_examples/NAME/ goes into a fresh workspace (its folder as
``assertions/NAME/`` with a suite pointing at it, or with ``--layout beside`` as
``assertions/NAME.promptfoo.yaml`` with its files beside it) and is evaluated with
``evaluate --flag prefix_cache --engine tiny --limit 1 --json`` (a tiny random llama built once and kept
under $GATEKEEPER_HOME/bench/tiny-llama, also the policy's grader); where that is refused, again with
``--skip-unsupported``.
The assertions are counted from gatekeeper's own reading of the whole config (every case, not only the
one ``--limit 1`` runs). Prints one row per config and the summary against the goal:
  - configs that evaluate (as they are or with --skip-unsupported): goal at least 90%;
  - assertions evaluated rather than skipped, over the configs that load: goal at least 80%.

    python bench/promptfoo_examples.py [--only NAME ...] [--layout folder|beside] [--load-only] [--promptfoo] [--json OUT]

``--load-only`` reads every config and counts its assertions without running the model (seconds).
``--promptfoo`` also runs the real promptfoo (``make promptfoo``) on each config that loads, its providers
replaced by the echo provider, and compares the prompts it renders, test by test, with gatekeeper's reading:
a difference is a silent misread.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from gatekeeper.js.value import js_trim  # noqa: E402  (after the path: the repository's gatekeeper)

CORPUS = ROOT / "bench" / "promptfoo_examples"
CONFIG = "promptfooconfig.yaml"
_LEFT_OUT = re.compile(r"^(.*): assertion \d+ \(([^:)]+)")


def configs(only: list[str] | None = None) -> list[Path]:
    found = sorted(p.parent for p in CORPUS.glob(f"*/{CONFIG}"))
    return [p for p in found if not only or p.name in only]


def tiny_model() -> Path:
    """A tiny random llama, built once (no download) and reused from $GATEKEEPER_HOME."""
    from gatekeeper.setup.models import home

    path = home() / "bench" / "tiny-llama"
    if not (path / "config.json").is_file():
        from tiny_models import build_tiny_llama

        build_tiny_llama(path)
    return path


def workspace(folder: Path, into: Path, model: Path, layout: str = "folder") -> Path:
    """A fresh workspace holding the config: ``folder``, its own folder ``assertions/NAME/`` and a suite
    ``assertions/NAME.yaml`` pointing at it (the layout promptfoo users have); ``beside``, the config as
    ``assertions/NAME.promptfoo.yaml`` with its files beside it. The tiny model is the engine and, where
    the policy takes one, the grader too (with the packaged embedding model for ``similar``)."""
    from gatekeeper.setup.scaffold import init_workspace
    from gatekeeper.workspace import Policy

    ws = into / folder.name
    init_workspace(ws)
    (ws / "assertions" / "assistant.yaml").unlink()
    if layout == "folder":
        shutil.copytree(folder, ws / "assertions" / folder.name)
        (ws / "assertions" / f"{folder.name}.yaml").write_text(
            f"suite: {folder.name}\npromptfoo: {folder.name}/{CONFIG}\n", encoding="utf-8")
    else:
        for item in folder.iterdir():
            target = ws / "assertions" / (f"{folder.name}.promptfoo.yaml" if item.name == CONFIG else item.name)
            (shutil.copytree if item.is_dir() else shutil.copyfile)(item, target)
    (ws / "engines" / "tiny.yaml").write_text(
        f"adapter: torch\nmodel: {model}\ndtype: float32\ndevice: cpu\nprefill: monolithic\n", encoding="utf-8")
    if "grader" in Policy.model_fields:
        with open(ws / "policies" / "prefix_cache.yaml", "a", encoding="utf-8") as policy:
            policy.write("grader: {engine: tiny, max_tokens: 16, embedding: all-MiniLM-L6-v2}\n")
    return ws


def counts(ws: Path) -> dict | str:
    """Assertions in gatekeeper's reading of the whole config: total, evaluated, skipped by type; or why it
    cannot be read (the first line of the refusal)."""
    from gatekeeper.battery import suites as load
    from gatekeeper.errors import GatekeeperError
    from gatekeeper.workspace import Workspace

    try:
        suites = load.all_suites(Workspace(ws))
    except GatekeeperError as e:
        return _first_line(str(e), ws)
    evaluated = sum(len(c.assert_) for s in suites.values() for c in s.cases)
    skipped = Counter(kind for s in suites.values() for _, kind in _left_out(s))
    return {"stages": len(suites), "cases": sum(len(s.cases) for s in suites.values()), "evaluated": evaluated,
            "skipped": dict(skipped), "total": evaluated + sum(skipped.values())}


def _left_out(suite) -> list[tuple[str, str]]:
    """(case id, type) of each assertion gatekeeper leaves out: skipped ones, and cost/latency (about the call)."""
    reasons = [*suite.skipped, *getattr(suite, "call_metrics", ())]
    return [(m.group(1), m.group(2)) for r in reasons if (m := _LEFT_OUT.match(r))]


def _first_line(message: str, ws: Path) -> str:
    try:  # --json reports a refusal as {"error": ...}
        message = json.loads(message)["error"]
    except (ValueError, KeyError, TypeError):
        pass
    line = message.strip().splitlines()[0] if message.strip() else "(no message)"
    return line.replace(str(ws) + os.sep, "")


def evaluate(ws: Path, *extra: str) -> tuple[int, str]:
    """``gatekeeper evaluate`` in this process (torch loads once for the whole table): exit code and the
    first line of a refusal (or '' when it ran)."""
    from typer.testing import CliRunner

    from gatekeeper.cli import app

    args = ["--workspace", str(ws), "evaluate", "--flag", "prefix_cache", "--engine", "tiny", "--limit", "1",
            "--operator", "bench", *extra, "--json"]
    result = CliRunner().invoke(app, args)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        return 99, f"crash: {type(result.exception).__name__}: {result.exception}"
    if result.exit_code == 2:
        return 2, _first_line(result.stderr or result.stdout, ws)
    return result.exit_code, ""


def row(folder: Path, tmp: Path, model: Path | None, against_promptfoo: bool = False, layout: str = "folder") -> dict:
    ws = workspace(folder, tmp / layout, model or tmp / "no-model", layout)
    out = {"config": folder.name, "assertions": counts(ws)}
    if against_promptfoo and isinstance(out["assertions"], dict):
        out["promptfoo"] = compare(folder, ws, tmp)
    elif against_promptfoo:  # refused: can the real promptfoo run it here?
        out["promptfoo_fails"] = promptfoo_fails(folder, tmp)
    if model is None:
        out["status"] = "refused" if isinstance(out["assertions"], str) else "loads"
        out["message"] = out["assertions"] if isinstance(out["assertions"], str) else ""
        return out
    code, message = evaluate(ws)
    status = "as is"
    if code == 2:
        status = "skip-unsupported" if evaluate(ws, "--skip-unsupported")[0] in (0, 1) else "refused"
        message = message if status == "refused" else ""
    elif code not in (0, 1):
        status = "crash"
    out.update(status=status, exit=code, message=message if status != "as is" else "")
    return out


def _messages(text: str) -> Any:
    """A rendered prompt as comparable data: a chat prompt's (role, content) pairs, else the trimmed text."""
    try:
        data = json.loads(text)
    except ValueError:
        return js_trim(text)
    if isinstance(data, dict) and "messages" in data:  # a provider's request shape
        data = ([{"role": "system", "content": data["system"]}] if "system" in data else []) + data["messages"]
    if isinstance(data, list) and all(isinstance(m, dict) and "role" in m for m in data):
        return tuple((m["role"], js_trim(_text(m.get("content", "")))) for m in data)
    return text  # as sent: JSON written again with other spacing is another prompt


def _text(content: Any) -> str:
    """A message's content as text: one {type: text} part is its text."""
    if isinstance(content, list) and len(content) == 1 and isinstance(content[0], dict) and "text" in content[0]:
        return str(content[0]["text"])
    return str(content)


def gatekeeper_prompts(ws: Path) -> Counter:
    """Every prompt gatekeeper would send for the config (each stage x each case), rendered, with the types of
    the case's assertions (evaluated or left out)."""
    from gatekeeper.battery import partition
    from gatekeeper.battery import suites as load
    from gatekeeper.workspace import Workspace

    workspace, seen = Workspace(ws), Counter()
    for suite in load.all_suites(workspace).values():
        left_out = _left_out(suite)
        for case in suite.cases:
            pieces = partition.pieces(workspace, suite, case.vars)
            if [p.role for p in pieces] == ["user"]:
                prompt = _messages(pieces[0].text)
            else:
                prompt = tuple((m["role"], js_trim(m["content"])) for m in partition.messages(pieces))
            kinds = [_kind(a.type, a.threshold) for a in case.assert_]
            kinds += [_kind(kind, None) for case_id, kind in left_out if case_id == case.id]
            seen[(prompt, tuple(sorted(kinds, key=repr)))] += 1
    return seen


def promptfoo_results(folder: Path, tmp: Path) -> list[dict] | str:
    """The real promptfoo's results for the config (providers replaced by echo), or why there are none."""
    from gatekeeper.js import yaml as jsyaml
    from gatekeeper.setup import promptfoo as promptfoo_build

    copy = tmp / f"pf-{folder.name}"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(folder, copy)
    config = jsyaml.load((copy / CONFIG).read_text(encoding="utf-8"))
    config["providers"] = ["echo"]
    (copy / CONFIG).write_text(json.dumps(config, ensure_ascii=False), encoding="utf-8")
    out = copy / "out.json"
    run = promptfoo_build.eval_config(copy / CONFIG, out, timeout=300)
    if not out.is_file():
        return f"promptfoo wrote no results (exit {run.returncode}): {_error_line(run.stderr + run.stdout)}"
    return json.loads(out.read_text(encoding="utf-8"))["results"]["results"]


def _error_line(text: str) -> str:
    """The line of a node error output that says what went wrong (not a stack frame nor node's version)."""
    lines = [js_trim(line) for line in text.splitlines() if js_trim(line) and not js_trim(line).startswith(("at ", "Node.js v"))]
    said = [line for line in lines if "rror" in line] or lines
    return said[-1][:160] if said else ""


def promptfoo_prompts(folder: Path, tmp: Path) -> Counter | str:
    """Every prompt the real promptfoo renders for the config with its test's assertion types; or why there are none."""
    results = promptfoo_results(folder, tmp)
    if isinstance(results, str):
        return results
    return Counter((_messages(r["prompt"]["raw"]), tuple(sorted((_kind(a.get("type", "?"), a.get("threshold"))
                                                                 for a in r["testCase"].get("assert") or []), key=repr)))
                   for r in results)


def promptfoo_fails(folder: Path, tmp: Path) -> str | None:
    """Why the real promptfoo cannot run the config here either (no results, or every test an error), else None."""
    results = promptfoo_results(folder, tmp)
    if isinstance(results, str):
        return results
    errors = [r.get("error") for r in results]
    if results and all(errors):
        return "every test errs in promptfoo: " + _error_line(errors[0])
    return None


def _kind(kind: str, threshold: Any) -> tuple[str, Any]:
    """An assertion's type, with its threshold where gatekeeper evaluates a type that reads one."""
    from gatekeeper.battery import checks

    return (kind, float(threshold) if threshold is not None and checks.base_type(kind) in checks.EVALUATED_BY else None)


def compare(folder: Path, ws: Path, tmp: Path) -> str:
    """'same' when promptfoo and gatekeeper render the same prompts with the same assertion types (as a
    multiset), else the first difference."""
    theirs = promptfoo_prompts(folder, tmp)
    if isinstance(theirs, str):
        return theirs
    ours = gatekeeper_prompts(ws)
    if ours == theirs:
        return "same"
    only_theirs, only_ours = theirs - ours, ours - theirs
    def shown(c) -> str:
        return repr(next(iter(c)))[:120] if c else "-"

    return (f"differ: promptfoo {sum(theirs.values())} prompts, gatekeeper {sum(ours.values())}; only promptfoo's: "
            f"{shown(only_theirs)}; only gatekeeper's: {shown(only_ours)}")


def summary(rows: list[dict]) -> dict:
    ran = [r for r in rows if r["status"] in ("as is", "skip-unsupported", "loads")]
    loaded = [r["assertions"] for r in rows if isinstance(r["assertions"], dict) and r["status"] != "refused"]
    total = sum(a["total"] for a in loaded)
    evaluated = sum(a["evaluated"] for a in loaded)
    skipped = Counter()
    for a in loaded:
        skipped.update(a["skipped"])
    refusals = Counter(_reason(r["message"]) for r in rows if r["status"] == "refused")
    calls = skipped["cost"] + skipped["latency"]  # about the call, not the output: left out by design
    return {"configs": len(rows), "evaluate": len(ran), "as_is": sum(r["status"] == "as is" for r in rows),
            "skip_unsupported": sum(r["status"] == "skip-unsupported" for r in rows),
            "refused": sum(r["status"] == "refused" for r in rows), "crashed": sum(r["status"] == "crash" for r in rows),
            "share_evaluate": len(ran) / len(rows) if rows else 0.0,
            "promptfoo_fails_too": [r["config"] for r in rows if r.get("promptfoo_fails")],
            "assertions": total, "assertions_evaluated": evaluated, "share_assertions": evaluated / total if total else 0.0,
            "share_of_output_assertions": evaluated / (total - calls) if total > calls else 0.0,
            "skipped_by_type": dict(skipped.most_common()), "refusals_by_reason": dict(refusals.most_common())}


def _reason(message: str) -> str:
    """A refusal message without its file and test, so that equal reasons count together."""
    text = re.sub(r"^[^:]*\.(ya?ml|csv|txt|json)(, (line|test) \d+)?( \([^)]*\))?(, assertion \d+)?: ", "", message)
    text = re.sub(r"field '([^']*)'", "field \u00ab\\1\u00bb", text)  # field names stay, other quoted values go
    text = re.sub(r"'[^']*'|\"[^\"]*\"", "'…'", text).replace("\u00ab", "'").replace("\u00bb", "'")
    return re.sub(r"\bfound \d+", "found N", text)[:110]


def render(rows: list[dict], s: dict) -> str:
    lines = ["| config | result | assertions | evaluated | skipped (by type) | refusal (first line) |", "|---|---|---|---|---|---|"]
    for r in rows:
        a = r["assertions"]
        if isinstance(a, dict):
            skipped = ", ".join(f"{k} {v}" for k, v in sorted(a["skipped"].items())) or "-"
            cells = [str(a["total"]), str(a["evaluated"]), skipped]
        else:
            cells = ["-", "-", "-"]
        message = r.get("message", "").replace("|", "\\|")[:140]
        lines.append(f"| {r['config']} | {r['status']} | " + " | ".join(cells) + f" | {message} |")
    ran = (f"evaluate: {s['evaluate']} ({s['share_evaluate']:.0%}; goal >= 90%) = {s['as_is']} as is + "
           f"{s['skip_unsupported']} only with --skip-unsupported" if any(r["status"] not in ("loads", "refused") for r in rows)
           else f"load: {s['evaluate']} ({s['share_evaluate']:.0%}; --load-only ran no model)")
    lines += ["", f"configs: {s['configs']}; {ran}; refused {s['refused']}; crashed {s['crashed']}"]
    if any("promptfoo_fails" in r for r in rows):
        runnable = s["configs"] - len(s["promptfoo_fails_too"])
        lines.append(f"refused configs the real promptfoo cannot run here either: {len(s['promptfoo_fails_too'])} "
                     f"({', '.join(s['promptfoo_fails_too']) or '-'}); of the {runnable} it runs, {s['evaluate']} evaluate "
                     f"in gatekeeper ({s['evaluate'] / runnable if runnable else 0:.0%})")
    lines += [f"assertions in the configs that evaluate: {s['assertions']}, evaluated {s['assertions_evaluated']} "
              f"({s['share_assertions']:.0%}; goal >= 80%); leaving out cost and latency, which measure the call: "
              f"{s['share_of_output_assertions']:.0%}",
              "skipped by type: " + (", ".join(f"{k} {v}" for k, v in s["skipped_by_type"].items()) or "none"),
              "refusals by reason:"] + [f"  {n} x {k}" for k, n in s["refusals_by_reason"].items()]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="Only these configs (folder names).")
    parser.add_argument("--load-only", action="store_true", help="Read and count only; run no model.")
    parser.add_argument("--layout", choices=("folder", "beside"), default="folder",
                        help="folder: assertions/NAME/ and a suite pointing at it; beside: assertions/NAME.promptfoo.yaml.")
    parser.add_argument("--promptfoo", action="store_true", help="Compare the prompts with the real promptfoo's.")
    parser.add_argument("--json", type=Path, help="Also write the rows and the summary here.")
    args = parser.parse_args()
    model = None if args.load_only else tiny_model()
    with tempfile.TemporaryDirectory() as tmp:
        rows = []
        for folder in configs(args.only):
            rows.append(row(folder, Path(tmp), model, args.promptfoo, args.layout))
            print(f"{folder.name}: {rows[-1]['status']}", file=sys.stderr, flush=True)
    s = summary(rows)
    print(render(rows, s))
    for r in rows:
        if "promptfoo" in r:
            print(f"promptfoo vs gatekeeper, {r['config']}: {r['promptfoo']}")
        elif r.get("promptfoo_fails"):
            print(f"promptfoo fails too, {r['config']}: {r['promptfoo_fails']}")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "summary": s}, indent=2, ensure_ascii=False), encoding="utf-8")


if __name__ == "__main__":
    main()
