"""Every test and tool finds what `make` set up under $GATEKEEPER_HOME (default: the user cache directory), never
at a fixed user path, so a newcomer who sets the home the README names gets a green suite."""

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

from gatekeeper.identity import child_env

ROOT = Path(__file__).resolve().parent.parent

# A user's home spelled out, or a second way to find the cache besides identity.cache_home.
FIXED = re.compile(r"~/\.cache|\.cache/gatekeeper|Path\.home\(\)|expanduser\(\s*[\"']~|user_cache_dir\(|/root/|/home/\w")


def test_no_source_names_a_fixed_user_path():
    found = []
    for path in [*ROOT.glob("tests/**/*.py"), *ROOT.glob("bench/**/*.py"), *ROOT.glob("gatekeeper/**/*.py"),
                 ROOT / "Makefile", ROOT / ".ci" / "run"]:
        if path == Path(__file__) or path == ROOT / "gatekeeper" / "identity.py":  # the pattern here; the one rule there
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if FIXED.search(line):
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not found, "find set-up parts through gatekeeper.setup.models.home(), not a fixed path:\n" + "\n".join(found)


WHERE = """
import json
from gatekeeper import runtime
from gatekeeper.setup import llama_libs, models, openfeature_js, promptfoo, runtimes, vllm
print(json.dumps({"model": str(models.default_model_dir()), "llama.cpp": str(llama_libs.version_dir("0")),
                  "vllm": str(vllm.root()), "promptfoo": str(promptfoo.root()), "openfeature-js": str(openfeature_js.root()),
                  "runtimes": str(runtimes.folder("x")), "prefix states": str(runtime.results_root())}))
"""


def test_every_set_up_part_is_found_under_the_home_the_user_sets(tmp_path):
    """Under a home that is not the default (and a HOME and XDG cache elsewhere), each part `make` sets up is looked
    for in that home alone."""
    home = tmp_path / "gk-home"
    env = child_env(GATEKEEPER_HOME=str(home), HOME=str(tmp_path / "user"), XDG_CACHE_HOME=str(tmp_path / "xdg"))
    done = subprocess.run([sys.executable, "-c", WHERE], capture_output=True, text=True, env=env, cwd=ROOT, check=True)
    where = json.loads(done.stdout)
    assert len(where) == 7
    elsewhere = {k: v for k, v in where.items() if not Path(v).is_relative_to(home)}
    assert not elsewhere, f"looked for outside $GATEKEEPER_HOME: {elsewhere}"
    # and without GATEKEEPER_HOME, the user cache directory (XDG's where set)
    del env["GATEKEEPER_HOME"]
    where = json.loads(subprocess.run([sys.executable, "-c", WHERE], capture_output=True, text=True, env=env, cwd=ROOT,
                                      check=True).stdout)
    assert all(Path(v).is_relative_to(tmp_path / "xdg" / "gatekeeper") for v in where.values()), where


def _from_scratch(tree: ast.AST) -> list[int]:
    """Lines where an environment for a child process is a dict built here (a literal, a comprehension, ``dict()``)
    rather than ``child_env(...)``: passed as ``env=`` (CliRunner's ``invoke`` excepted: it adds to this process's
    environment) or bound to a name ``env``."""
    def built(node: ast.AST | None) -> bool:
        return isinstance(node, (ast.Dict, ast.DictComp)) or (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict")

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and not (isinstance(node.func, ast.Attribute) and node.func.attr == "invoke"):
            found += [k.value.lineno for k in node.keywords if k.arg == "env" and built(k.value)]
        elif isinstance(node, ast.Assign) and built(node.value):
            found += [node.lineno for t in node.targets if isinstance(t, ast.Name) and t.id.lower() == "env"]
    return found


def test_every_child_process_inherits_the_environment():
    """A child whose environment is built from scratch loses GATEKEEPER_HOME (and the package clients' settings) and
    looks in the default user cache: a test that then passes only where that cache is full. Every process the
    package, the benches and the tests start gets ``identity.child_env``."""
    found = []
    for path in [*ROOT.glob("tests/**/*.py"), *ROOT.glob("bench/**/*.py"), *ROOT.glob("gatekeeper/**/*.py")]:
        found += [f"{path.relative_to(ROOT)}:{n}" for n in _from_scratch(ast.parse(path.read_text()))]
    assert not found, "build a child's environment with gatekeeper.identity.child_env(...):\n" + "\n".join(found)


def test_the_check_sees_an_environment_built_from_scratch():
    planted = ('subprocess.run(cmd, env={"PYTHONPATH": "x", "PATH": "/usr/bin"})\n'
               'env = {k: v for k, v in os.environ.items()}\nENV = dict(PATH="/bin")\n'
               'subprocess.run(cmd, env=child_env(PYTHONPATH="x"))\nCliRunner().invoke(app, [], env={"A": "1"})\n')
    assert sorted(_from_scratch(ast.parse(planted))) == [1, 2, 3]
    assert child_env(GATEKEEPER_HOME="/elsewhere")["GATEKEEPER_HOME"] == "/elsewhere"
