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


# --- the layers: reports above the gate and the ledger, the ledger beneath the gate -------------------


def reaches(graph: dict[str, set[str]], below: str, above: tuple[str, ...]) -> list[str]:
    """Each import by a module of the layer ``below`` of a module of any of the layers ``above``."""
    return sorted(f"{name} imports {dep}" for name, deps in graph.items() if part(name) == below
                  for dep in deps if part(dep) in above)


def ledger_reaches_up(graph: dict[str, set[str]]) -> list[str]:
    """The ledger stores and checks the evidence: what decides (gate, engines) and what reads it (reports) sit above."""
    return reaches(graph, "ledger", ("gate", "engines", "reports"))


def reports_reached(graph: dict[str, set[str]]) -> list[str]:
    """The reports read what the gate decided and the ledger holds: neither imports them."""
    return reaches(graph, "gate", ("reports",)) + reaches(graph, "ledger", ("reports",))


def test_the_ledger_imports_nothing_of_the_gate_the_engines_or_the_reports():
    assert ledger_reaches_up(GRAPH) == []


def test_neither_the_gate_nor_the_ledger_imports_the_reports():
    assert reports_reached(GRAPH) == []


def planted(below: str, above: str) -> dict[str, set[str]]:
    return {**GRAPH, below: GRAPH[below] | {above}}


def test_the_layer_checks_find_a_planted_edge():
    for below, above in (("gatekeeper.ledger.chain", "gatekeeper.gate.kinds"),
                         ("gatekeeper.ledger.store", "gatekeeper.engines.base"),
                         ("gatekeeper.ledger.verify", "gatekeeper.reports.outcomes")):
        assert ledger_reaches_up(planted(below, above)) == [f"{below} imports {above}"]
    for below, above in (("gatekeeper.gate.kinds", "gatekeeper.reports.diff"),
                         ("gatekeeper.ledger.store", "gatekeeper.reports.export")):
        assert reports_reached(planted(below, above)) == [f"{below} imports {above}"]
