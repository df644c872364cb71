"""tools/train_reasoner.py: which target tokens are copies from the prompt, and their loss weight."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch
from transformers import PreTrainedTokenizerFast, Qwen3ForCausalLM

from kvllm.assets import model_path
from kvllm.eval.tasks import HEDGES, NAMES, make_task
from tools import train_reasoner

TARGET = "\n".join(
    [
        "",
        " ce = bo : ku = bo41 : ku13 = ce54",
        " so ce is 54.",
        " check ce = bo : ku = bo41 : ku13 = ce54",
        " wait, let me double-check that.",
        " </think>",
        " ce54",
    ]
)


def _vocab() -> tuple[PreTrainedTokenizerFast, torch.Tensor, torch.Tensor]:
    """The shipped model's tokenizer and the name and digit token ids ``_batch`` takes."""
    tok = PreTrainedTokenizerFast.from_pretrained(model_path())
    return tok, train_reasoner.name_token_ids(tok), torch.tensor(tok.convert_tokens_to_ids(list("0123456789")))


def test_copy_spans_are_a_statements_names_and_the_end_is_its_line() -> None:
    spans, end = train_reasoner.copy_spans(TARGET)
    # The check line's name is a random earlier step: nothing in it is copied.
    assert [TARGET[a:b] for a, b in spans] == ["ce", "bo", "ku"]
    first = TARGET.index("ce = bo")
    assert spans[0] == (first, first + 2)
    # The end starts at the line's space: the token where a chain decides to stop.
    assert end is not None and TARGET[slice(*end)] == " </think>"
    assert train_reasoner.copy_spans(" ce54") == ([], None)


def test_batch_marks_the_copied_tokens_of_tasks_only() -> None:
    tok, name_ids, digit_ids = _vocab()
    input_ids, labels, _mask, copy, end, answer = train_reasoner._batch(
        tok, random.Random(3), 4096, 0.3, 48, 0.0, 0.0, name_ids, digit_ids, families=("trace",)
    )
    assert copy.shape == end.shape == labels.shape and not ((copy | end) & (labels == -100)).any()
    assert not ((copy | end) & answer).any() and not (answer & (labels == -100)).any()
    for row, marks, stop, answered in zip(input_ids, copy, end, answer, strict=True):
        words = [t.removeprefix("Ġ") for t in tok.convert_ids_to_tokens(row[marks])]
        # Each statement gives its name and two operands.
        assert words and len(words) % 3 == 0 and all(w in NAMES for w in words)
        assert tok.decode(row[stop]) == " </think>"
        # The answer: the line after the end, the asked name and its value.
        assert re.fullmatch(r"\n [a-z]{2}\d\d", tok.decode(row[answered]))
    # Nor do drills (random lines), whatever the mix.
    input_ids, _, _, copy, end, answer = train_reasoner._batch(
        tok, random.Random(5), 4096, 0.3, 48, 0.0, 1.0, name_ids, digit_ids, families=("trace",)
    )
    assert not copy.any() and not end.any() and not answer.any()
    # Recall examples copy nothing (their queried names are random).
    _, _, _, copy, end, answer = train_reasoner._batch(
        tok, random.Random(3), 512, 0.3, 48, 1.0, 0.0, name_ids, digit_ids, pairs=4
    )
    assert not copy.any() and not end.any() and not answer.any()


def test_weighted_loss_at_weight_one_is_transformers_loss() -> None:
    path = model_path()
    tok = PreTrainedTokenizerFast.from_pretrained(path)
    model = Qwen3ForCausalLM.from_pretrained(path).eval()
    task = make_task("trace", 1_000_003)
    ids = torch.tensor([tok(task.text)["input_ids"]])
    labels = ids.clone()
    labels[:, : len(tok(task.prompt)["input_ids"])] = -100
    weight = torch.ones(ids.shape)
    with torch.no_grad():
        out = model(input_ids=ids, labels=labels)
        plain = train_reasoner.weighted_loss(out.logits, labels, weight)
        weight[:, -5:] = 10.0
        heavy = train_reasoner.weighted_loss(out.logits, labels, weight)
    torch.testing.assert_close(plain, out.loss)
    assert not torch.isclose(heavy, plain)


def test_rename_permutes_names_and_keeps_words() -> None:
    task = make_task("reason", 7)
    prompt, target = train_reasoner.rename((task.prompt, task.target), random.Random(0))
    assert prompt.startswith("reason: evaluate and report ") and prompt.endswith(" <think>")
    pairs = set()
    lines = zip((task.prompt + task.target).split("\n"), (prompt + target).split("\n"), strict=True)
    for before, after in lines:
        # Words that are also names keep their letters: the hedges ("let me", "so far so
        # good") and a restatement's "so".
        if before.strip() in HEDGES:
            assert after == before
            continue
        if before.startswith(" so ") and " is " in before:
            assert after.startswith(" so ")
            before, after = before[4:], after[4:]
        assert len(before) == len(after)
        pairs |= {
            (before[m.start() : m.end()], after[m.start() : m.end()]) for m in train_reasoner._NAME.finditer(before)
        }
    # One permutation for both texts: each name has one image, and no two the same.
    images = dict(pairs)
    assert len(images) == len(pairs) and len(set(images.values())) == len(images)
    assert sum(a != b for a, b in pairs) > 0.9 * len(pairs)


def test_batches_from_workers_are_batches_of_the_same_kind() -> None:
    tok = PreTrainedTokenizerFast.from_pretrained(model_path())
    fixed = dict(
        tok=tok,
        top_steps=48,
        recall=0.0,
        drill=0.0,
        name_ids=train_reasoner.name_token_ids(tok),
        digit_ids=torch.tensor(tok.convert_tokens_to_ids(list("0123456789"))),
        families=("trace",),
        shuffle=1.0,
    )
    # In the loop: the batches of a random.Random(seed), as before workers existed.
    inline = train_reasoner.Batches(0, 3, (4096, 512), **fixed).next(0.3, None)
    direct = train_reasoner._batch(rng=random.Random(3), token_budget=4096, level=0.3, **fixed)
    for a, b in zip(inline, direct, strict=True):
        assert torch.equal(a, b)
    batches = train_reasoner.Batches(1, 3, (4096, 512), **fixed)
    worker = batches.next(0.3, None)
    assert [t.dtype for t in worker] == [t.dtype for t in direct]
    input_ids, labels, _, copy, end, _ = worker
    assert input_ids.numel() <= 4096 and copy.any() and end.any() and not ((copy | end) & (labels == -100)).any()
    # The warm-up's records reach the worker: then its batches (after the queued ones)
    # are recall examples, which copy nothing.
    warm = [batches.next(0.0, 2)[3] for _ in range(4)]
    batches.close()
    assert not warm[-1].any()


def test_a_long_share_of_one_gives_only_the_longest_programs() -> None:
    tok, name_ids, digit_ids = _vocab()
    statement = re.compile(r"^ [a-z]{2} = [a-z]{2} : [a-z]{2}$", re.MULTILINE)
    steps = {}
    for long in (0.0, 1.0):
        steps[long] = []
        for seed in range(6):
            input_ids, labels, mask, *_ = train_reasoner._batch(
                tok, random.Random(seed), 4096, 1.0, 20, 0.0, 0.0, name_ids, digit_ids,
                families=("reason",), op="shift", long=long,
            )  # fmt: skip
            for row, label, real in zip(input_ids, labels, mask.bool(), strict=True):
                prompt = tok.decode(row[real & (label == -100)])
                steps[long].append(len(statement.findall(prompt)))  # the program: a line a step
    assert set(steps[1.0]) == {20}  # every program of every batch has the level's most steps
    assert min(steps[0.0]) < 20  # the mixed draw it replaces


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("--workers=-1", "--workers -1 is invalid: must be >= 0"),
        ("--shuffle-names=1.5", "--shuffle-names 1.5 is invalid: must be in [0, 1]"),
        ("--long-share=-0.1", "--long-share -0.1 is invalid: must be in [0, 1]"),
    ],
)
def test_bad_flags_fail_at_start_naming_the_range(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path, flag: str, message: str
) -> None:
    monkeypatch.setattr("sys.argv", ["train_reasoner.py", "--out", str(tmp_path), flag])
    with pytest.raises(SystemExit):
        train_reasoner.main()
    assert message in capsys.readouterr().err


def test_far_key_mask_hides_only_old_generated_keys_and_is_causal() -> None:
    length, prompt = 40, 10
    labels = torch.full((3, length), -100)
    labels[:, prompt:] = 1
    mask = torch.ones(3, length, dtype=torch.long)
    mask[2, 30:] = 0  # padding
    gen = torch.Generator().manual_seed(0)
    keep, lost = train_reasoner.far_key_mask(labels, mask, 1.0, 0.0, (5, 5), gen)
    keep = keep[:, 0]
    assert keep.shape == (3, length, length) and keep.dtype == torch.bool
    q, k = torch.meshgrid(torch.arange(length), torch.arange(length), indexing="ij")
    # A sequence lost keys exactly when one of its real keys is hidden from a later query.
    assert lost.tolist() == [bool((~keep[i] & (q >= k) & mask[i].bool()[None]).any()) for i in range(3)]
    # Never a later key, a padding key, a prompt key or one of the newest 5.
    assert not (keep & (k > q)).any() and not keep[2, :, 30:].any()
    near = (k <= q) & ((q - k < 5) | (k < prompt))
    assert keep[:2][:, near].all()
    # A hidden key stays hidden from every later query: eviction, not noise.
    for row in keep[:2]:
        hidden = ~row & (k <= q)
        for key in hidden.any(0).nonzero().flatten().tolist():
            assert not row[key + 5 :, key].any()
    # Rates are drawn up to 1, so some far generated key is hidden; at 0, only causality remains.
    assert not keep[:2][:, (q - k >= 5) & (k >= prompt)].all()
    none, lost = train_reasoner.far_key_mask(labels, mask, 0.0, 0.0, (5, 5), gen)
    assert torch.equal(none[:2, 0], (k <= q).expand(2, -1, -1)) and not lost.any()


def test_far_key_mask_without_drops_gives_the_plain_forward() -> None:
    path = model_path()
    tok = PreTrainedTokenizerFast.from_pretrained(path)
    model = Qwen3ForCausalLM.from_pretrained(path).eval()
    model.config._attn_implementation = "sdpa"
    task = make_task("trace", 1_000_005)
    ids = torch.tensor([tok(task.text)["input_ids"]] * 2)
    mask = torch.ones_like(ids)
    mask[1, -7:] = 0
    labels = ids.clone()
    labels[:, : len(tok(task.prompt)["input_ids"])] = -100
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        plain = model(input_ids=ids, attention_mask=mask).logits
        full = model(input_ids=ids, attention_mask=train_reasoner.far_key_mask(labels, mask, 0.0, 0.0, (8, 8), gen)[0])
        hidden = train_reasoner.far_key_mask(labels, mask, 0.9, 0.0, (8, 8), gen)[0]
        dropped = model(input_ids=ids, attention_mask=hidden)
    real = mask.bool()
    assert torch.allclose(full.logits[real], plain[real], atol=1e-4)
    assert not torch.allclose(dropped.logits[real], plain[real], atol=1e-2)


def test_weighted_loss_of_a_batch_with_no_weight_is_zero_not_nan() -> None:
    logits = torch.randn(1, 4, 8, requires_grad=True)
    labels = torch.tensor([[1, 2, 3, 4]])
    loss = train_reasoner.weighted_loss(logits, labels, torch.zeros(1, 4))
    loss.backward()
    assert loss.item() == 0.0 and torch.isfinite(logits.grad).all()


def test_far_key_mask_lets_whole_queries_read_every_key() -> None:
    length, prompt = 40, 10
    labels = torch.full((2, length), -100)
    labels[:, prompt:] = 1
    mask = torch.ones(2, length, dtype=torch.long)
    whole = torch.zeros(2, length, dtype=torch.bool)
    whole[:, 35:] = True
    keep, _ = train_reasoner.far_key_mask(labels, mask, 1.0, 0.0, (5, 5), torch.Generator().manual_seed(0), whole)
    again, _ = train_reasoner.far_key_mask(labels, mask, 1.0, 0.0, (5, 5), torch.Generator().manual_seed(0))
    q, k = torch.meshgrid(torch.arange(length), torch.arange(length), indexing="ij")
    assert keep[:, 0, 35:].equal((k <= q)[35:].expand(2, -1, -1))  # the whole queries: causal only
    assert keep[:, 0, :35].equal(again[:, 0, :35]) and not again[:, 0, 35:].equal(keep[:, 0, 35:])


def test_every_saved_checkpoint_names_its_operator(tmp_path) -> None:
    """A periodic save carries the run's arguments, so the commands grade it on the tasks
    it was trained on; without them a shift-trained model is graded on add tasks."""
    import argparse

    from kvllm.cli.options import trained_op
    from kvllm.testing import save_tiny_model

    source = save_tiny_model(tmp_path / "source", seed=0, hidden_size=64, layers=1, heads=2, kv_heads=1, head_dim=32)
    model = Qwen3ForCausalLM.from_pretrained(source)
    tok = PreTrainedTokenizerFast.from_pretrained(source)
    out = tmp_path / "run"
    train_reasoner._save(model, tok, out, argparse.Namespace(op="shift", minutes=1.0))
    assert trained_op(out) == "shift"
    # The last save adds the run's statistics beside the arguments.
    summary = train_reasoner._save(model, tok, out, argparse.Namespace(op="shift", minutes=1.0), steps=3)
    expected = {"steps": 3, "args": {"op": "shift", "minutes": "1.0"}}
    assert json.loads((out / "training.json").read_text()) == summary == expected
