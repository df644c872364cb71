"""The shipped models: load offline, are what their cards say, and still do what they learned.

Regression guards against a broken model file or tokenizer, with floors set below what
each model measured (its card and ``docs/results/accuracy.md``): the default model reads values
back (teacher-forced) and answers held-out prompt-needle tasks with Full KV; the second
model (kara-reasoner-6l) has another shape, reads back the reason family's own chains, and
writes its own chains of its own operator (shift) and stops at their end.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvllm.assets import DEFAULT_MODEL, model_path, shipped
from kvllm.eval.grid import run_accuracy_cell
from kvllm.eval.problems import task_problems
from kvllm.eval.tasks import THINK, Difficulty, make_task

SECOND_MODEL = "kara-reasoner-6l"

# Short held-out programs keep the tests to seconds.
EASY = Difficulty(constants=4, steps=10)
LOOKUP_FLOOR = 0.85
NEEDLE_FLOOR = 0.5
# The second model reads 1.000 of its own free reason and trace chains' values back (its card).
SECOND_READ_FLOOR = 0.95


def _load(name: str):
    path = model_path(name)
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32).eval()
    return model, tok


@pytest.fixture(scope="module")
def default():
    return _load(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def second():
    return _load(SECOND_MODEL)


def test_both_models_ship() -> None:
    assert shipped() == (SECOND_MODEL, DEFAULT_MODEL)


@pytest.mark.parametrize("name", [DEFAULT_MODEL, SECOND_MODEL])
def test_model_files_and_card(name: str) -> None:
    path = model_path(name)
    for file in ("config.json", "model.safetensors", "tokenizer.json", "training.json", "README.md"):
        assert (path / file).stat().st_size > 0, file
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert config["num_key_value_heads"] < config["num_attention_heads"]  # GQA
    assert config["tie_word_embeddings"] is True
    # vLLM's CPU attention needs a head dim that is a multiple of 32.
    assert config["head_dim"] % 32 == 0
    card = (path / "README.md").read_text()
    assert card.startswith(f"# {name}\n")
    assert "python tools/train_reasoner.py" in card and "exact match" in card


def test_second_model_has_another_shape() -> None:
    """At least 6 layers, head_dim >= 64, another GQA ratio, >= 4,096 positions, under 20 MB."""
    first, second = (json.loads((model_path(n) / "config.json").read_text()) for n in (DEFAULT_MODEL, SECOND_MODEL))
    assert second["num_hidden_layers"] >= 6 > first["num_hidden_layers"]
    assert second["head_dim"] >= 64 > first["head_dim"]

    def ratio(config: dict) -> float:
        return config["num_attention_heads"] / config["num_key_value_heads"]

    assert ratio(second) != ratio(first)
    assert second["max_position_embeddings"] >= 4096
    assert (model_path(SECOND_MODEL) / "model.safetensors").stat().st_size < 20e6


def test_missing_model_is_a_clear_error() -> None:
    with pytest.raises(FileNotFoundError, match="nope"):
        model_path("nope")
    assert model_path(DEFAULT_MODEL) == model_path()


@pytest.mark.parametrize("fixture", ["default", "second"])
def test_tokenizer_round_trip_and_chat_template(fixture: str, request: pytest.FixtureRequest) -> None:
    _, tok = request.getfixturevalue(fixture)
    task = make_task("reason" if fixture == "second" else "trace", 0, EASY)
    assert tok.decode(tok(task.text)["input_ids"]) == task.text
    # A name is one token and each digit another, so a value is found by its name.
    assert tok.convert_ids_to_tokens(tok(" bo41")["input_ids"]) == ["Ġbo", "4", "1"]
    # A chat turn holding the task's question renders to the task's prompt exactly, as the
    # model was trained on it: the thinking marker on a line of its own.
    question = task.prompt.removesuffix(THINK).rstrip()
    assert tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False) == task.prompt


def test_reads_operand_values_back(default) -> None:
    """Teacher-forced: the digits of every operand value in the chain of thought.

    An operand value (``= bo41 +``) is a digit pair after a name and before an operator
    or ``=``; a result (``= ce54``) ends its line and is arithmetic, not a lookup.
    """
    model, tok = default
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


def test_full_kv_prompt_needle_floor(default) -> None:
    model, tok = default
    problems = task_problems("prompt-needle", 8, EASY, tok)
    correct = [r["correct"] for r in run_accuracy_cell(model, tok, problems, None, batch_size=8)]
    assert sum(correct) / len(correct) >= NEEDLE_FLOOR, correct


def test_second_model_was_trained_on_the_shift() -> None:
    """Its tasks' operator, which ``kvllm eval`` and ``generate`` read from ``training.json``."""
    from kvllm.cli.options import trained_op

    assert trained_op(model_path(SECOND_MODEL)) == "shift"
    assert trained_op(model_path(DEFAULT_MODEL)) == "add"


@pytest.mark.parametrize("family", ["reason", "trace"])
@pytest.mark.parametrize("forced", [True, False], ids=["reference-forced", "free"])
def test_second_model_reads_chains_back(second, family: str, forced: bool) -> None:
    """Full KV: the model's argmax at each generated read spells its value, in the tasks'
    own chains forced through its cache (as in ``docs/results/accuracy.md``'s grid) and in its
    own free chains, which must also stop at the program's end with the answer."""
    model, tok = second
    steps = 24
    problems = task_problems(family, 4, Difficulty(constants=6, steps=steps, op="shift"), tok)
    chains = [tok(p.reference, add_special_tokens=False)["input_ids"] for p in problems] if forced else None
    records = run_accuracy_cell(model, tok, problems, None, batch_size=4, forced=chains)
    reads = sum(r["reads"]["generated"] for r in records)
    assert reads >= 2 * 4 * steps // 3  # a third of the operands, at least, are values the chain wrote
    assert sum(r["right"]["generated"] for r in records) / reads >= SECOND_READ_FLOOR
    if not forced:
        # Each free chain writes the program's statements and stops; trace asks for the last
        # value, which it answers (16 of 16 test seeds at 48 steps); reason asks for the first.
        assert all(r["results"] == steps for r in records), [r["results"] for r in records]
        if family == "trace":
            assert sum(r["correct"] for r in records) >= 3
