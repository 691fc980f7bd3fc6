"""The package's layers: every module in a room, no room importing from one above it, no import
cycle among ``osdp_lightning`` modules (imports inside functions counted); and every name the
configs and the README point at still imports.

An import of ``osdp_lightning.a.b`` from outside the package ``osdp_lightning.a`` also runs that
package's ``__init__``: it counts as an import of both. Imports under ``if TYPE_CHECKING:`` (for
annotations only) count for the rooms, not for cycles; the root package, whose ``__init__``
registers the strategy and so imports the top room, counts for neither.
"""

from __future__ import annotations

import ast
import importlib
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from hydra.utils import get_object

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "osdp_lightning"
README_MODULE_RE = re.compile(rf"\b{PACKAGE}(?:\.[A-Za-z_]\w*)+")
README_FILE_RE = re.compile(rf"\b{PACKAGE}/(?:\w+/)*\w+\.py\b")


def module_files() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__``)."""
    files = {}
    for path in sorted((REPO / PACKAGE).rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(node: ast.AST, type_checking: bool = False) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement below ``node`` (functions and classes included); those that run only
    under ``if TYPE_CHECKING:`` where ``type_checking``."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child) and not type_checking:
            for other in child.orelse:
                yield from _imports_of_statement(other, type_checking)
            continue
        yield from _imports_of_statement(child, type_checking)


def _imports_of_statement(node: ast.AST, type_checking: bool) -> Iterator[ast.Import | ast.ImportFrom]:
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node
    yield from _imports(node, type_checking)


def _imported_names(module: str, is_package: bool, node: ast.Import | ast.ImportFrom) -> Iterator[str]:
    """Dotted names an import statement may refer to (a module, or a module's attribute)."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
        return
    base = node.module or ""
    if node.level:  # relative: from the module's own package, up ``level - 1`` more
        anchor = module.split(".") if is_package else module.split(".")[:-1]
        anchor = anchor[:len(anchor) - node.level + 1]
        base = ".".join([*anchor, base] if base else anchor)
    for alias in node.names:
        yield f"{base}.{alias.name}"


def _resolved(name: str, modules: set[str]) -> str | None:
    """The module ``name`` is, or whose attribute it is (``None``: not this package's)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _with_packages(importer: str, target: str) -> set[str]:
    """``target`` and the packages above it whose ``__init__`` the import runs (not the importer's own)."""
    parts = target.split(".")
    packages = {".".join(parts[:i]) for i in range(2, len(parts))}
    return {target} | {p for p in packages if not importer.startswith(p + ".")}


def import_graph(type_checking: bool = False) -> dict[str, set[str]]:
    """Module -> the modules of the package it imports, anywhere in its body (and under
    ``if TYPE_CHECKING:`` where ``type_checking``)."""
    files = module_files()
    modules = set(files)
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        is_package = path.name == "__init__.py"
        targets: set[str] = set()
        for node in _imports(ast.parse(path.read_text(), filename=str(path)), type_checking):
            for name in _imported_names(module, is_package, node):
                target = _resolved(name, modules)
                if target is not None:
                    targets |= _with_packages(module, target)
        graph[module] = targets - {module, PACKAGE}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def one_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A closed path through the component's first module: ``[a, b, ..., a]``."""
    members, start = set(component), component[0]
    paths = {start: [start]}
    frontier = [start]
    while frontier:  # breadth first: the shortest way back to the start
        nxt = []
        for node in frontier:
            for target in sorted(graph[node] & members):
                if target == start:
                    return [*paths[node], start]
                if target not in paths:
                    paths[target] = [*paths[node], target]
                    nxt.append(target)
        frontier = nxt
    raise AssertionError(f"{component} is not a cycle")


def test_the_graph_sees_imports_inside_functions_and_not_type_checking() -> None:
    """The graph's own rules, on a module written for them."""
    source = ("from typing import TYPE_CHECKING\nfrom osdp_lightning.profiling.units import ROOT\n"
              "if TYPE_CHECKING:\n    from osdp_lightning.plan.plan import Plan\n"
              "def f():\n    from osdp_lightning.solve import solvers\n    from osdp_lightning.choices.base import Choice\n")
    names = {n for node in _imports(ast.parse(source)) for n in _imported_names("osdp_lightning.x", False, node)}
    modules = set(module_files())
    targets = {t for name in names if (r := _resolved(name, modules)) for t in _with_packages("osdp_lightning.x", r)}
    assert targets == {"osdp_lightning.profiling.units", "osdp_lightning.profiling", "osdp_lightning.solve.solvers",
                       "osdp_lightning.solve", "osdp_lightning.choices.base", "osdp_lightning.choices"}
    hinted = {n for node in _imports(ast.parse(source), type_checking=True)
              for n in _imported_names("osdp_lightning.x", False, node)}
    assert hinted - names == {"osdp_lightning.plan.plan.Plan"}
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]] and one_cycle(graph, ["a", "b", "c"]) == ["a", "b", "c", "a"]


def test_no_import_cycle_among_the_package_modules() -> None:
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import cycles (each: its modules, then one closed path):\n" + "\n".join(
        f"  {component}\n    {' -> '.join(one_cycle(graph, component))}" for component in found)


ROOMS = ("runtime", "state", "profiling", "cost", "choices", "solve", "plan", "apply", "calibrate", "report",
         "integration", "cli")
"""The package's rooms, lowest first: a module imports only from its own room and the rooms below it,
type hints included. The runtime pieces the choices install sit lowest; the Lightning integration
and the command lines on top, with the root package (the public names) above them all."""


def room_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def test_every_module_lives_in_a_room() -> None:
    outside = [m for m in module_files() if m != PACKAGE and room_of(m) not in ROOMS]
    assert not outside, f"modules outside the rooms {ROOMS}: {outside}"


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Each import from a room into a room above it, as ``importer -> imported``."""
    rank = {room: i for i, room in enumerate(ROOMS)}
    return sorted(f"{module} -> {target}" for module, targets in graph.items() if module != PACKAGE
                  for target in targets if target != PACKAGE and rank[room_of(target)] > rank[room_of(module)])


def test_the_room_check_sees_an_upward_import() -> None:
    graph = {"osdp_lightning.cost.budget": {"osdp_lightning.integration.lightning_compat", "osdp_lightning.runtime.faults"},
             "osdp_lightning.cli.train": {"osdp_lightning.cost.budget"}}
    assert upward_imports(graph) == ["osdp_lightning.cost.budget -> osdp_lightning.integration.lightning_compat"]


def test_no_room_imports_from_a_room_above_it() -> None:
    found = upward_imports(import_graph(type_checking=True))
    assert not found, f"imports from a lower room into a higher one (rooms, lowest first: {ROOMS}):\n  " + \
        "\n  ".join(found)


def hydra_targets() -> list[tuple[str, str]]:
    """Every ``_target_`` of every config under conf/, with its file."""
    def walk(node: object) -> Iterator[str]:
        if isinstance(node, dict):
            if isinstance(node.get("_target_"), str):
                yield node["_target_"]
            for value in node.values():
                yield from walk(value)
        elif isinstance(node, list):
            for value in node:
                yield from walk(value)

    return sorted({(target, path.relative_to(REPO).as_posix()) for path in (REPO / "conf").rglob("*.yaml")
                   for target in walk(yaml.safe_load(path.read_text()))})


def test_configs_name_targets() -> None:
    assert len(hydra_targets()) >= 10  # else the walk found nothing to check


@pytest.mark.parametrize("target, config", hydra_targets())
def test_every_hydra_target_imports(target: str, config: str) -> None:
    assert callable(get_object(target)), (config, target)


def readme_names() -> list[str]:
    return sorted(set(README_MODULE_RE.findall((REPO / "README.md").read_text())))


@pytest.mark.parametrize("name", readme_names())
def test_every_module_path_the_readme_names_imports(name: str) -> None:
    """A dotted name: a module, or an attribute of one (``osdp_lightning.cost.cluster.cluster_spec_from_config``)."""
    module, attributes = name, []
    while True:
        try:
            found: object = importlib.import_module(module)
            break
        except ModuleNotFoundError:
            module, _, attribute = module.rpartition(".")
            attributes.insert(0, attribute)
            assert module, f"README.md names {name}, which does not import"
    for attribute in attributes:
        assert hasattr(found, attribute), f"README.md names {name}: {module} has no {attribute}"
        found = getattr(found, attribute)


def test_every_source_file_the_readme_names_exists() -> None:
    named = sorted(set(README_FILE_RE.findall((REPO / "README.md").read_text())))
    missing = [path for path in named if not (REPO / path).is_file()]
    assert not missing, f"README.md names source files that do not exist: {missing}"
