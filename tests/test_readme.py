"""README.md: the two commands CI runs, and a row for every registered method."""

from __future__ import annotations

from pathlib import Path

from kvllm.methods import available

README = Path(__file__).resolve().parent.parent / "README.md"


def methods_table(text: str) -> str:
    """The rows of the table under the README's "## Methods" heading."""
    section = text.split("\n## Methods\n", 1)[1].split("\n## ", 1)[0]
    return "\n".join(line for line in section.splitlines() if line.startswith("| `"))


def test_the_methods_table_lists_every_registered_method() -> None:
    rows = methods_table(README.read_text())
    assert [m for m in available() if f"`{m}`" not in rows] == []


def test_the_two_commands_are_there() -> None:
    text = README.read_text()
    assert "make demo" in text and "make test" in text
