"""The package's layout: no import circle among gatekeeper's modules, each subpackage (and each group of the gate, the
engines and traffic) imports only what its docstring's ``Imports:`` line allows (read from the code's own imports, lazy
ones included), no group of the gate imports its orchestrator, only traffic's live group imports the gate and the
ledger, and each package's docstring names every module it holds."""

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
    """The names a package's ``Imports:`` line declares (``package``: dotted below gatekeeper, as ``gate.stats``)."""
    doc = ast.get_docstring(ast.parse(MODULES[f"gatekeeper.{package}"].read_text())) or ""
    line = re.search(r"^Imports:(.*?)(?:\n\n|\Z)", doc, re.S | re.M)
    assert line, f"gatekeeper/{package.replace('.', '/')}/__init__.py: its docstring needs an 'Imports:' line"
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


# --- groups: the gate, the engines and traffic are grouped by concern; each group imports what its line declares ---

GROUPED = ("gate", "engines", "traffic")
GROUPS_OF = {package: sorted(n.split(".")[2] for n, p in MODULES.items()
                             if p.name == "__init__.py" and n.startswith(f"gatekeeper.{package}.")) for package in GROUPED}
GATE = "gatekeeper.gate"
ORCHESTRATOR = f"{GATE}.evaluator"
GROUPS = GROUPS_OF["gate"]


def unit(name: str) -> str:
    """What a group's ``Imports:`` line names: ``PACKAGE.GROUP`` or ``PACKAGE.MODULE`` inside a grouped package (as
    ``gate.stats``, ``engines.sampler``), the part outside."""
    parts = name.split(".")
    return f"{parts[1]}.{parts[2]}" if len(parts) > 2 and parts[1] in GROUPED else part(name)


def seen_from(dep: str, name: str) -> str:
    """``dep`` as ``name``'s group names it: by its unit inside their package, by its part outside (``gate``, not
    ``gate.guard``, from traffic)."""
    return unit(dep) if part(dep) == part(name) else part(dep)


def in_group(name: str) -> bool:
    parts = name.split(".")
    return len(parts) > 2 and parts[1] in GROUPED and parts[2] in GROUPS_OF[parts[1]]


def group_problems(graph: dict[str, set[str]]) -> list[str]:
    """Each import by a module of a group of what its group's ``Imports:`` line leaves out (its own group aside)."""
    return sorted(f"{name} imports {dep}, but gatekeeper/{unit(name).replace('.', '/')}/ declares "
                  f"'Imports: {', '.join(sorted(allowed(unit(name))))}'"
                  for name, deps in graph.items() if in_group(name)
                  for dep in deps if seen_from(dep, name) != unit(name) and seen_from(dep, name) not in allowed(unit(name)))


def orchestrator_imports(graph: dict[str, set[str]]) -> list[str]:
    """The evaluator runs the groups; a group that imported it would run in a circle through it."""
    return sorted(f"{name} imports {ORCHESTRATOR}" for name, deps in graph.items()
                  if in_group(name) and part(name) == "gate" and ORCHESTRATOR in deps)


def test_the_gate_engines_and_traffic_are_grouped():
    assert {"stats", "run", "arms", "state", "enable", "power"} <= set(GROUPS)
    assert GROUPS_OF["engines"] == ["served"]
    assert GROUPS_OF["traffic"] == ["captures", "live", "logs"]
    assert [p.name for p in (ROOT / "traffic").glob("*.py")] == ["__init__.py"]  # every traffic module is in a group


def test_each_group_imports_only_what_it_declares():
    assert group_problems(GRAPH) == []


def test_no_gate_group_imports_the_orchestrator():
    assert orchestrator_imports(GRAPH) == []
    assert not any(ORCHESTRATOR.removeprefix("gatekeeper.") in allowed(f"gate.{g}") for g in GROUPS)


def test_the_statistics_are_a_leaf_of_the_gate():
    assert {w for w in allowed("gate.stats") if w.startswith("gate")} == set()


def test_the_group_checks_find_a_planted_edge():
    edge = planted("gatekeeper.gate.power.sizing", ORCHESTRATOR)
    assert orchestrator_imports(edge) == [f"gatekeeper.gate.power.sizing imports {ORCHESTRATOR}"]
    assert group_problems(planted("gatekeeper.gate.stats.paired", "gatekeeper.gate.run.plans")) == [
        "gatekeeper.gate.stats.paired imports gatekeeper.gate.run.plans, but gatekeeper/gate/stats/ declares "
        f"'Imports: {', '.join(sorted(allowed('gate.stats')))}'"]
    assert group_problems(planted("gatekeeper.traffic.captures.load", "gatekeeper.traffic.logs.reuse")) == [
        "gatekeeper.traffic.captures.load imports gatekeeper.traffic.logs.reuse, but gatekeeper/traffic/captures/ "
        f"declares 'Imports: {', '.join(sorted(allowed('traffic.captures')))}'"]
    assert group_problems(planted("gatekeeper.engines.served.telemetry", "gatekeeper.engines.registry")) == [
        "gatekeeper.engines.served.telemetry imports gatekeeper.engines.registry, but gatekeeper/engines/served/ "
        f"declares 'Imports: {', '.join(sorted(allowed('engines.served')))}'"]


# --- traffic: only the live group reaches the gate and the ledger ---------------------------------------------------

LIVE = "traffic.live"


def traffic_reaches_the_gate(graph: dict[str, set[str]]) -> list[str]:
    """Each import of the gate or the ledger by a traffic module outside ``traffic/live/``."""
    return sorted(f"{name} imports {dep}" for name, deps in graph.items()
                  if part(name) == "traffic" and unit(name) != LIVE
                  for dep in deps if part(dep) in ("gate", "ledger"))


def test_only_the_live_group_of_traffic_imports_the_gate_or_the_ledger():
    assert traffic_reaches_the_gate(GRAPH) == []
    for group in GROUPS_OF["traffic"]:
        declared = allowed(f"traffic.{group}") & {"gate", "ledger"}
        assert declared == ({"gate", "ledger"} if f"traffic.{group}" == LIVE else set()), group
    assert any(part(dep) == "gate" for n, deps in GRAPH.items() if unit(n) == LIVE for dep in deps)


def test_the_traffic_check_finds_a_planted_edge():
    assert traffic_reaches_the_gate(planted("gatekeeper.traffic.logs.advice", "gatekeeper.ledger.store")) == [
        "gatekeeper.traffic.logs.advice imports gatekeeper.ledger.store"]
    assert traffic_reaches_the_gate(planted("gatekeeper.traffic.captures.measure", "gatekeeper.gate.kinds")) == [
        "gatekeeper.traffic.captures.measure imports gatekeeper.gate.kinds"]


# --- module maps: each package's docstring names every module and subpackage it holds ---------------------------


def unnamed(package: Path) -> list[str]:
    """The modules and subpackages of ``package`` its docstring leaves out; named is ``name``, ``name/`` or ``name.py``
    in double backquotes (``__main__``, the ``python -m`` hook, aside)."""
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    members = [p.stem for p in package.glob("*.py") if p.stem not in ("__init__", "__main__")]
    members += [d.name for d in package.iterdir() if (d / "__init__.py").is_file()]
    return sorted(m for m in members if not re.search(rf"``{re.escape(m)}(/|\.py)?``", doc))


def test_each_package_names_every_module_it_holds():
    missing = {str(init.parent.relative_to(ROOT.parent)): unnamed(init.parent) for init in ROOT.rglob("__init__.py")}
    assert {package: names for package, names in missing.items() if names} == {}


def test_the_module_map_check_finds_a_planted_module(tmp_path):
    (tmp_path / "__init__.py").write_text('"""Holds ``named`` and the ``inner/`` package."""\n')
    for path in ("named.py", "planted.py", "inner/__init__.py", "data/notes.txt"):
        (tmp_path / path).parent.mkdir(exist_ok=True)
        (tmp_path / path).write_text("")
    assert unnamed(tmp_path) == ["planted"]


def test_docs_layout_names_every_module():
    """docs/layout.md's tree is the map a newcomer reads first: every module and subpackage is in it by name."""
    tree = (ROOT.parent / "docs" / "layout.md").read_text().split("```")[1]
    members = {p.stem for p in ROOT.rglob("*.py") if p.stem not in ("__init__", "__main__")}
    members |= {p.parent.name for p in ROOT.rglob("__init__.py") if p.parent != ROOT}
    assert sorted(m for m in members if not re.search(rf"(?<![\w-]){re.escape(m)}(?![\w-])", tree)) == []
