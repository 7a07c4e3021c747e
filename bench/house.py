"""The house before and after a change of the inside, side by side in one run (prints figures; no pass/fail):
CLI start-up (``gatekeeper --help``, ``status``, ``hash``) timed on two checkouts in turn, and how much of each
package is typed ``Any``/``dict[str, Any]``.

The "before" checkout is a git ref (default: the commit before the typed evidence records) laid out with
``git worktree`` in a temporary folder; both run with this venv's Python on a copy of one workspace (the
repository's own, with its ledger), so only the package differs. Runs alternate before/after, and each
figure is the median of the reps.

    python bench/house.py [--base 4f939c7] [--reps 15]
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gatekeeper.identity import child_env

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = {"--help": ["--help"], "status": ["status", "--json"], "hash": ["hash", "--json"]}


def typed_counts(package: Path) -> dict[str, int]:
    """Occurrences of ``Any`` and of ``dict[str, Any]`` in a package's source."""
    text = "\n".join(p.read_text() for p in package.rglob("*.py"))
    return {"Any": len(re.findall(r"\bAny\b", text)), "dict[str, Any]": text.count("dict[str, Any]")}


def run(tree: Path, ws: Path, args: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "from gatekeeper.cli import app; app()", "--workspace", str(ws), *args],
                   cwd=tree, env=child_env(PYTHONPATH=str(tree)), check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="4f939c7", help="the 'before' git ref")
    ap.add_argument("--reps", type=int, default=15)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="gatekeeper-house-") as tmp:
        before = Path(tmp) / "before"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(before), a.base], check=True,
                       capture_output=True)
        try:
            ws = Path(tmp) / "ws"
            for folder in ("assertions", "engines", "ledger", "policies", "prompts"):  # the workspace, not the code
                if (ROOT / folder).is_dir():
                    shutil.copytree(ROOT / folder, ws / folder)
            trees = {"before": before, "after": ROOT}
            print(f"CLI start-up, median of {a.reps} runs each, alternating (before = {a.base}, after = the working tree)")
            print(f"{'command':10} {'before s':>9} {'after s':>9} {'after/before':>13}")
            for name, args in COMMANDS.items():
                times: dict[str, list[float]] = {k: [] for k in trees}
                for _ in range(a.reps):
                    for k, tree in trees.items():
                        times[k].append(run(tree, ws, args))
                b, c = statistics.median(times["before"]), statistics.median(times["after"])
                print(f"{name:10} {b:9.3f} {c:9.3f} {c / b:13.2f}")
            print("\nTyped loosely, occurrences in gatekeeper/ (before -> after)")
            counts = {k: typed_counts(tree / "gatekeeper") for k, tree in trees.items()}
            for key in counts["before"]:
                print(f"{key:16} {counts['before'][key]:5} -> {counts['after'][key]:5}")
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(before)], capture_output=True)


if __name__ == "__main__":
    main()
