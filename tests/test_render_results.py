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


def test_a_cell_quotes_its_table_and_a_stale_one_fails(tmp_path: Path) -> None:
    text, readme = _readme_copy(tmp_path)
    data = tmp_path / "docs" / "results" / "data"
    quoted = "Kara keeps <!-- cell:summary | `kara@0.2` | statements right -->{}<!-- /cell --> of them."
    readme.write_text(text + "\n" + quoted.format("0.999") + "\n")
    (problem,) = run([readme], data, write=False, every_renderer=False)
    assert "cell 'summary | `kara@0.2` | statements right' differs" in problem and "'0.999'" in problem
    run([readme], data, write=True, every_renderer=False)
    assert run([readme], data, write=False, every_renderer=False) == []
    block = text[text.index("<!-- results:summary -->") : text.index("<!-- /results:summary -->")]
    row = next(line for line in block.split("\n") if line.startswith("| `kara@0.2` |"))
    assert quoted.format(row.split("|")[3].split(" [")[0].strip()) in readme.read_text()


def test_a_cell_that_names_no_table_cell_is_named(tmp_path: Path) -> None:
    text, readme = _readme_copy(tmp_path)
    readme.write_text(text + "\n<!-- cell:summary | `no-such@0.2` | statements right -->1<!-- /cell -->\n")
    (problem,) = run([readme], tmp_path / "docs" / "results" / "data", write=False, every_renderer=False)
    assert "names no table cell" in problem


def test_a_result_typed_into_prose_fails_and_a_setting_passes(tmp_path: Path) -> None:
    text, readme = _readme_copy(tmp_path)
    data = tmp_path / "docs" / "results" / "data"
    readme.write_text(text + "\nAt r=0.2, `kara@0.5` and a bound of ≥ 0.98, nothing is typed.\n")
    assert run([readme], data, write=False, every_renderer=False) == []
    readme.write_text(text + "\nKara keeps 0.31 of the statements and 40% of the goodput.\n")
    problems = run([readme], data, write=False, every_renderer=False)
    assert [p.split("result ")[1].split(" typed")[0] for p in problems] == ["'0.31'", "'40%'"]


def test_a_cell_picks_a_row_by_several_columns() -> None:
    table = "| pool | system | goodput |\n| --- | --- | ---: |\n| 8x | a | **1.10x** [1.0-1.2] |\n| 16x | a | 0.90x |\n"
    assert render_results.table_cell(table, "where pool=16x; system=a", "goodput") == "0.90x"
    assert render_results.table_cell(table, "where pool=8x; sys=a", "good") == "1.10x"
    with pytest.raises(KeyError):
        render_results.table_cell(table, "where system=a", "goodput")  # two rows: ambiguous


def test_answer_lines_are_counted_by_the_name_they_report(tmp_path: Path) -> None:
    """A reason chain's first statement names the asked variable: an answer line naming it
    counts as naming the question (right or not), one repeating the last result as that miss."""
    import gzip

    from tools.render_results import _answer_lines

    chain = " aa = la07 : lb = la07 : lb10 = aa17\n bb = aa : lc = aa17 : lc02 = bb19\n </think>\n "
    texts = {"1": chain + "aa17", "2": chain + "aa18", "3": chain + "bb19", "4": chain + "cc00"}
    path = tmp_path / "full.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps({"uid": uid, "text": text}) + "\n" for uid, text in texts.items())
    cell = {"problems": [{"uid": uid} for uid in texts], "per_problem": [True, False, False, False]}
    assert _answer_lines(cell, path) == (2, 1, 1)
