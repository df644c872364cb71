"""The repository speaks of itself alone: no tracked text names a tracker issue, a work
session's folder, or a path on the machine it was written on. A user has none of them."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
THIS = Path(__file__).resolve().relative_to(ROOT).as_posix()

#: Files read as bytes that are not text, whatever they hold.
BINARY_SUFFIXES = (".safetensors", ".png", ".gz", ".jpg", ".jpeg", ".pdf", ".pt", ".bin", ".npy", ".npz")
MAX_BYTES = 2 * 1024 * 1024

PATTERNS = {
    "tracker label": re.compile(r"(?i)\bissues? ?#?[0-9]"),
    "session-named path": re.compile(r"(?i)session[-_ ]?[0-9]"),
    "absolute home or work path": re.compile(r"(?<![\w.])/(?:work|root|home/[a-z][\w-]*)/"),
}


def tracked_text_files() -> list[Path]:
    """Every tracked file that is text and at most 2 MB, this test's own file left out."""
    try:
        listing = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: no tracked files to read")
    files = []
    for name in listing.split("\0"):
        if not name or name == THIS or name.lower().endswith(BINARY_SUFFIXES):
            continue
        path = ROOT / name
        if not path.is_file() or path.stat().st_size > MAX_BYTES:
            continue
        files.append(path)
    return files


def hits(path: Path) -> list[str]:
    """``file:line: kind: text`` for each line of ``path`` that a pattern matches."""
    data = path.read_bytes()
    if b"\0" in data:
        return []
    text = data.decode("utf-8", errors="replace")
    found = []
    for number, line in enumerate(text.splitlines(), start=1):
        for kind, pattern in PATTERNS.items():
            match = pattern.search(line)
            if match is not None:
                start = max(match.start() - 40, 0)
                excerpt = line[start : match.end() + 40].strip()
                found.append(f"{path.relative_to(ROOT).as_posix()}:{number}: {kind}: {excerpt}")
    return found


ISSUE = "iss" + "ue"


def test_patterns_catch_what_they_are_for() -> None:
    samples = {
        # Built, not typed, so that a grep of the tree for a tracker label finds none here either.
        "tracker label": [f"as {ISSUE} 22 asks", f"({ISSUE.title()} #12)", f"{ISSUE}s 14, 22 and 23"],
        "session-named path": ["docs/training-attempts/second-model-session20/stage10a", "session 3"],
        "absolute home or work path": ['"/work/main/kvllm/assets"', "/root/.cache/x", "/home/alice/x"],
    }
    for kind, lines in samples.items():
        for line in lines:
            assert PATTERNS[kind].search(line), (kind, line)
    clean = [
        "a streaming-input session",
        f"t{ISSUE} 3",
        "/tmp/kvllm-out/work/x",
        "./work/x",
        "https://example.org/work/x",
        "@pytest.fixture(scope='session')",
    ]
    for line in clean:
        assert not any(pattern.search(line) for pattern in PATTERNS.values()), line


def test_tracked_text_names_no_issue_session_or_machine_path() -> None:
    found = [hit for path in tracked_text_files() for hit in hits(path)]
    assert not found, "tracked text that speaks of the tracker, a work session or this machine:\n" + "\n".join(found)
