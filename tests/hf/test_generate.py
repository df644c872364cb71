"""The reference backend against transformers itself."""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from kvllm import CompressionConfig
from kvllm.hf import generate
from kvllm.hf.calibrate import q_filters, retain_weights
from kvllm.methods import available, calibrated, method_class
from kvllm.policy import PeriodicWindowPolicy, SeqState
from kvllm.testing import model_config, random_model

PROMPTS = [
    "let v1 = 5 then compute the sum of v2",
    "the answer is",
    "we check step a value, then",
    "so let v3 = 17 and v4 = 2; compute v3 and v4 then the answer",
]
# (arch, heads, kv_heads): GQA 2:1 and 1:1.
MODELS = [("qwen3", 4, 2), ("qwen2", 4, 2), ("llama", 4, 2), ("qwen3", 2, 2), ("llama", 2, 2)]


def _model(tokenizer: PreTrainedTokenizerFast, arch: str, heads: int, kv_heads: int):
    return random_model(model_config(arch, vocab_size=len(tokenizer), heads=heads, kv_heads=kv_heads))


def _reference(model, tokenizer, prompts: list[str], n: int) -> list[list[int]]:
    enc = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    # No EOS: both sides must produce all n tokens (min_new_tokens would instead
    # suppress EOS and change the argmax).
    model.generation_config.eos_token_id = None
    out = model.generate(**enc, max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[:, enc["input_ids"].shape[1] :].tolist()


@pytest.mark.parametrize(("arch", "heads", "kv_heads"), MODELS)
@pytest.mark.parametrize("batched", [True, False], ids=["batched", "unbatched"])
def test_keep_all_matches_model_generate(tokenizer, arch: str, heads: int, kv_heads: int, batched: bool) -> None:
    model = _model(tokenizer, arch, heads, kv_heads)
    n = 90
    # Retention 1.0 with rounds running (capture, selection, rewrite), and a window
    # that is never reached: both must leave the tokens untouched.
    keep_all = CompressionConfig(window=32, buffer=8, period=4, retention=1.0)
    never = CompressionConfig(window=1024, buffer=8, period=4, retention=0.1)
    groups = [PROMPTS] if batched else [[p] for p in PROMPTS]
    for prompts in groups:
        expected = _reference(model, tokenizer, prompts, n)
        for cfg in (None, keep_all, never):
            got = generate(model, tokenizer, prompts, cfg, n, stop_at_eos=False)
            assert got.token_ids == expected, f"config {cfg}"
        assert got.stats[0].compressions == 0
    rounds = generate(model, tokenizer, prompts, keep_all, n, stop_at_eos=False).stats[0].compressions
    assert rounds > 0


def _dropped_mask(prompt: int, steps: int, cfg: CompressionConfig) -> torch.Tensor:
    """For StreamingLLM under the periodic policy (every layer and head drops the same
    tokens), ``mask[t, j]`` says whether the query at logical position t still sees
    logical token j, found by simulating the policy independently of any cache."""
    total = prompt + steps
    allowed = torch.tril(torch.ones(total, total, dtype=torch.bool))
    policy, state = PeriodicWindowPolicy(cfg), SeqState(prompt_len=prompt)
    slots = list(range(prompt))
    for step in range(1, steps):
        slots.append(prompt + step - 1)
        state.append()
        region = policy.plan(state)
        if region is None:
            continue
        area = slots[region.start : region.start + region.n_compress]
        dropped = area[: len(area) - region.budget]
        slots[region.start : region.start + region.n_compress] = area[len(area) - region.budget :]
        policy.commit(state, region)
        # The next token fed is logical position prompt + step.
        allowed[prompt + step :, dropped] = False
    return allowed


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_compressed_generation_matches_masked_full_attention(tokenizer, arch: str) -> None:
    """Positions stay logical after compaction.

    Teacher-force the compressed run's own tokens through the plain model with a mask
    that hides exactly the dropped tokens at each step: every greedy choice must
    agree. A cache that re-numbered positions after compaction would diverge.
    """
    model = _model(tokenizer, arch, 4, 2)
    cfg = CompressionConfig(method="streamingllm", window=32, buffer=8, period=4, retention=0.25)
    prompt = PROMPTS[0]
    n = 150
    got = generate(model, tokenizer, [prompt], cfg, n, stop_at_eos=False)
    assert got.stats[0].compressions >= 3
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    p = ids.shape[1]
    full = torch.cat([ids, torch.tensor([got.token_ids[0]])], dim=1)[:, :-1]
    allowed = _dropped_mask(p, n, cfg)[:-1, :-1]
    bias = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    with torch.no_grad():
        logits = model(full, attention_mask=bias[None, None]).logits[0]
    assert logits[p - 1 :].argmax(-1).tolist() == got.token_ids[0]


@pytest.fixture(scope="module")
def calibration(tokenizer, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The Q-Filters and retaining heads of the qwen3 4:2 model below, from its passes over the prompts."""
    from safetensors.torch import save_file

    model = _model(tokenizer, "qwen3", 4, 2)
    inputs = [tokenizer(p, return_tensors="pt")["input_ids"][0] for p in PROMPTS]
    path = tmp_path_factory.mktemp("calibration") / "calibration.safetensors"
    retain = retain_weights(model, inputs, [4] * len(inputs), gap=4, window=8, keep=2)
    save_file({"q_filters": q_filters(model, inputs), "retain_weights": retain}, str(path))
    return str(path)


@pytest.mark.parametrize("method", available())
def test_lengths_after_compression(tokenizer, calibration: str, method: str) -> None:
    model = _model(tokenizer, "qwen3", 4, 2)
    # A method that reads a calibration file runs with the model's own.
    params = {"calibration": calibration} if calibrated(method) else {}
    cfg = CompressionConfig(method=method, window=32, buffer=8, period=4, retention=0.25, params=params)
    n = 200
    got = generate(model, tokenizer, PROMPTS, cfg, n, stop_at_eos=False)
    enc = tokenizer(PROMPTS)["input_ids"]
    for ids, stats in zip(enc, got.stats, strict=True):
        # The last token is sampled but never fed, so the cache has seen n - 1 of them.
        assert stats.logical_length == len(ids) + n - 1
        kept = stats.compressions * cfg.budget
        tail = n - 1 - stats.compressions * cfg.window
        if method_class(method).uniform:
            assert stats.physical_length == len(ids) + kept + tail
        else:  # variable budgets are padded to the widest (head, layer) and masked
            assert stats.physical_length >= len(ids) + kept + tail
        assert stats.compressions == (n - 1 - 8) // 32 or stats.compressions == (n - 1 - 8) // 32 - 1


def test_prompt_is_never_touched(tokenizer) -> None:
    from kvllm.hf.cache import CompressingCache

    model = _model(tokenizer, "qwen3", 4, 2)
    cfg = CompressionConfig(method="kara", window=32, buffer=8, period=4, retention=0.25)
    enc = tokenizer(PROMPTS[:1], return_tensors="pt")
    seen: list[CompressingCache] = []
    original_end = CompressingCache.end_step

    def spy(self: CompressingCache) -> None:
        if not seen:
            seen.append(self)
        original_end(self)

    prompt_keys = None
    CompressingCache.end_step = spy
    try:
        generate(model, tokenizer, PROMPTS[:1], cfg, 1, stop_at_eos=False)
        prompt_keys = seen[0].layers[1].keys.clone()
        seen.clear()
        got = generate(model, tokenizer, PROMPTS[:1], cfg, 120, stop_at_eos=False)
    finally:
        CompressingCache.end_step = original_end
    p = enc["input_ids"].shape[1]
    assert got.stats[0].compressions > 0
    assert torch.equal(seen[0].layers[1].keys[:, :, :p], prompt_keys[:, :, :p])


def test_sampling_is_seeded(tokenizer) -> None:
    model = _model(tokenizer, "qwen3", 4, 2)
    cfg = CompressionConfig(window=32, buffer=8, period=4)
    a = generate(model, tokenizer, PROMPTS, cfg, 40, temperature=0.8, top_p=0.9, seed=3)
    b = generate(model, tokenizer, PROMPTS, cfg, 40, temperature=0.8, top_p=0.9, seed=3)
    assert a.token_ids == b.token_ids


def test_bad_max_new_tokens(tokenizer) -> None:
    model = _model(tokenizer, "qwen3", 4, 2)
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        generate(model, tokenizer, PROMPTS, None, 0)


def test_teacher_forcing_goes_through_the_same_compression(tokenizer) -> None:
    """Forcing a compressed run's own tokens through the same config reproduces its
    argmax at every step (same rounds, same compaction), and forcing Full KV's tokens
    at retention 1.0 reproduces Full KV exactly."""
    model = _model(tokenizer, "qwen3", 4, 2)
    cfg = CompressionConfig(window=32, buffer=8, period=4, retention=0.25)
    free = generate(model, tokenizer, PROMPTS, cfg, 120, stop_at_eos=False)
    forced = generate(model, tokenizer, PROMPTS, cfg, 1, stop_at_eos=False, forced=free.token_ids)
    assert forced.token_ids == free.token_ids
    assert forced.predictions == free.token_ids
    assert [s.compressions for s in forced.stats] == [s.compressions for s in free.stats]
    assert [(s.physical_length, s.held_mean) for s in forced.stats] == [
        (s.physical_length, s.held_mean) for s in free.stats
    ]
    full = generate(model, tokenizer, PROMPTS, None, 120, stop_at_eos=False)
    keep_all = generate(
        model, tokenizer, PROMPTS, cfg.replace(retention=1.0), 1, stop_at_eos=False, forced=full.token_ids
    )
    assert keep_all.predictions == full.token_ids
    # Compression changes what the model predicts somewhere along Full KV's own tokens.
    squeezed = generate(
        model, tokenizer, PROMPTS, cfg.replace(retention=0.1), 1, stop_at_eos=False, forced=full.token_ids
    )
    assert squeezed.predictions != full.token_ids


def test_memory_held_for_generated_tokens(tokenizer) -> None:
    model = _model(tokenizer, "qwen3", 4, 2)
    cfg = CompressionConfig(window=32, buffer=8, period=4, retention=0.25)
    full = generate(model, tokenizer, PROMPTS[:1], None, 120, stop_at_eos=False).stats[0]
    assert full.held_mean == full.held_end == 1.0
    got = generate(model, tokenizer, PROMPTS[:1], cfg, 120, stop_at_eos=False).stats[0]
    generated = got.logical_length - len(tokenizer(PROMPTS[0])["input_ids"])
    held = got.physical_length - len(tokenizer(PROMPTS[0])["input_ids"])
    assert got.held_end == pytest.approx(held / generated)
    assert got.held_end < got.held_mean < 1.0  # the share falls as rounds accumulate


def test_bad_forced_tokens(tokenizer) -> None:
    model = _model(tokenizer, "qwen3", 4, 2)
    with pytest.raises(ValueError, match="one non-empty token list per prompt"):
        generate(model, tokenizer, PROMPTS[:2], None, 4, forced=[[1, 2]])


def test_teacher_forcing_stops_each_row_at_its_eos(tokenizer) -> None:
    """Forced rows that end at different EOS steps take their statistics there, as the
    step-by-step loop does, although the tokens go through in chunks between rounds."""
    model = _model(tokenizer, "qwen3", 4, 2)
    cfg = CompressionConfig(window=32, buffer=8, period=4, retention=0.25)
    free = generate(model, tokenizer, PROMPTS, cfg, 120, stop_at_eos=False)
    ends = [37, 90, 118][: len(PROMPTS)]
    forced = [[*ids[:end], tokenizer.eos_token_id] for ids, end in zip(free.token_ids, ends, strict=False)]
    got = generate(model, tokenizer, PROMPTS[: len(ends)], cfg, 1, forced=forced)
    for row, end in enumerate(ends):
        prompt = len(tokenizer(PROMPTS[row])["input_ids"])
        assert got.stats[row].logical_length == prompt + end
        assert got.predictions[row][:end] == free.token_ids[row][:end]


@pytest.mark.parametrize(
    "case", ["eos at different steps", "no eos, rows of different lengths", "no compression", "threshold policy"]
)
def test_chunked_forcing_equals_one_token_per_forward(tokenizer, monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """MAX_CHUNK = 1 is the step-by-step loop: chunks must give its predictions and
    every statistic, whatever ends a chunk (a round, a row's EOS, the cap)."""
    generate_module = importlib.import_module("kvllm.hf.generate")  # kvllm.hf.generate is also the function

    model = _model(tokenizer, "qwen3", 4, 2)
    cfg = CompressionConfig(window=32, buffer=8, period=4, retention=0.25)
    if case == "threshold policy":
        cfg = cfg.replace(method="snapkv", policy="threshold", threshold_budget=48, threshold_interval=8)
    if case == "no compression":
        cfg = None
    free = generate(model, tokenizer, PROMPTS, cfg, 150, stop_at_eos=False)
    ends = [37, 150, 90, 118]
    forced = [ids[:end] for ids, end in zip(free.token_ids, ends, strict=True)]
    stop = case == "eos at different steps"
    if stop:
        forced = [[*f, tokenizer.eos_token_id] for f in forced]
    chunked = generate(model, tokenizer, PROMPTS, cfg, 1, stop_at_eos=stop, forced=forced)
    monkeypatch.setattr(generate_module, "MAX_CHUNK", 1)
    stepwise = generate(model, tokenizer, PROMPTS, cfg, 1, stop_at_eos=stop, forced=forced)
    assert chunked.predictions == stepwise.predictions
    # Everything but the rounds' wall time.
    assert [dataclasses.replace(s, compress_seconds=0.0) for s in chunked.stats] == [
        dataclasses.replace(s, compress_seconds=0.0) for s in stepwise.stats
    ]


def test_the_window_carries_the_spans_values_and_its_pre_rope_keys(tokenizer) -> None:
    """Values, positions and the RoPE table reach the method: undoing the rotation of the
    window's keys at its positions gives the keys each layer computed before RoPE, and
    the values are the ones ``v_proj`` wrote, row by row past each row's left padding."""
    from kvllm.methods import Method, Selection, Window, build

    model = _model(tokenizer, "qwen3", 4, 2)
    cfg = CompressionConfig(window=32, buffer=8, period=4, retention=0.25)
    pre_rope: list[list[torch.Tensor]] = [[] for _ in model.model.layers]
    values: list[list[torch.Tensor]] = [[] for _ in model.model.layers]
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        # k_norm's output [B, q, Hkv, D] is the key before RoPE; v_proj's [B, q, Hkv * D].
        attn.k_norm.register_forward_hook(lambda _m, _a, out, i=i: pre_rope[i].append(out.transpose(1, 2)))
        attn.v_proj.register_forward_hook(
            lambda _m, _a, out, i=i, d=attn.head_dim: values[i].append(out.unflatten(-1, (-1, d)).transpose(1, 2))
        )
    windows: list[Window] = []

    class Spy(Method):
        name = "spy"

        def select(self, window: Window, budget: int) -> Selection:
            windows.append(window)
            return build(cfg).select(window, budget)

    prompts = PROMPTS[:2]
    generate(model, tokenizer, prompts, cfg, 120, stop_at_eos=False, method=Spy(None))
    assert len(windows) >= 2
    pads = [len(ids) for ids in tokenizer(prompts)["input_ids"]]
    pads = [max(pads) - n for n in pads]
    for window in windows[:2]:
        span = window.keys.shape[3]
        positions = window.key_positions()
        unrotated = window.rope.unrotate(window.keys, positions[:, None, None, :])
        for layer in range(len(model.model.layers)):
            keys = torch.cat(pre_rope[layer], dim=2)  # [B, Hkv, padded tokens, D]
            vals = torch.cat(values[layer], dim=2)
            for row, pad in enumerate(pads):
                first = window.positions[row] + pad
                torch.testing.assert_close(
                    unrotated[row, layer], keys[row, :, first : first + span], atol=1e-5, rtol=1e-5
                )
                assert torch.equal(window.values[row, layer], vals[row, :, first : first + span])


def test_lazy_retention_at_keep_all_is_plain_generation(tokenizer) -> None:
    """At r=1 both stages keep everything: the rounds, carried scores included, run and
    change nothing."""
    model = _model(tokenizer, "qwen3", 4, 2)
    cfg = CompressionConfig(window=32, buffer=8, period=4, retention=1.0, lazy=2)
    got = generate(model, tokenizer, PROMPTS, cfg, 160, stop_at_eos=False)
    assert all(s.compressions >= 3 for s in got.stats)
    assert got.token_ids == _reference(model, tokenizer, PROMPTS, 160)


@pytest.mark.parametrize(("method", "keep"), [("kara", 0.5), ("kara-retain", 0.9), ("snapkv", 0.0)])
def test_lazy_retention_holds_the_newest_candidates_over_the_budget(
    tokenizer, calibration: str, method: str, keep: float
) -> None:
    model = _model(tokenizer, "qwen3", 4, 2)
    params = {"calibration": calibration} if calibrated(method) else {}
    plain = CompressionConfig(method=method, window=32, buffer=8, period=4, retention=0.25, params=params)
    lazy = plain.replace(lazy=2, lazy_keep=keep)
    a = generate(model, tokenizer, PROMPTS, plain, 200, stop_at_eos=False)
    b = generate(model, tokenizer, PROMPTS, lazy, 200, stop_at_eos=False)
    for p, lz in zip(a.stats, b.stats, strict=True):
        assert p.compressions == lz.compressions >= 3
        # Every region ends at m = 8 slots but the newest, which holds 2m until the next round.
        assert lz.physical_length - p.physical_length == 8
        assert lz.logical_length == p.logical_length
    assert a.token_ids != b.token_ids  # the second cut keeps other tokens: the test can tell
