"""The package's imports run one way: no two of its modules import each other.

A circle works only while one side imports lazily or for type checking alone, and breaks
as soon as someone moves an import; both count here (docs/design.md, "Layers").
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


def test_no_two_modules_import_each_other() -> None:
    graph = import_graph()
    circles = sorted((a, b) for a in graph for b in graph[a] if a < b and a in graph[b])
    assert circles == []


def test_the_graph_sees_lazy_imports() -> None:
    """A function-level import counts: the check would miss the circles it is for otherwise."""
    graph = import_graph()
    assert "kvllm.eval.grading" in graph["kvllm.eval.problems"]  # imported inside Problem.grade
    assert "kvllm.vllm.server" in graph["kvllm.vllm.plugin"]  # imported inside register()
