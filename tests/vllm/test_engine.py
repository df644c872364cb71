"""KvLLM inside vLLM: differential tests, memory, leaks and start-up errors."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvllm.config import CompressionConfig
from kvllm.hf import generate as hf_generate
from kvllm.vllm.engine import block_pool_usage, running_requests
from kvllm.vllm.engine import runner_of as runner
from kvllm.vllm.engine import scheduler_of as scheduler
from tests.vllm.conftest import PROMPTS, engine, greedy, token_ids

KEEP_ALL = CompressionConfig(window=32, buffer=8, period=4, retention=1.0)
KARA = CompressionConfig(window=32, buffer=8, period=4, retention=0.2)


def _step_all(llm: Any, prompts: list[str], params: Any, abort_at: dict[int, int] | None = None) -> dict[str, Any]:
    """Drive the engine step by step, aborting request ``i`` at step ``abort_at[i]``.

    Returns the outputs, the peak KV blocks in use, and the running requests per step.
    """
    eng = getattr(llm, "llm", llm).llm_engine
    sched = scheduler(llm)
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, params)
    outputs: dict[str, Any] = {}
    peak_blocks = step = 0
    running: list[int] = []
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                outputs[out.request_id] = out
        step += 1
        peak_blocks = max(peak_blocks, block_pool_usage(sched)[0])
        running.append(running_requests(sched))
        for i, at in (abort_at or {}).items():
            if at == step:
                eng.abort_request([str(i)])  # the external id
    return {"outputs": outputs, "peak_blocks": peak_blocks, "running": running}


def test_keep_all_matches_vanilla_on_32_concurrent_prompts(tiny_model: str) -> None:
    with engine(tiny_model, None, plugin=False) as vanilla:
        expected = token_ids(vanilla.generate(PROMPTS, greedy(160)))
    with engine(tiny_model, KEEP_ALL) as llm:
        got = llm.generate(PROMPTS, greedy(160))
        assert scheduler(llm).kv_totals.rounds >= 32 * 3  # rounds really ran
    assert token_ids(got) == expected
    assert all(o.compression["compressions"] >= 3 and o.compression["tokens_dropped"] == 0 for o in got)


def _vllm_preemptions(llm: Any) -> int:
    """vLLM's own ``vllm:num_preemptions`` counter (needs ``disable_log_stats=False``)."""
    metrics = getattr(llm, "llm", llm).get_metrics()
    return sum(int(m.value) for m in metrics if m.name == "vllm:num_preemptions")


def test_keep_all_matches_vanilla_under_preemption(tiny_model: str) -> None:
    small = {"num_gpu_blocks_override": 24, "disable_log_stats": False}
    with engine(tiny_model, None, plugin=False, **small) as vanilla:
        expected = token_ids(vanilla.generate(PROMPTS, greedy(160)))
    with engine(tiny_model, KEEP_ALL, **small) as llm:
        outs = llm.generate(PROMPTS, greedy(160))
        preempted = scheduler(llm).kv_totals.preemptions
        assert preempted > 0
        # Without aborts every PREEMPTED event reaches vLLM's counter: the two agree.
        assert _vllm_preemptions(llm) == preempted
    assert token_ids(outs) == expected
    assert all(o.compression is not None for o in outs)


@pytest.mark.parametrize(
    ("method", "period", "lazy"),
    [
        ("kara", 1, 1),
        ("qfilter", 16, 1),
        ("kara-retain", 4, 1),
        ("snapkv", 16, 1),
        ("random", 4, 1),
        ("compactor", 4, 1),
        ("expected-attention", 4, 1),
        ("kara", 4, 2),
        ("kara-retain", 16, 3),
    ],
)
def test_vllm_path_selects_like_the_hf_reference(
    tiny_model: str, method: str, period: int, lazy: int, tmp_path
) -> None:
    """fp32, retention 0.25: both backends count P in a sequence's own decode steps, so
    they compress at the same tokens, and draw the same random indices, whatever P.
    compactor and expected-attention read what else a window carries (values, positions,
    the RoPE table and, for compactor's sketch, the seeds): both backends give the same.
    qfilter reads a calibration file of this model's queries, as `kvllm calibrate` writes.
    Lazy retention carries each request's stage-one scores from one round to the next,
    and kara-retain reads the new window's positions past the candidates."""
    tok = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32, attn_implementation="eager")
    params = {}
    if method == "qfilter":
        from kvllm.hf.calibrate import q_filters
        from kvllm.methods.qfilter import model_signature, save_calibration

        path = tmp_path / "q_filters.safetensors"
        filters = q_filters(model, [tok(p, return_tensors="pt")["input_ids"][0] for p in PROMPTS[-4:]])
        save_calibration(path, filters, {"model": tiny_model, **model_signature(model.config)})
        params = {"calibration": str(path)}
    if method == "kara-retain":
        from kvllm.hf.calibrate import retain_weights
        from kvllm.methods.qfilter import model_signature, save_calibration
        from kvllm.methods.retain import WEIGHTS

        path = tmp_path / "retain.safetensors"
        inputs = [tok(p, return_tensors="pt")["input_ids"][0] for p in PROMPTS[-4:]]
        weights = retain_weights(model, inputs, [2] * len(inputs), gap=8, window=8, keep=2)
        save_calibration(path, weights, {"model": tiny_model, **model_signature(model.config)}, name=WEIGHTS)
        params = {"calibration": str(path), "token2chunk": False}
    config = CompressionConfig(
        method=method, window=32, buffer=8, period=period, retention=0.25, params=params, lazy=lazy
    )
    prompts = PROMPTS[:6]
    with engine(tiny_model, config) as llm:
        got = llm.generate(prompts, greedy(150))
    for prompt, out in zip(prompts, got, strict=True):
        ref = hf_generate(model, tok, [prompt], config, 150, stop_at_eos=False)
        assert out.compression["compressions"] == ref.stats[0].compressions >= 2
        assert list(out.outputs[0].token_ids) == ref.token_ids[0]


def test_memory_is_really_freed(tiny_model: str) -> None:
    params = greedy(200)
    with engine(tiny_model, None, plugin=False) as vanilla:
        full = _step_all(vanilla, PROMPTS[:16], params)
    with engine(tiny_model, KARA) as llm:
        kara = _step_all(llm, PROMPTS[:16], params)
    # Kara keeps 1/5 of each 32-token window: well under the full cache.
    assert kara["peak_blocks"] <= 0.7 * full["peak_blocks"]


def test_more_requests_run_concurrently_under_a_small_pool(tiny_model: str) -> None:
    small = {"num_gpu_blocks_override": 40}
    params = greedy(240)
    with engine(tiny_model, None, plugin=False, **small) as vanilla:
        full = _step_all(vanilla, PROMPTS, params)
    with engine(tiny_model, KARA, **small) as llm:
        kara = _step_all(llm, PROMPTS, params)
    # Time-averaged concurrency: freed blocks keep more requests decoding at once, so
    # the same work also takes fewer engine steps.
    mean = {k: sum(r["running"]) / len(r["running"]) for k, r in (("full", full), ("kara", kara))}
    assert mean["kara"] > 1.2 * mean["full"]
    assert len(kara["running"]) < len(full["running"])


def test_a_recomputed_request_compresses_its_generated_tokens_again(tiny_model: str) -> None:
    """After preemption, the recomputation runs in window-sized chunks with a round after
    each (docs/design.md, "Compression after preemption"): once it decodes again, it holds
    at most what it held when preempted, plus what it has written since, plus one window.
    Without catch-up it would hold every recomputed token."""
    from kvllm.vllm.scheduler import DROPPED

    with engine(tiny_model, KARA, num_gpu_blocks_override=24) as llm:
        eng, sched = llm.llm.llm_engine, scheduler(llm)
        before: dict[str, tuple[int, int]] = {}
        preempt = sched._preempt_request

        def recording(request: Any, *args: Any, **kwargs: Any) -> None:
            n = request.num_computed_tokens
            before[request.request_id] = (n, n - getattr(request, DROPPED, 0))
            preempt(request, *args, **kwargs)

        sched._preempt_request = recording
        for i, p in enumerate(PROMPTS[:16]):
            eng.add_request(str(i), p, greedy(240))
        caught_up = []
        while eng.has_unfinished_requests():
            eng.step()
            for request in sched.running:
                n = request.num_computed_tokens
                if request.request_id in before and n >= request.num_tokens - 1:
                    logical, physical = before.pop(request.request_id)
                    held = n - getattr(request, DROPPED, 0)
                    assert held <= physical + (n - logical) + KARA.window, (request.request_id, logical, physical, n)
                    caught_up.append(n - request.num_prompt_tokens)
        # Some came back with several windows of generated tokens to compress.
        assert max(caught_up) > 3 * (KARA.window + KARA.buffer)


@pytest.mark.parametrize("config", [KARA, KARA.replace(lazy=2)], ids=["kara", "lazy"])
def test_no_leaks_after_aborts_preemptions_and_finishes(tiny_model: str, config: CompressionConfig) -> None:
    with engine(tiny_model, config, num_gpu_blocks_override=24, disable_log_stats=False) as llm:
        result = _step_all(llm, PROMPTS, greedy(200), abort_at={0: 3, 5: 40, 9: 90, 17: 150})
        sched, run = scheduler(llm), runner(llm)
        # An aborted request's pending PREEMPTED event never reaches vLLM's counter
        # (docs/guide/serving.md): KvLLM's count, made where the scheduler preempts, is never less.
        assert _vllm_preemptions(llm) <= sched.kv_totals.preemptions
        # The scheduler's reported buffer size is the worker's real one.
        assert sched.kv_stats()["query_buffer_bytes_per_request"] == run.kv_ring.bytes_per_request
        assert sched.kv_totals.preemptions > 0 and sched.kv_totals.rounds > 0
        assert block_pool_usage(sched)[0] == 0
        assert sched.kv_requests == {}
        # The worker releases per-request buffers when it hears of finishes and aborts,
        # with the next step: run one empty step to deliver the last notices.
        llm.llm.llm_engine.step()
        assert run.kv_ring.owner == {} and run.kv_carry == {}
        assert len(run.kv_ring.free) == run.scheduler_config.max_num_seqs
    finished = [o for o in result["outputs"].values() if o.outputs[0].finish_reason == "length"]
    assert len(finished) == len(PROMPTS) - 4


def test_per_request_overrides(tiny_model: str) -> None:
    with engine(tiny_model, KARA) as llm:
        outs = llm.generate(
            PROMPTS[:3],
            [
                greedy(120),
                greedy(120, extra_args={"kvllm": {"method": "snapkv", "retention": 0.5}}),
                greedy(120, extra_args={"kvllm": {"off": True}}),
            ],
        )
        # Finished by its prefill, before any decode step: statistics all the same.
        (one,) = llm.generate(PROMPTS[:1], greedy(1))
        with pytest.raises(ValueError, match="retention"):
            llm.generate(PROMPTS[:1], greedy(8, extra_args={"kvllm": {"retention": 0}}))
        with pytest.raises(ValueError, match="unknown field"):
            llm.generate(PROMPTS[:1], greedy(8, extra_args={"kvllm": {"window": 64}}))
    kara, snap, off = (o.compression for o in outs)
    assert (kara["method"], kara["retention"]) == ("kara", 0.2)
    assert (snap["method"], snap["retention"]) == ("snapkv", 0.5)
    assert snap["tokens_dropped"] < kara["tokens_dropped"]
    assert off["compressions"] == 0 and off["method"] is None
    assert one.compression["method"] == "kara" and one.compression["compressions"] == 0
    assert one.compression["logical_length"] == len(one.prompt_token_ids)


def test_a_per_request_method_runs_that_method(tiny_model: str) -> None:
    """One request of a batch overridden to SnapKV generates exactly what an engine started
    with SnapKV generates for it, and not what Kara generates; the rest of the batch is
    Kara's. The statistics' echoed method comes from the stored config, so only the tokens
    show that the worker really ran the override."""
    snap = KARA.replace(method="snapkv")
    prompts = PROMPTS[:4]
    with engine(tiny_model, KARA) as llm:
        mixed = token_ids(
            llm.generate(prompts, [greedy(200, extra_args={"kvllm": {"method": "snapkv"}}) if i == 1 else greedy(200)
                                   for i in range(len(prompts))])
        )  # fmt: skip
        kara = token_ids(llm.generate(prompts, greedy(200)))
    with engine(tiny_model, snap) as llm:
        snapkv = token_ids(llm.generate(prompts, greedy(200)))
    assert mixed[1] == snapkv[1]
    assert mixed[1] != kara[1]  # the two methods keep different tokens here: the test can tell
    assert [mixed[i] for i in (0, 2, 3)] == [kara[i] for i in (0, 2, 3)]


def test_threshold_policy_recompresses_to_budget(tiny_model: str) -> None:
    """The SnapKV-style baseline policy inside vLLM: the generated region shrinks back to
    the budget each time it reaches budget + interval."""
    config = CompressionConfig(
        method="snapkv", policy="threshold", window=32, buffer=8, threshold_budget=64, threshold_interval=32
    )
    with engine(tiny_model, config) as llm:
        outs = llm.generate(PROMPTS[:4], greedy(200))
        assert scheduler(llm).kv_totals.rounds > 0
    for out in outs:
        stats = out.compression
        generated = stats["physical_length"] - len(out.prompt_token_ids)
        # 199 generated tokens were cached: rounds at 96, 128, 160, 192 generated slots.
        assert stats["compressions"] == 4
        assert generated < config.threshold_budget + config.threshold_interval
        assert stats["logical_length"] == len(out.prompt_token_ids) + 199


@pytest.mark.parametrize(
    ("compression", "kwargs", "message"),
    [
        (CompressionConfig(window=64, block_size=64), {"block_size": 128}, "multiple of vLLM's block_size=128"),
        (CompressionConfig(method="pyramidkv"), {}, "pyramidkv"),
    ],
)
def test_bad_engine_config_fails_at_start_up(tiny_model: str, compression, kwargs, message: str) -> None:
    from kvllm.vllm.llm import LLM

    with pytest.raises(ValueError, match=message):
        LLM(tiny_model, compression=compression, **kwargs)


def test_bad_compression_values_fail_before_the_engine() -> None:
    with pytest.raises(ValueError, match="method"):
        CompressionConfig(method="nope")
    with pytest.raises(ValueError, match="retention"):
        CompressionConfig(retention=0)


def test_two_engines_in_one_process_capture_into_their_own_rings(tiny_model: str, tmp_path) -> None:
    """Capture state belongs to an engine: two in-process engines, stepped in turn, give
    what each gives alone."""
    from kvllm.testing import save_tiny_model
    from kvllm.vllm.capture import LAYER_ATTR
    from tests.vllm.conftest import SHAPE

    other = str(save_tiny_model(tmp_path / "other", seed=2, **{**SHAPE, "layers": 3}))
    alone = {}
    for model in (tiny_model, other):
        with engine(model, KARA) as llm:
            alone[model] = token_ids(llm.generate(PROMPTS[:4], greedy(120)))
    with engine(tiny_model, KARA) as a, engine(other, KARA) as b:
        engines = {tiny_model: a.llm.llm_engine, other: b.llm.llm_engine}
        for eng in engines.values():
            for i, p in enumerate(PROMPTS[:4]):
                eng.add_request(str(i), p, greedy(120))
        outputs: dict[str, dict[str, Any]] = {m: {} for m in engines}
        while any(e.has_unfinished_requests() for e in engines.values()):
            for model, eng in engines.items():
                for out in eng.step():
                    if out.finished:
                        outputs[model][out.request_id] = out
        for llm in (a, b):
            run = runner(llm)
            assert all(getattr(layer, LAYER_ATTR) is run.kv_capture for layer in run.kv_layers)
    for model in engines:
        got = [list(outputs[model][str(i)].outputs[0].token_ids) for i in range(4)]
        assert got == alone[model]


def test_priority_scheduling_and_structured_outputs_run_with_compression(tiny_model: str) -> None:
    """Two settings a client or an operator reaches: vLLM's priority scheduling (its
    preemption order) and structured outputs (a grammar masks each step's logits). Under a
    pool that preempts, every request compresses, obeys its grammar, and no block leaks;
    keep-all requests write what vanilla vLLM writes under the same settings."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    settings = {"scheduling_policy": "priority", "num_gpu_blocks_override": 24}
    prompts = PROMPTS[:8]
    pattern = r"(yes|no)( (yes|no)){30,40}"
    grammar = SamplingParams(max_tokens=240, temperature=0.0, structured_outputs=StructuredOutputsParams(regex=pattern))
    params = [grammar if i % 2 else greedy(160) for i in range(len(prompts))]
    priority = [i % 3 for i in range(len(prompts))]
    keep_all = greedy(120, extra_args={"kvllm": {"retention": 1.0}})
    with engine(tiny_model, KARA, **settings) as llm:
        outs = llm.generate(prompts, params, priority=priority)
        keep = token_ids(llm.generate(prompts, [keep_all] * len(prompts), priority=priority))
        sched = scheduler(llm)
        assert block_pool_usage(sched)[0] == 0 and sched.kv_requests == {}
        assert sched.kv_totals.preemptions > 0, "the pool should be small enough to preempt"
    with engine(tiny_model, None, plugin=False, **settings) as llm:
        vanilla = token_ids(llm.generate(prompts, greedy(120), priority=priority))
    assert all(o.compression["compressions"] > 0 for o in outs)
    for i, out in enumerate(outs):
        if i % 2:
            assert re.fullmatch(pattern, out.outputs[0].text), out.outputs[0].text
    assert keep == vanilla


@pytest.mark.slow
def test_lora_requests_compress_and_keep_all_equals_vanilla(tiny_model: str, tmp_path) -> None:
    """A LoRA adapter changes the queries and keys a round scores: with one, Kara runs its
    rounds, and keep-all writes what vanilla vLLM writes with the same adapter (and not
    what it writes without it). In make test-slow: LoRA engines take minutes to start here."""
    from vllm.lora.request import LoRARequest

    from kvllm.testing import save_tiny_lora

    lora = LoRARequest("random", 1, str(save_tiny_lora(tmp_path / "adapter", tiny_model)))
    settings = {"enable_lora": True, "max_lora_rank": 8}
    prompts = PROMPTS[:4]
    with engine(tiny_model, KARA, **settings) as llm:
        kara = llm.generate(prompts, greedy(120), lora_request=lora)
        keep = token_ids(
            llm.generate(prompts, greedy(120, extra_args={"kvllm": {"retention": 1.0}}), lora_request=lora)
        )
    with engine(tiny_model, None, plugin=False, **settings) as llm:
        vanilla = token_ids(llm.generate(prompts, greedy(120), lora_request=lora))
        base = token_ids(llm.generate(prompts, greedy(120)))
    assert all(o.compression["compressions"] > 0 for o in kara)
    assert keep == vanilla and vanilla != base
