"""tools/check_docs.py: the README's headline numbers against the stored results files."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools import check_docs

README = check_docs.ROOT / "README.md"


def doctored(tmp_path: Path, old: str, new: str) -> Path:
    """A copy of the README with its one ``old`` replaced by ``new``."""
    text = README.read_text()
    assert text.count(old) == 1, f"{old!r} is not in the README exactly once"
    copy = tmp_path / "README.md"
    copy.write_text(text.replace(old, new))
    return copy


def test_the_readme_matches_its_stored_results(capsys: pytest.CaptureFixture[str]) -> None:
    assert check_docs.main([str(README)]) == 0
    assert "every number matches" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("old", "new", "named", "stated", "recomputed"),
    [
        ("0.686-0.729", "0.686-0.730", "Kara at r=0.2", "0.730", "0.729"),
        ("0.846-0.866", "0.846-0.867", "second testbed: Kara at r=0.2", "0.867", "0.866"),
        ("paired intervals excluding 0, and above", "paired intervals excluding 1, and above", "reach 0", "1", "0"),
        (
            "serves 1.65x",
            "serves 1.68x",
            "kara (vLLM's admission rule) over vanilla-default, mean over C=16-128",
            "1.68",
            "1.65",
        ),
        ("1.66x [1.53-1.85]", "1.66x [1.53-1.86]", "kvllm serve at C=32", "1.86", "1.85"),
        ("0.99x [0.84-1.08]", "1.30x [0.84-1.08]", "kvllm serve's p99 ITL", "1.30", "0.99"),
    ],
)
def test_an_altered_number_fails_naming_it(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    old: str,
    new: str,
    named: str,
    stated: str,
    recomputed: str,
) -> None:
    assert check_docs.main([str(doctored(tmp_path, old, new))]) == 1
    (message,) = capsys.readouterr().err.splitlines()
    assert named in message
    assert f"README says {stated}, " in message and message.endswith(f"gives {recomputed}")


def test_a_reworded_claim_fails_rather_than_going_unchecked(tmp_path: Path) -> None:
    readme = doctored(tmp_path, "averaged over 16, 32, 64 and 128", "averaged over C")
    (problem,) = check_docs.check(readme.read_text())
    assert "no longer says" in problem and "mean over C=16-128" in problem


def test_the_layout_table_lists_every_registered_method(tmp_path: Path) -> None:
    readme = doctored(tmp_path, "`kara-far`, `kara-late`, ", "")
    assert check_docs.check(readme.read_text()) == [
        f"layout table: the {check_docs.METHODS_ROW} row does not list `{m}`" for m in ("kara-far", "kara-late")
    ]


def test_a_claim_that_fits_two_sentences_fails(tmp_path: Path) -> None:
    # The README's sentence twice: a check of the first would pass whichever it meant.
    sentence = "Kara keeps 0.856 of Full KV's"
    readme = doctored(tmp_path, sentence, f"{sentence} reads, and again: {sentence}")
    (problem,) = check_docs.check(readme.read_text())
    assert "2 times" in problem and "Kara's fidelity as a share of Full KV's" in problem
