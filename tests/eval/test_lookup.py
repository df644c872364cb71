"""The retrieval grades on crafted completions: right, wrong, missing, broken."""

from __future__ import annotations

import pytest

from kvllm.eval.lookup import BUCKETS, bucket, char_to_token, malformed_lines, reads, self_recall, tally
from kvllm.eval.tasks import Difficulty, make_task

PROMPT = "trace: evaluate and report ci.\n bo41\n ku13\n ce = bo + ku\n ci = ce - bo\n<think>"


def test_right_reads_from_prompt_and_from_generated_lines() -> None:
    completion = "\n ce = bo + ku = bo41 + ku13 = ce54\n ci = ce - bo = ce54 - bo41 = ci13\n</think>\n ci13"
    got = reads(PROMPT, completion)
    assert [(r.name, r.source, r.right, r.expected) for r in got] == [
        ("bo", "prompt", True, 41),
        ("ku", "prompt", True, 13),
        ("ce", "generated", True, 54),
        ("bo", "prompt", True, 41),
    ]


def test_a_read_is_checked_against_the_models_own_value_not_the_true_one() -> None:
    # The model wrote ce99 (wrong arithmetic); reading ce99 back is a right lookup,
    # reading the true value 54 is a wrong one.
    own = "\n ce = bo + ku = bo41 + ku13 = ce99\n ci = ce - bo = ce99 - bo41 = ci58\n</think>"
    true = "\n ce = bo + ku = bo41 + ku13 = ce99\n ci = ce - bo = ce54 - bo41 = ci13\n</think>"
    assert [r.right for r in reads(PROMPT, own)] == [True, True, True, True]
    assert [r.right for r in reads(PROMPT, true)] == [True, True, False, True]


def test_wrong_prompt_read_missing_line_and_broken_format() -> None:
    # bo read as 40; ce's line is missing, so its read has no source and is not counted;
    # a broken line is skipped and counted as malformed.
    completion = "\n ci = ce - bo = ce54 - bo40 = ci13\n ce = bo + = bo41 ku13\n</think>"
    got = reads(PROMPT, completion)
    assert [(r.name, r.source, r.right) for r in got] == [("bo", "prompt", False)]
    assert malformed_lines(completion) == 1
    t = tally(PROMPT, completion, window=32)
    assert t.reads == {"prompt": 1, "generated": 0} and t.right == {"prompt": 0, "generated": 0}
    assert t.malformed_lines == 1


def test_reads_after_the_answer_do_not_count() -> None:
    completion = "\n ce = bo + ku = bo41 + ku13 = ce54\n</think>\n ci = ce - bo = ce00 - bo41 = ci13"
    assert len(reads(PROMPT, completion)) == 2


def test_self_recall_compares_the_answer_with_the_models_key_line() -> None:
    assert self_recall("\n key = 37 + 48 = key86\n ba = bo + bo = bo41 + bo41 = ba82\n</think>\n key86")
    assert not self_recall("\n key = 37 + 48 = key86\n</think>\n key85")
    assert not self_recall("\n ba = bo + bo = bo41 + bo41 = ba82\n</think>\n key86")  # no key line first
    assert not self_recall("\n key = 37 + 48 = key86\n no answer")


def test_distances_in_tokens_on_a_real_task() -> None:
    from transformers import AutoTokenizer

    from kvllm.assets import model_path

    tokenizer = AutoTokenizer.from_pretrained(model_path())
    task = make_task("trace", 3, Difficulty(constants=4, steps=6))
    text, owner = char_to_token(tokenizer, tokenizer(task.target)["input_ids"])
    _, prompt_owner = char_to_token(tokenizer, tokenizer(task.prompt)["input_ids"])
    assert text == task.target
    got = reads(task.prompt, text, owner, prompt_owner)
    assert len(got) == 12 and all(r.right for r in got)
    assert all(r.distance is not None and r.distance > 0 for r in got)
    prompt_reads = [r.distance for r in got if r.source == "prompt"]
    generated = [r.distance for r in got if r.source == "generated"]
    # A generated value is read after the line that wrote it, nearer than any constant.
    assert generated and prompt_reads and min(prompt_reads) > 0


@pytest.mark.parametrize(("distance", "label"), [(0, "<W"), (31, "<W"), (32, "W-2W"), (127, "2W-4W"), (128, ">4W")])
def test_buckets(distance: int, label: str) -> None:
    assert bucket(distance, 32) == label
    assert [b[0] for b in BUCKETS] == ["<W", "W-2W", "2W-4W", ">4W"]
    with pytest.raises(ValueError, match="distance=-1"):
        bucket(-1, 32)
