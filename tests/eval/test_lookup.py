"""The retrieval grades on crafted completions: right, wrong, missing, broken."""

from __future__ import annotations

import dataclasses

import pytest

from kvllm.eval.lookup import (
    BUCKETS,
    LookupTally,
    Read,
    answer_recall,
    bucket,
    char_to_token,
    forced_recall,
    forced_tally,
    malformed_lines,
    modal_value,
    reads,
    self_recall,
    tally,
)
from kvllm.eval.tasks import OPS, REASON_DIFFICULTY, Difficulty, make_task

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
    # Counted by hand from the shipped tokenizer's pieces: the prompt is 62 tokens, its
    # constants' digits start at tokens 9 (su), 13 (ta), 17 (te) and 21 (ti). Every
    # statement line is 18 tokens (one name token, one token per digit), line k's first
    # read's digits at 62 + 8 + 18k, its second's at 62 + 12 + 18k, its result's at
    # 62 + 16 + 18k. A value written on the line before is read 10 or 14 tokens later;
    # `to`, written on line 0 and read on line 5, 82 tokens later: farther back than the
    # prompt's `ta` read on line 0 (57), so a generated source is not always the nearer.
    assert [(r.name, r.source, r.distance) for r in got] == [
        ("ta", "prompt", 57),
        ("ta", "prompt", 61),
        ("to", "generated", 10),
        ("su", "prompt", 83),
        ("ta", "prompt", 93),
        ("tu", "generated", 14),
        ("va", "generated", 10),
        ("ta", "prompt", 115),
        ("ti", "prompt", 121),
        ("ta", "prompt", 133),
        ("to", "generated", 82),
        ("vi", "generated", 14),
    ]


def _owner(pieces: list[str]) -> tuple[str, list[int]]:
    """The text of ``pieces`` and, per character, the index of its piece: a tokenization
    written out by hand, so that every token position below can be counted."""
    return "".join(pieces), [i for i, piece in enumerate(pieces) for _ in piece]


# PROMPT, cut into 29 tokens. `bo`'s name takes two tokens and its digits one, `ku`'s
# digits two: a distance measured from a name, or from a read's last digit instead of
# its first, comes out different from the one measured between first digits.
PROMPT_PIECES = [
    "trace", ":", " evaluate", " and", " report", " ci", ".", "\n",  # 0-7
    " b", "o", "41", "\n",  # 8-11: bo's digits at 10
    " ku", "1", "3", "\n",  # 12-15: ku's digits at 13
    " ce", " =", " bo", " +", " ku", "\n",  # 16-21
    " ci", " =", " ce", " -", " bo", "\n",  # 22-27
    "<think>",  # 28
]  # fmt: skip
# The completion after those 29 prompt tokens: position = 29 + index.
COMPLETION_PIECES = [
    "\n", " ce", " =", " bo", " +", " ku", " =",  # 0-6
    " bo", "4", "1", " +", " ku", "13", " =", " ce", "5", "4",  # 7-16: reads at 8, 12; ce's digits at 15
    "\n", " ci", " =", " ce", " -", " bo", " =",  # 17-23
    " ce", "54", " -", " b", "o", "4", "1", " =", " ci", "13",  # 24-33: reads at 25, 29
    "\n", "</think>", "\n", " ci", "13",  # 34-38
]  # fmt: skip


def test_distances_count_tokens_between_first_digits_across_prompt_and_completion() -> None:
    prompt, prompt_owner = _owner(PROMPT_PIECES)
    completion, owner = _owner(COMPLETION_PIECES)
    assert prompt == PROMPT and len(PROMPT_PIECES) == 29
    got = reads(PROMPT, completion, owner, prompt_owner)
    assert [(r.name, r.source, r.distance) for r in got] == [
        ("bo", "prompt", 29 + 8 - 10),  # 27
        ("ku", "prompt", 29 + 12 - 13),  # 28
        ("ce", "generated", 25 - 15),  # 10: both in the completion, no prompt offset
        ("bo", "prompt", 29 + 29 - 10),  # 48
    ]
    # Without both maps there are no distances, and no distance bucket is counted.
    assert all(r.distance is None for r in reads(PROMPT, completion, owner, None))
    assert tally(PROMPT, completion, 8, owner, None).bucket_reads == {"<W": 0, "W-2W": 0, "2W-4W": 0, ">4W": 0}


@pytest.mark.parametrize(("window", "label"), [(11, "<W"), (10, "W-2W"), (5, "2W-4W"), (2, ">4W")])
def test_tally_buckets_the_generated_read_by_its_distance(window: int, label: str) -> None:
    # The one generated read is 10 tokens back; the three prompt reads stay out of the
    # buckets whatever their distance.
    _, prompt_owner = _owner(PROMPT_PIECES)
    completion, owner = _owner(COMPLETION_PIECES)
    t = tally(PROMPT, completion, window, owner, prompt_owner)
    assert t.reads == {"prompt": 3, "generated": 1} and t.right == {"prompt": 3, "generated": 1}
    assert t.bucket_reads == {b: int(b == label) for b, _, _ in BUCKETS}
    assert t.bucket_right == t.bucket_reads


def test_lookup_tally_counts_each_read_in_its_distance_bucket() -> None:
    def read(source: str, distance: int | None, right: bool) -> Read:
        return Read("x", 0, right, 1, source, distance)

    t = LookupTally()
    added = [
        read("generated", 0, True),  # <W: [0, 32)
        read("generated", 31, False),
        read("generated", 32, True),  # W-2W: [32, 64)
        read("generated", 63, True),
        read("generated", 64, False),  # 2W-4W: [64, 128)
        read("generated", 127, True),
        read("generated", 128, True),  # >4W: [128, inf)
        read("generated", 5000, False),
        read("generated", 1000, False),
        read("generated", None, True),  # no offsets: counted by source, not by distance
        read("prompt", 10, True),  # prompt reads are never bucketed
        read("prompt", 40, False),
    ]
    for r in added:
        t.add(r, 32)
    assert t.reads == {"prompt": 2, "generated": 10}
    assert t.right == {"prompt": 1, "generated": 6}
    assert t.bucket_reads == {"<W": 2, "W-2W": 2, "2W-4W": 2, ">4W": 3}
    assert t.bucket_right == {"<W": 1, "W-2W": 2, "2W-4W": 1, ">4W": 1}


def test_forced_tally_buckets_the_argmax_reads_by_distance() -> None:
    """Teacher-forced (docs/appendix/accuracy-record.md's by-distance table): the reads of the forced
    completion, graded on the argmax at their digits, in the buckets of their distance."""
    from transformers import AutoTokenizer

    from kvllm.assets import model_path

    tokenizer = AutoTokenizer.from_pretrained(model_path())
    task = make_task("trace", 3, Difficulty(constants=4, steps=6))
    forced = tokenizer(task.target)["input_ids"]
    # The argmax spells the forced tokens, except at line 5's read of `to` (82 tokens
    # back, see test_distances_in_tokens_on_a_real_task): its digits are tokens 98 and 99.
    predictions = list(forced)
    assert tokenizer.decode(forced[97:100]) == " to00"
    predictions[99] = tokenizer(" 1")["input_ids"][-1]
    assert tokenizer.decode(predictions[98:100]) == "01"
    t = forced_tally(tokenizer, task.prompt, *char_to_token(tokenizer, forced), predictions, 32)
    # Generated reads at 10, 14, 10, 82, 14 tokens: four under W = 32, one in [2W, 4W).
    assert t.reads == {"prompt": 7, "generated": 5} and t.right == {"prompt": 7, "generated": 4}
    assert t.bucket_reads == {"<W": 4, "W-2W": 0, "2W-4W": 1, ">4W": 0}
    assert t.bucket_right == {"<W": 4, "W-2W": 0, "2W-4W": 0, ">4W": 0}


@pytest.mark.parametrize("family", ["reason", "gen-needle"])
def test_forced_recall_grades_the_argmax_at_the_answers_digits(family: str) -> None:
    """Forced recall reads the model's prediction at the answer, not the forced answer."""
    from transformers import AutoTokenizer

    from kvllm.assets import model_path

    tokenizer = AutoTokenizer.from_pretrained(model_path())
    d = REASON_DIFFICULTY if family == "reason" else Difficulty(constants=4, steps=6)
    task = make_task(family, 7, d)
    forced = tokenizer(task.target, add_special_tokens=False)["input_ids"]
    decoded = char_to_token(tokenizer, forced)
    # A perfect predictor's argmax is each forced token.
    assert forced_recall(tokenizer, task.prompt, family, *decoded, forced) is True
    # The answer is the last two digits of the text: change the prediction of the last digit.
    assert tokenizer.decode(forced[-1:]).strip() == task.answer[-1]
    wrong = str((int(task.answer[-1]) + 1) % 10)
    predictions = [*forced[:-1], tokenizer(f" {wrong}", add_special_tokens=False)["input_ids"][-1]]
    assert tokenizer.decode(predictions[-1:]).strip() == wrong
    assert forced_recall(tokenizer, task.prompt, family, *decoded, predictions) is False
    # Predictions elsewhere do not count.
    elsewhere = [*predictions[:-3], *forced[-3:]]
    elsewhere[3] = elsewhere[5]
    assert forced_recall(tokenizer, task.prompt, family, *decoded, elsewhere) is True


def test_forced_recall_is_none_for_families_without_a_recall() -> None:
    from transformers import AutoTokenizer

    from kvllm.assets import model_path

    tokenizer = AutoTokenizer.from_pretrained(model_path())
    task = make_task("trace", 3, Difficulty(constants=4, steps=6))
    forced = tokenizer(task.target, add_special_tokens=False)["input_ids"]
    assert forced_recall(tokenizer, task.prompt, "trace", *char_to_token(tokenizer, forced), forced) is None


@pytest.mark.parametrize(("distance", "label"), [(0, "<W"), (31, "<W"), (32, "W-2W"), (127, "2W-4W"), (128, ">4W")])
def test_buckets(distance: int, label: str) -> None:
    assert bucket(distance, 32) == label
    assert [b[0] for b in BUCKETS] == ["<W", "W-2W", "2W-4W", ">4W"]
    with pytest.raises(ValueError, match="distance=-1"):
        bucket(-1, 32)


REASON_PROMPT = "reason: evaluate and report ce.\n bo41\n ku13\n ce = bo + ku\n da = ce + bo\n<think>"


def test_reason_check_lines_re_read_three_values_and_write_none() -> None:
    completion = (
        "\n ce = bo + ku = bo41 + ku13 = ce54\n so ce is 54.\n hmm, that looks right."
        "\n check ce = bo + ku = bo41 + ku12 = ce55"  # ku and ce misread; the check writes nothing
        "\n da = ce + bo = ce54 + bo41 = da95\n</think>\n ce54"
    )
    got = reads(REASON_PROMPT, completion)
    assert [(r.name, r.source, r.right) for r in got] == [
        ("bo", "prompt", True),
        ("ku", "prompt", True),
        ("bo", "prompt", True),
        ("ku", "prompt", False),
        ("ce", "generated", False),
        ("ce", "generated", True),  # still ce54: the check's ce55 is not a write
        ("bo", "prompt", True),
    ]
    assert malformed_lines(completion) == 0
    assert malformed_lines(completion.replace("so ce is 54.", "so ce is five.")) == 1
    assert malformed_lines(completion.replace("hmm, that looks right.", "hmm, that looks wrong.")) == 1


def test_answer_recall_reads_the_last_value_written_for_the_asked_name() -> None:
    right = "\n ce = bo + ku = bo41 + ku13 = ce99\n</think>\n ce99"  # wrong arithmetic, right recall
    assert answer_recall(REASON_PROMPT, right)
    assert not answer_recall(REASON_PROMPT, right.replace("</think>\n ce99", "</think>\n ce54"))
    assert not answer_recall(REASON_PROMPT, "\n da = ce + bo = ce54 + bo41 = da95\n</think>\n ce54")  # no ce line
    with pytest.raises(ValueError, match="report NAME"):
        answer_recall("no header\n<think>", right)


def test_prompt_distances_count_a_trailing_special_token() -> None:
    """A prompt ending in a special token that decodes to nothing (the test tokenizer's
    <think>) is one token longer than its text shows: given the prompt's length, prompt
    reads reach back one token further than the text-derived count."""
    from kvllm.testing import train_tokenizer

    tok = train_tokenizer()
    prompt_ids = tok(PROMPT)["input_ids"]
    _, prompt_owner = char_to_token(tok, prompt_ids)
    assert prompt_owner[-1] + 1 == len(prompt_ids) - 1  # <think> decodes to no character
    completion = "\n ce = bo + ku = bo41 + ku13 = ce54\n</think>"
    text, owner = char_to_token(tok, tok(completion, add_special_tokens=False)["input_ids"])
    short = reads(PROMPT, text, owner, prompt_owner)
    exact = reads(PROMPT, text, owner, prompt_owner, len(prompt_ids))
    assert [r.distance - s.distance for r, s in zip(exact, short, strict=True)] == [1, 1]


# A chain that writes 00 three times out of four; its reads of 00 are the floor.
MODAL_PROMPT = "trace: evaluate and report dd.\n bo41\n ku13\n<think>"
MODAL = (
    "\n aa = bo - bo = bo41 - bo41 = aa00"  # prompt reads: not in the floor
    "\n bb = aa + aa = aa00 + aa00 = bb00"  # two generated reads of 00
    "\n cc = bb + ku = bb00 + ku13 = cc13"  # one of 00
    "\n dd = cc - cc = cc13 - cc13 = dd00"  # two of 13
    "\n ee = aa + cc = aa00 + cc12 = ee12"  # one of 00, one of 13 misread
    "\n</think>"
)


def test_modal_value_is_the_most_common_and_the_smallest_among_ties() -> None:
    assert modal_value([13, 0, 13, 0, 7]) == 0
    assert modal_value([5, 9, 9, 5]) == 5
    assert modal_value([42]) == 42
    assert modal_value([]) is None


def test_the_floor_is_the_generated_reads_of_the_chains_modal_value() -> None:
    t = tally(MODAL_PROMPT, MODAL, window=32)
    assert t.reads["generated"] == 7 and t.right["generated"] == 6
    # 00 is read four times (bb's two reads, cc's and ee's first), all right; 13 three times, one misread.
    assert (t.modal_reads, t.modal_right) == (4, 4)
    # Five results: aa00 bb00 cc13 dd00 ee12; three are the modal 00.
    assert (t.results, t.modal_results) == (5, 3)


def test_a_constant_writer_scores_the_floor_and_nothing_off_it() -> None:
    """The model of docs/appendix/training-record.md's stage 4: every result and every read is
    00. Its fidelity is perfect on a chain of 00s, and its off-floor reads are all wrong."""
    constant = MODAL.replace("cc13", "cc00").replace("cc12", "cc00").replace("ee12", "ee00")
    t = tally(MODAL_PROMPT, constant, window=32)
    assert t.right["generated"] == t.reads["generated"] == t.modal_reads == t.modal_right == 7
    assert t.modal_results == t.results == 5
    # Forced through the honest chain, it reads 00 where 13 was written.
    from transformers import AutoTokenizer

    from kvllm.assets import model_path

    tokenizer = AutoTokenizer.from_pretrained(model_path())
    forced = tokenizer(MODAL)["input_ids"]
    predictions = tokenizer(constant)["input_ids"]
    assert len(predictions) == len(forced)
    f = forced_tally(tokenizer, MODAL_PROMPT, *char_to_token(tokenizer, forced), predictions, window=32)
    assert (f.modal_reads, f.modal_right) == (4, 4)  # the forced text's floor, not the predictions'
    assert f.reads["generated"] - f.modal_reads == 3 and f.right["generated"] - f.modal_right == 0


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("family", ["trace", "reason"])
def test_the_tasks_own_chains_write_distinct_results(family: str, op: str) -> None:
    """The reference chains (true arithmetic, or the shift) are the scale of the modal
    result share: about 0.06-0.08 over 64 seeds (docs/appendix/training-record.md, "A grade a
    constant writer cannot pass" and "Stage 5"), far from the 0.56 of the shipped model, which cannot add. Every
    read of a reference chain is right, the shift's included."""
    base = Difficulty(constants=8, steps=48) if family == "trace" else REASON_DIFFICULTY
    difficulty = dataclasses.replace(base, op=op)
    results = modal = 0
    for seed in range(16):
        task = make_task(family, seed, difficulty)
        t = tally(task.prompt, task.target, window=128)
        assert t.right == t.reads and t.reads["generated"] > 0
        results, modal = results + t.results, modal + t.modal_results
    assert results > 16 * 40 and modal / results < 0.15
