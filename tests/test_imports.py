"""The house's import rules, read from the source (every ``import`` statement, function-local
ones included): no module imports one that imports it back (directly or around a longer
circle), no package of ``otbrl`` does either, and no floor imports a higher one (DESIGN's
floors, docs/architecture.md)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "otbrl"
# the floors of docs/architecture.md: a module may import its own floor or a lower one
FLOORS = {
    "otbrl.errors": 0,
    # how a component declares its settings, and lazy package exports: every floor uses them
    "otbrl.settings": 0,
    "otbrl.lazy": 0,
    # the CLI's schema, loading and checks: beside the run layer, it composes the components'
    # own settings (nothing below the run layer imports it)
    "otbrl.config": 4,
    "otbrl.user_code": 0,
    "otbrl.quiet": 0,
    "otbrl.children": 0,
    "otbrl.ops": 1,
    "otbrl.algos": 1,
    "otbrl.data": 2,
    "otbrl.rewards": 2,
    "otbrl.models": 2,
    "otbrl.tools": 2,
    "otbrl.envs": 2,
    "otbrl.integrations": 2,
    "otbrl.engine": 3,
    "otbrl.rollout": 3,
    "otbrl.store": 3,
    "otbrl.run": 4,
    "otbrl.report": 4,
    "otbrl.research": 5,
    "otbrl.cli": 6,
    "otbrl.__main__": 6,
    "otbrl": 0,  # the package's own __init__: the version, nothing imported
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in SRC.rglob("*.py"):
        parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the otbrl modules it imports (``from pkg import name`` counts as importing
    ``pkg.name`` when that is a module, else ``pkg``)."""
    modules = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        edges = set()
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package
                    for _ in range(node.level - 1):
                        anchor = anchor.rpartition(".")[0]
                    base = f"{anchor}.{base}" if base else anchor
                targets = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                    for a in node.names
                ]
            else:
                continue
            for target in targets:
                resolved = resolve(target) if target.startswith("otbrl") else None
                if resolved and resolved != module:
                    edges.add(resolved)
        graph[module] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
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
    return found


def package_of(module: str) -> str:
    """``otbrl.run.trainer`` -> ``otbrl.run``; top-level modules are their own package."""
    return ".".join(module.split(".")[:2])


def test_no_module_import_cycle():
    assert cycles(import_graph()) == []


def test_no_package_import_cycle():
    packages: dict[str, set[str]] = {}
    for module, edges in import_graph().items():
        packages.setdefault(package_of(module), set()).update(
            package_of(e) for e in edges if package_of(e) != package_of(module)
        )
    assert cycles(packages) == []


def test_no_floor_imports_a_higher_floor():
    upward = []
    for module, edges in import_graph().items():
        floor = FLOORS[package_of(module)]
        upward += [
            f"{module} (floor {floor}) imports {e} (floor {FLOORS[package_of(e)]})"
            for e in sorted(edges)
            if FLOORS[package_of(e)] > floor
        ]
    assert upward == []


def test_the_cycle_finder_finds_cycles():
    """The checks above can fail: a planted two-module and a three-module circle are found."""
    graph = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c"}, "f": {"a"}}
    assert sorted(cycles(graph)) == [["a", "b"], ["c", "d", "e"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_every_package_has_a_floor():
    assert {package_of(m) for m in import_graph()} <= set(FLOORS)


def test_every_otbrl_import_names_a_module_that_exists():
    """``from otbrl.a.b import c`` names an existing module ``otbrl.a.b`` (function-local imports
    included): after a module moves, a lazy import of its old path fails only when that code
    path runs — this finds it from the source."""
    modules = _modules()
    missing = []
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            for name in names:
                if name.startswith("otbrl") and name not in modules:
                    missing.append(f"{module}:{node.lineno}: {name}")
    assert not missing, f"imports of otbrl modules that do not exist: {missing}"
