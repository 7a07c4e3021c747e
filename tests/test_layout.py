"""The package's layout: no import circle among gatekeeper's modules, and each subpackage imports only
what its docstring's ``Imports:`` line allows (read from the code's own imports, lazy ones included)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import gatekeeper

ROOT = Path(gatekeeper.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in ROOT.rglob("*.py")}


def imports(name: str) -> set[str]:
    """The gatekeeper modules ``name`` imports anywhere in its body (a package's names resolved to modules)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "gatekeeper"}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            if base.split(".")[0] != "gatekeeper":
                continue
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.add(full if full in MODULES else base)
    return found - {name}


GRAPH = {name: imports(name) for name in MODULES}


def test_every_import_is_resolved():
    unknown = {(m, i) for m, deps in GRAPH.items() for i in deps if i not in MODULES}
    assert not unknown


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    assert cycles(GRAPH) == []


def test_cycle_finder_finds_a_planted_circle():
    planted = {**GRAPH, "gatekeeper.errors": GRAPH["gatekeeper.errors"] | {"gatekeeper.workspace"}}
    assert any({"gatekeeper.errors", "gatekeeper.workspace"} <= set(c) for c in cycles(planted))


def part(name: str) -> str:
    """The layer a module belongs to: its subpackage, or the top-level module itself."""
    rest = name.split(".")[1:]
    return rest[0] if rest else "gatekeeper"


SUBPACKAGES = sorted({part(n) for n, p in MODULES.items() if p.name == "__init__.py" and n != "gatekeeper"})


def allowed(package: str) -> set[str]:
    doc = ast.get_docstring(ast.parse(MODULES[f"gatekeeper.{package}"].read_text())) or ""
    line = re.search(r"^Imports:(.*?)(?:\n\n|\Z)", doc, re.S | re.M)
    assert line, f"gatekeeper/{package}/__init__.py: its docstring needs an 'Imports:' line"
    return {w.strip(" .") for w in re.split(r"[,\s]+", line.group(1)) if w.strip(" .")} - {"nothing"}


def test_each_subpackage_imports_only_what_it_declares():
    problems = []
    for name, deps in GRAPH.items():
        here = part(name)
        if here not in SUBPACKAGES:
            continue
        for dep in deps:
            there = part(dep)
            if there != here and there not in allowed(here):
                problems.append(f"{name} imports {dep}, but gatekeeper/{here}/ declares 'Imports: {', '.join(sorted(allowed(here)))}'")
    assert problems == []
