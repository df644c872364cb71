"""The package's imports run one way: no module imports itself back, by any path.

A circle works only while one side imports lazily or for type checking alone, and breaks
as soon as someone moves an import; both count here (docs/design.md, "Layers"). A circle
may be of any length: a -> b -> c -> a breaks as a <-> b does.
"""

from __future__ import annotations

import ast
from pathlib import Path

import kvllm

ROOT = Path(kvllm.__file__).parent


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Each kvllm module's kvllm imports, at any depth of its code (lazy ones too)."""
    modules = {_module(path): path for path in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from kvllm.hf import attention` imports the submodule, not the package's names.
                subs = [f"{node.module}.{alias.name}" for alias in node.names]
                targets = [t for t in subs if t in modules] or [node.module]
            else:
                continue
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle through each group of modules that import one another, by any path.

    The groups are the graph's strongly connected components of more than one module
    (Tarjan's algorithm, iterative); each comes back as one closed path through it,
    ``[a, b, ..., a]``, so that a failure names the imports to cut.
    """
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = set(stack[stack.index(node) :])
                    del stack[stack.index(node) :]
                    if len(group) > 1:
                        groups.append(group)
            elif target not in index:
                index[target] = low[target] = len(index)
                stack.append(target)
                work.append((target, iter(sorted(graph[target]))))
            elif target in stack:
                low[node] = min(low[node], index[target])
    return [_path_through(graph, group) for group in groups]


def _path_through(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """A closed path from the group's first module back to it, inside the group (breadth first)."""
    start = min(group)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        node = frontier.pop(0)
        for target in sorted(graph[node] & group):
            if target == start:
                path = [node]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return [start, *reversed(path[:-1]), start]
            if target not in came_from:
                came_from[target] = node
                frontier.append(target)
    raise AssertionError(f"{sorted(group)} is not a circle")


def test_no_module_imports_itself_back() -> None:
    assert circles(import_graph()) == []


def test_circles_of_any_length_are_found() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"f"}, "f": {"e"}}
    assert circles(graph) == [["a", "b", "c", "a"], ["e", "f", "e"]]
    assert circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_the_graph_sees_lazy_imports() -> None:
    """A function-level import counts: the check would miss the circles it is for otherwise."""
    graph = import_graph()
    assert "kvllm.eval.grading" in graph["kvllm.eval.problems"]  # imported inside Problem.grade
    assert "kvllm.vllm.server" in graph["kvllm.vllm.plugin"]  # imported inside register()
