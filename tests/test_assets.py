"""The shipped model: loads offline, is what its card says, and still does what it learned.

Regression guards against a broken model file or tokenizer, with floors set below what
the shipped model measured (its card and ``docs/accuracy.md``): it reads values back
(teacher-forced), and it answers held-out prompt-needle tasks with Full KV.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvllm.assets import DEFAULT_MODEL, model_path
from kvllm.eval.grid import run_accuracy_cell
from kvllm.eval.problems import task_problems
from kvllm.eval.tasks import THINK, Difficulty, make_task

# Short held-out programs keep the tests to seconds.
EASY = Difficulty(constants=4, steps=10)
LOOKUP_FLOOR = 0.85
NEEDLE_FLOOR = 0.5


@pytest.fixture(scope="module")
def shipped():
    path = model_path()
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32).eval()
    return model, tok


def test_model_files_and_card() -> None:
    path = model_path()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "training.json", "README.md"):
        assert (path / name).stat().st_size > 0, name
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert config["num_key_value_heads"] < config["num_attention_heads"]  # GQA
    assert config["tie_word_embeddings"] is True
    # vLLM's CPU attention needs a head dim that is a multiple of 32.
    assert config["head_dim"] % 32 == 0
    card = (path / "README.md").read_text()
    assert "python tools/train_reasoner.py" in card and "exact match" in card


def test_missing_model_is_a_clear_error() -> None:
    with pytest.raises(FileNotFoundError, match="nope"):
        model_path("nope")
    assert model_path(DEFAULT_MODEL) == model_path()


def test_tokenizer_round_trip_and_chat_template(shipped) -> None:
    _, tok = shipped
    task = make_task("trace", 0, EASY)
    assert tok.decode(tok(task.text)["input_ids"]) == task.text
    # A name is one token and each digit another, so a value is found by its name.
    assert tok.convert_ids_to_tokens(tok(" bo41")["input_ids"]) == ["Ġbo", "4", "1"]
    chat = tok.apply_chat_template([{"role": "user", "content": "hello there friend"}], tokenize=False)
    assert chat.endswith(THINK)


def test_reads_operand_values_back(shipped) -> None:
    """Teacher-forced: the digits of every operand value in the chain of thought.

    An operand value (``= bo41 +``) is a digit pair after a name and before an operator
    or ``=``; a result (``= ce54``) ends its line and is arithmetic, not a lookup.
    """
    model, tok = shipped
    ops = set(tok.convert_tokens_to_ids(["Ġ+", "Ġ-", "Ġ="]))
    right = total = 0
    for seed in range(6):
        task = make_task("trace", seed, EASY)
        ids = tok(task.text)["input_ids"]
        start = len(tok(task.prompt)["input_ids"])
        with torch.no_grad():
            pred = model(torch.tensor([ids])).logits[0].argmax(-1).tolist()
        tokens = tok.convert_ids_to_tokens(ids)
        for i in range(start, len(ids) - 2):
            if tokens[i].isdigit() and tokens[i + 1].isdigit() and ids[i + 2] in ops:
                right += (pred[i - 1] == ids[i]) + (pred[i] == ids[i + 1])
                total += 2
    assert total == 6 * 10 * 4  # two operands of two digits per line
    assert right / total >= LOOKUP_FLOOR


def test_full_kv_prompt_needle_floor(shipped) -> None:
    model, tok = shipped
    problems = task_problems("prompt-needle", 8, EASY, tok)
    correct = [r["correct"] for r in run_accuracy_cell(model, tok, problems, None, batch_size=8)]
    assert sum(correct) / len(correct) >= NEEDLE_FLOOR, correct
