"""The package's import graph, read from the source with ``ast`` (nothing is imported): no import
cycles, and dependencies that point one way (comm <- rules <- strategies; data, offload and
launcher use comm at most).

Every import statement counts, imports inside functions included: an import deferred into a
function still makes two modules that cannot be read, or moved, one without the other, and hiding a
cycle that way is how cycles came back (issue 38). Imports under ``if TYPE_CHECKING:`` are the one
exception for cycles (they never run; annotations may name a type that depends on the importer);
for the layering they count too: an upward import is an upward dependency however it is written.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

PACKAGE = "lightning_mpi"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE

#: Modules every layer may use: no torch, no MPI, no Lightning (how options are defined and checked).
FOUNDATION: tuple[str, ...] = (f"{PACKAGE}.options",)

#: What each layer may import from this package, besides itself (package top level: anything).
ALLOWED_DEPENDENCIES: dict[str, tuple[str, ...]] = {
    f"{PACKAGE}.comm": (),
    f"{PACKAGE}.rules": (f"{PACKAGE}.comm",),
    f"{PACKAGE}.data": (f"{PACKAGE}.comm",),
    f"{PACKAGE}.offload": (f"{PACKAGE}.comm",),
    f"{PACKAGE}.launcher": (f"{PACKAGE}.comm",),
}

#: Known upward imports, (importer, imported): none are left.
UPWARD_IMPORTS_TO_REMOVE: frozenset[tuple[str, str]] = frozenset()

#: Lazy aliases of public classes, resolved through the package's public namespace on first use
#: (``lightning_mpi.data.PrefetchDataModule`` is ``lightning_mpi.PrefetchDataModule``, which the
#: strategy layer builds on the user's Lightning package). Inside ``__getattr__``, never at import.
PUBLIC_ALIASES: frozenset[tuple[str, str]] = frozenset(
    {(f"{PACKAGE}.data", PACKAGE), (f"{PACKAGE}.offload", PACKAGE)}
)


@dataclass(frozen=True)
class Edge:
    importer: str
    imported: str
    line: int
    module_level: bool
    #: under ``if TYPE_CHECKING:`` (never run)
    type_checking: bool


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(ROOT.rglob("*.py"))}


def _resolve(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module of ``from <module> import ...`` (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _type_checking(tree: ast.Module) -> set[int]:
    """ids of the import nodes in the body of an ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``)."""
    found: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            found.update(id(child) for statement in node.body for child in ast.walk(statement))
    return found


def _module_level(tree: ast.Module) -> set[int]:
    """ids of the import nodes that run when the module is imported (not inside a def or class)."""
    found: set[int] = set()

    def visit(statements: list[ast.stmt]) -> None:
        for statement in statements:
            if isinstance(statement, (ast.Import, ast.ImportFrom)):
                found.add(id(statement))
            elif isinstance(statement, (ast.If, ast.Try, ast.With)):
                for block in ("body", "orelse", "finalbody", "handlers"):
                    for child in getattr(statement, block, []):
                        visit(child.body if isinstance(child, ast.ExceptHandler) else [child])

    visit(tree.body)
    return found


@lru_cache(maxsize=1)
def edges() -> tuple[Edge, ...]:
    """Every import of one of this package's modules by another, with where it is."""
    known = modules()
    found: list[Edge] = []
    for name, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        top = _module_level(tree)
        typing_only = _type_checking(tree)
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                source = _resolve(name, path.name == "__init__.py", node)
                # ``from package import submodule`` imports the submodule; ``from module import name``
                # imports the module.
                targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in known else source for a in node.names]
            for target in targets:
                if target in known and target != name:
                    found.append(Edge(name, target, node.lineno, id(node) in top, id(node) in typing_only))
    return tuple(found)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_graph_is_read():
    # guards the check below against reading nothing: these imports exist today
    found = {(e.importer, e.imported) for e in edges() if e.module_level}
    assert (f"{PACKAGE}.comm.collectives", f"{PACKAGE}.comm.transport") in found
    assert (f"{PACKAGE}.launcher.cli", f"{PACKAGE}.launcher.command") in found  # a relative import
    inside = {(e.importer, e.imported) for e in edges() if not e.module_level and not e.type_checking}
    assert (f"{PACKAGE}.strategies.registry", f"{PACKAGE}.strategies.build") in inside  # inside a function


def test_type_checking_imports_are_told_apart():
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a\nelse:\n    import b\n"
    tree = ast.parse(source + "def f():\n    import c\n")
    imports = {node.names[0].name: id(node) for node in ast.walk(tree) if isinstance(node, ast.Import)}
    assert _type_checking(tree) & set(imports.values()) == {imports["a"]}
    assert _module_level(tree) & set(imports.values()) == {imports["a"], imports["b"]}


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def _run_time_graph() -> dict[str, set[str]]:
    """Importer -> imported, for every import that can run: module level or inside a function."""
    graph: dict[str, set[str]] = {}
    for edge in edges():
        if not edge.type_checking:
            graph.setdefault(edge.importer, set()).add(edge.imported)
    return graph


def test_no_import_cycles():
    found = cycles(_run_time_graph())
    assert found == [], f"import cycles (every import that runs, inside functions too): {found}"


def test_the_strategies_know_no_rule_but_through_the_contract():
    # What a strategy needs from a rule is declared on the rule contract (rules.base); the one
    # list of rules the strategies offer is rules.catalog. No other rule module is imported.
    allowed = {f"{PACKAGE}.rules.base", f"{PACKAGE}.rules.catalog"}
    wrong = [
        f"{edge.importer}:{edge.line} imports {edge.imported}"
        for edge in edges()
        if _in(edge.importer, f"{PACKAGE}.strategies") and _in(edge.imported, f"{PACKAGE}.rules")
        if edge.imported not in allowed
    ]
    assert wrong == []


def test_dependencies_point_one_way():
    wrong = []
    for edge in edges():
        layer = next((p for p in ALLOWED_DEPENDENCIES if _in(edge.importer, p)), None)
        if layer is None or _in(edge.imported, layer):
            continue
        allowed = (*ALLOWED_DEPENDENCIES[layer], *FOUNDATION)
        if not any(_in(edge.imported, a) for a in allowed):
            if (edge.importer, edge.imported) in PUBLIC_ALIASES and not edge.module_level:
                continue
            if (edge.importer, edge.imported) not in UPWARD_IMPORTS_TO_REMOVE:
                wrong.append(f"{edge.importer}:{edge.line} imports {edge.imported}")
    assert wrong == []


def test_the_known_upward_imports_are_still_there():
    # When one is removed, drop it from UPWARD_IMPORTS_TO_REMOVE so that it cannot come back.
    found = {(e.importer, e.imported) for e in edges()}
    assert UPWARD_IMPORTS_TO_REMOVE <= found
