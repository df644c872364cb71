"""Every ``kvllm`` command the docs show uses flags the CLI has.

Commands are read from the hand-written docs (README, guides, results pages, design and
models pages, the model cards): fenced shell blocks, with ``\\`` continuations joined, and
inline code spans. Each ``kvllm SUBCOMMAND ...`` is matched to the click command typer
builds, and each ``--flag`` must be one of its options. ``kvllm serve`` passes unknown
flags through to vLLM, so only its own (``--kv-*``) flags are checked.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import typer

from kvllm.cli import app

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted(
    [
        ROOT / "README.md",
        *ROOT.glob("docs/*.md"),
        *ROOT.glob("docs/guide/*.md"),
        *ROOT.glob("docs/results/*.md"),
        *ROOT.glob("kvllm/assets/*/README.md"),
    ]
)
FENCE = re.compile(r"```(?:bash|sh|shell|console)?\n(.*?)```", re.S)
INLINE = re.compile(r"`([^`\n]+)`")
INVOCATION = re.compile(r"(?:^|[\s;&|(])(?:\.venv/bin/)?kvllm((?: [a-z][a-z-]*)+)(.*)")
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")


def invocations(text: str) -> list[str]:
    """Each ``kvllm ...`` command line of ``text``, continuations joined."""
    lines = []
    for block in FENCE.findall(text):
        lines += block.replace("\\\n", " ").splitlines()
    lines += INLINE.findall(FENCE.sub("", text))
    return [line for line in lines if INVOCATION.search(line)]


def resolve(words: list[str]) -> tuple[Any, list[str]]:
    """The click command named by the leading ``words``, and its path."""
    command = typer.main.get_command(app)
    path = []
    for word in words:
        if word not in getattr(command, "commands", {}):
            break
        command = command.commands[word]
        path.append(word)
    return command, path


def unknown_flags(line: str) -> tuple[str, list[str]]:
    """The command a line runs, and the flags it passes that the command lacks. A line
    whose first word after ``kvllm`` is no command is prose (``from kvllm import LLM``),
    and a group named alone (``kvllm bench``) a mention: neither is checked."""
    m = INVOCATION.search(line)
    words = m[1].split()
    command, path = resolve(words)
    if not path or (hasattr(command, "commands") and len(path) == len(words)):
        return " ".join(path), []
    if hasattr(command, "commands"):
        return " ".join(path), [f"(no such command: kvllm {' '.join(words[: len(path) + 1])})"]
    known = {opt for p in command.params for opt in (*p.opts, *p.secondary_opts)}
    flags = FLAG.findall(m[1] + m[2])
    if path == ["serve"]:
        flags = [f for f in flags if f.startswith("--kv-")]
    return " ".join(path), [f for f in flags if f not in known]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_documented_kvllm_commands_use_real_flags(doc: Path) -> None:
    bad = []
    for line in invocations(doc.read_text()):
        command, unknown = unknown_flags(line)
        if unknown:
            bad.append(f"kvllm {command}: {unknown} in `{line.strip()[:140]}`")
    assert not bad, "\n".join(bad)


def test_the_check_can_fail() -> None:
    assert unknown_flags("kvllm calibrate --model kara-reasoner-6l")[1] == ["--model"]
    assert unknown_flags(".venv/bin/kvllm eval --model m --family reason")[1] == []
    assert unknown_flags("kvllm serve m --kv-retention 0.2 --dtype float32")[1] == []
    assert unknown_flags("kvllm serve m --kv-retentoin 0.2")[1] == ["--kv-retentoin"]
    assert unknown_flags("kvllm bench nope --x")[1] == ["(no such command: kvllm bench nope)"]
    assert unknown_flags("from kvllm import LLM") == ("", [])
    assert invocations("```bash\nkvllm eval \\\n  --n 4\n```\nand `kvllm generate --task reason`.") == [
        "kvllm eval    --n 4",
        "kvllm generate --task reason",
    ]
