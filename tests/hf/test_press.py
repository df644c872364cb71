"""``model.generate`` inside ``compress(model, config)``: the same tokens as kvllm.hf.generate,
transformers' own sampling, stopping and streaming, and clear errors for what it cannot do."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from kvllm import CompressionConfig
from kvllm.assets import model_path
from kvllm.eval.tasks import Difficulty, make_task
from kvllm.hf import compress, generate

SMALL = CompressionConfig(window=32, buffer=8, period=4, retention=0.2)


@pytest.fixture(scope="module")
def shipped():
    tok = AutoTokenizer.from_pretrained(model_path())
    model = AutoModelForCausalLM.from_pretrained(model_path(), dtype=torch.float32).eval()
    return model, tok


def _prompts() -> list[str]:
    # Two lengths: the batch is left-padded, as in kvllm.hf.generate.
    return [
        make_task("prompt-needle", 5, Difficulty(constants=4, steps=6)).prompt,
        make_task("prompt-needle", 6, Difficulty(constants=6, steps=9)).prompt,
    ]


def _trim(row: list[int], eos: int) -> list[int]:
    return row[: row.index(eos) + 1] if eos in row else row


def _press_generate(model, tok, prompts: list[str], config: CompressionConfig | None, **kwargs):
    enc = tok(prompts, return_tensors="pt", padding=True, padding_side="left")
    with compress(model, config) as press:
        out = model.generate(**enc, pad_token_id=tok.pad_token_id, **kwargs)
    rows = out[:, enc["input_ids"].shape[1] :].tolist()
    return [_trim(r, tok.eos_token_id) for r in rows], press


@pytest.mark.parametrize("method", ["kara", "kara-causal", "snapkv", "chunkkv", "random", "pyramidkv"])
def test_greedy_generate_is_token_identical_to_kvllm_generate(shipped, method: str) -> None:
    model, tok = shipped
    config = SMALL.replace(method=method)
    expected = generate(model, tok, _prompts(), config, 200)
    got, press = _press_generate(model, tok, _prompts(), config, max_new_tokens=200, do_sample=False)
    assert got == [_trim(r, tok.eos_token_id) for r in expected.token_ids]
    # kvllm.hf.generate takes a row's statistics when it stops; Press.stats are the end
    # of the call's: they agree on the rows that ran to the end.
    last = [i for i, row in enumerate(got) if len(row) == max(map(len, got))]
    untimed = [dataclasses.replace(s, compress_seconds=0.0) for s in (*press.stats, *expected.stats)]
    n = len(got)
    assert last and all(untimed[i] == untimed[n + i] for i in last)
    assert press.stats[0].compressions > 0


def test_sampling_streamer_and_stopping(shipped) -> None:
    model, tok = shipped

    class Collect:
        def __init__(self) -> None:
            self.tokens: list[int] = []
            self.ended = False

        def put(self, value: torch.Tensor) -> None:
            self.tokens += value.flatten().tolist()

        def end(self) -> None:
            self.ended = True

    prompt = _prompts()[:1]
    streamer = Collect()
    torch.manual_seed(0)
    got, press = _press_generate(
        model, tok, prompt, SMALL, max_new_tokens=120, do_sample=True, temperature=0.8, top_p=0.95, streamer=streamer
    )
    prompt_len = len(tok(prompt[0])["input_ids"])
    # The streamer sees the prompt first, then every generated token, then the end.
    assert streamer.tokens[prompt_len:] == got[0] and streamer.ended
    assert 0 < len(got[0]) <= 120 and press.stats[0].compressions > 0
    # Sampling is transformers': the same seed gives the same tokens, another seed others.
    torch.manual_seed(0)
    again, _ = _press_generate(
        model, tok, prompt, SMALL, max_new_tokens=120, do_sample=True, temperature=0.8, top_p=0.95
    )
    assert again == got
    # EOS stops a row, as without compression; max_new_tokens bounds it.
    greedy, _ = _press_generate(model, tok, prompt, SMALL, max_new_tokens=400, do_sample=False)
    assert greedy[0][-1] == tok.eos_token_id
    short, press = _press_generate(model, tok, prompt, SMALL, generation_config=GenerationConfig(max_new_tokens=7))
    assert len(short[0]) == 7 and press.stats[0].logical_length == prompt_len + 6


def test_unsupported_features_are_refused_and_the_block_leaves_nothing_behind(shipped) -> None:
    model, tok = shipped
    enc = tok(_prompts()[:1], return_tensors="pt")
    with compress(model, SMALL):
        with pytest.raises(ValueError, match="num_beams=2 is not supported: beam search"):
            model.generate(**enc, num_beams=2, max_new_tokens=4)
        with pytest.raises(ValueError, match="assistant_model is not supported"):
            model.generate(**enc, assistant_model=model, max_new_tokens=4)
        with pytest.raises(ValueError, match="use_cache=False"):
            model.generate(**enc, use_cache=False, max_new_tokens=4)
        with pytest.raises(ValueError, match="past_key_values"):
            model.generate(**enc, past_key_values=object(), max_new_tokens=4)
    assert "generate" not in vars(model) and not model._forward_pre_hooks and not model._forward_hooks
    assert model.config._attn_implementation != "kvllm"
    # Outside the block: plain transformers again, no compression.
    out = model.generate(**enc, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] == enc["input_ids"].shape[1] + 4
