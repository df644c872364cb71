"""tools/render_results.py: the results tables of README.md and docs/ against the stored files."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from tools import render_results
from tools.render_results import DATA, RENDERERS, ROOT, Page, renderer, run

BLOCK = "throughput-kara"  # renders docs/results/data/throughput/all4/results.jsonl
RUN = Path("throughput") / "all4"


def page_with(tmp_path: Path, *names: str, prose: str = "Some prose.") -> Path:
    page = tmp_path / "page.md"
    page.write_text(prose + "\n\n" + "\n\n".join(f"<!-- results:{n} -->\n<!-- /results:{n} -->" for n in names) + "\n")
    return page


def test_every_committed_table_matches_its_stored_results(capsys: pytest.CaptureFixture[str]) -> None:
    assert render_results.main(["--check"]) == 0
    assert "every results block matches" in capsys.readouterr().out


def test_a_doctored_results_file_fails_the_check_naming_its_block(tmp_path: Path) -> None:
    data = tmp_path / "data"
    shutil.copytree(DATA / RUN, data / RUN)
    page = page_with(tmp_path, BLOCK)
    assert run([page], data, write=True, every_renderer=False) == []  # filled in from the copy
    assert run([page], data, write=False, every_renderer=False) == []
    rows_file = data / RUN / "results.jsonl"
    rows = [json.loads(line) for line in rows_file.read_text().splitlines()]
    rows[0]["tok_s"] *= 1.5
    rows_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (problem,) = run([page], data, write=False, every_renderer=False)
    assert f"block {BLOCK!r} differs from its stored results" in problem


def _readme_copy(tmp_path: Path) -> tuple[str, Path]:
    """The README's text, and where a copy sits so that its links to the data are the same."""
    (tmp_path / "docs" / "results").mkdir(parents=True)
    (tmp_path / "docs" / "results" / "data").symlink_to(DATA)
    return (ROOT / "README.md").read_text(), tmp_path / "README.md"


def test_a_reworded_sentence_outside_the_blocks_passes(tmp_path: Path) -> None:
    text, readme = _readme_copy(tmp_path)
    sentence = "What a user gets today:"
    assert text.count(sentence) == 1, "the README no longer has the sentence this test rewords"
    readme.write_text(text.replace(sentence, "What KvLLM gives a user now:"))
    assert run([readme], tmp_path / "docs" / "results" / "data", write=False, every_renderer=False) == []


def test_a_changed_number_inside_a_block_fails(tmp_path: Path) -> None:
    text, readme = _readme_copy(tmp_path)
    block = text[text.index("<!-- results:summary -->") : text.index("<!-- /results:summary -->")]
    number = re.search(r"\*\*(\d+\.\d+)x\*\*", block)  # the first goodput ratio of the summary table
    assert number is not None, "the README's summary block has no goodput ratio to change"
    doctored = block.replace(number[0], "**9.99x**", 1)
    readme.write_text(text.replace(block, doctored))
    (problem,) = run([readme], tmp_path / "docs" / "results" / "data", write=False, every_renderer=False)
    assert "block 'summary' differs" in problem and "9.99x" in problem


def test_rendering_is_idempotent(tmp_path: Path) -> None:
    data = tmp_path / "data"
    shutil.copytree(DATA / RUN, data / RUN)
    page = page_with(tmp_path, BLOCK, "throughput-kara-mean")
    run([page], data, write=True, every_renderer=False)
    once = page.read_text()
    text, problems, names = render_results.render_page(page, data)
    assert (text, problems, names) == (once, [], {BLOCK, "throughput-kara-mean"})
    run([page], data, write=True, every_renderer=False)
    assert page.read_text() == once


def test_bad_markers_and_unknown_blocks_are_named(tmp_path: Path) -> None:
    page = page_with(tmp_path, "no-such-table")
    page.write_text(page.read_text() + "<!-- results:left-open -->\n")
    problems = run([page], DATA, write=False, every_renderer=False)
    assert any("block 'no-such-table' has no renderer" in p for p in problems)
    assert any("block 'left-open' is never closed" in p for p in problems)


def test_a_renderer_whose_block_no_page_holds_is_named(tmp_path: Path) -> None:
    problems = run([page_with(tmp_path)], DATA, write=False, every_renderer=True)
    assert f"renderer {BLOCK!r} renders no block of any page" in problems


def test_a_new_renderer_takes_a_few_lines(tmp_path: Path) -> None:
    @renderer("test-table")
    def _table(page: Page) -> str:
        return "| a |\n| --- |\n| 1 |\n" + page.source(page.data / "throughput" / "all4" / "results.jsonl")

    try:
        page = page_with(tmp_path, "test-table")
        run([page], DATA, write=True, every_renderer=False)
        assert "| 1 |\n\nFrom [`docs/results/data/throughput/all4/results.jsonl`]" in page.read_text()
    finally:
        del RENDERERS["test-table"]
