"""docs/design.md's module table names every module of the package, and only modules
that exist: the maintainer's map stays the code's."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).parents[1]
PACKAGE = ROOT / "kvllm"


def _mapped() -> set[str]:
    """The paths the "Modules" table names, relative to the package. A row whose first cell
    opens with a folder (`methods/` `snapkv.py`, ...) names files in that folder."""
    text = (ROOT / "docs" / "design.md").read_text()
    table = text.split("\n## Modules", 1)[1].split("\n## ", 1)[0]
    names: set[str] = set()
    for row in re.findall(r"^\| (.+?) \|", table, re.M):
        cells = re.findall(r"`([^`]+)`", row)
        if cells and cells[0].endswith("/") and len(cells) > 1:
            names |= {cells[0] + name for name in cells[1:]}
        else:
            names |= set(cells)
    return names


def _docstring_only(path: Path) -> bool:
    body = ast.parse(path.read_text()).body
    return all(isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) for node in body)


def test_the_module_table_names_every_module_and_no_other() -> None:
    modules = {
        path.relative_to(PACKAGE).as_posix()
        for path in PACKAGE.rglob("*.py")
        if not (path.name == "__init__.py" and _docstring_only(path))
    }
    mapped = {name for name in _mapped() if name.endswith(".py")}
    assert sorted(modules - mapped) == [], "modules docs/design.md's table does not name"
    assert sorted(mapped - modules) == [], "files docs/design.md's table names that do not exist"


def test_a_folder_row_names_the_files_in_that_folder() -> None:
    assert {"methods/snapkv.py", "methods/random_keep.py", "vllm/runner.py"} <= _mapped()
