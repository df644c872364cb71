"""How settings reach vLLM: the one engine builder, serve's argv, overrides, bad values."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from kvllm.config import CompressionConfig
from kvllm.vllm import engine
from kvllm.vllm.server import serve_argv
from kvllm.vllm.settings import (
    SCHEDULER,
    check_engine,
    check_parallel,
    engine_config,
    engine_kwargs,
    request_config,
    to_argv,
    worker_ranks,
)

KARA = CompressionConfig(window=64, buffer=8, period=4)


@pytest.mark.parametrize(
    ("compression", "flags", "kwargs"),
    [
        (KARA, [], {}),
        (KARA, ["--block-size", "64"], {"block_size": 64}),
        (None, [], {}),
        (CompressionConfig(method="snapkv", params={"obs_window": 8}), ["--max-num-seqs", "8"], {"max_num_seqs": 8}),
    ],
)
def test_serve_and_llm_build_the_same_engine(tiny_model: str, compression, flags: list[str], kwargs: dict) -> None:
    """`kvllm serve FLAGS` and `kvllm.LLM(**KWARGS)` for the same settings give vLLM the
    same engine arguments, field for field, where KvLLM sets them."""
    served = engine.engine_args_of_server(serve_argv(tiny_model, compression, flags))
    direct = engine.engine_args_of_llm(tiny_model, engine_kwargs(compression, kwargs))
    for field in ("block_size", "enable_prefix_caching", "scheduler_cls", "additional_config", "max_num_seqs"):
        assert getattr(served, field) == getattr(direct, field), field
    if compression is not None:
        expected = kwargs.get("block_size", 32)  # vLLM's flag when given, else the one default
        assert served.block_size == direct.block_size == expected
        # vLLM's own default (None: vLLM turns it on), unless the user's flag says otherwise.
        assert served.enable_prefix_caching is None
        assert CompressionConfig(**served.additional_config["kvllm"]).method == compression.method
    assert served.scheduler_cls == SCHEDULER


def test_serve_keeps_prefix_caching_and_refuses_a_misfit_block_size(tiny_model: str) -> None:
    for flags, expected in (([], None), (["--enable-prefix-caching"], True), (["--no-enable-prefix-caching"], False)):
        args = engine.parse_server_args(serve_argv(tiny_model, KARA, flags))
        assert args.enable_prefix_caching is expected, flags
    with pytest.raises(ValueError, match="multiple of vLLM's block_size=128"):
        serve_argv(tiny_model, KARA, ["--block-size", "128"])


def test_engine_kwargs_keeps_user_settings_and_fits_the_block_size() -> None:
    kwargs = engine_kwargs(KARA, {"block_size": 64, "additional_config": {"other": 1}})
    assert kwargs["block_size"] == 64 and "enable_prefix_caching" not in kwargs  # vLLM's default
    assert engine_kwargs(KARA, {"enable_prefix_caching": False})["enable_prefix_caching"] is False
    assert kwargs["additional_config"]["other"] == 1
    assert kwargs["additional_config"]["kvllm"]["block_size"] == 64
    assert engine_kwargs(None, {}) == {"scheduler_cls": SCHEDULER}


def test_check_engine_names_the_parameter() -> None:
    assert check_engine(KARA, 32).block_size == 32
    with pytest.raises(ValueError, match=r"window=64 .* block_size=128"):
        check_engine(KARA, 128)
    with pytest.raises(ValueError, match="pyramidkv"):
        check_engine(CompressionConfig(method="pyramidkv"), 32)


def test_to_argv_spells_vllm_flags() -> None:
    argv = to_argv({"block_size": 32, "enable_prefix_caching": False, "additional_config": {"a": 1}})
    assert argv == ["--block-size", "32", "--no-enable-prefix-caching", "--additional-config", '{"a": 1}']


def test_engine_config_round_trips_and_rejects_malformed_objects() -> None:
    raw = {"kvllm": dataclasses.asdict(KARA)}
    assert engine_config(json.loads(json.dumps(raw))) == KARA
    assert engine_config({}) is None and engine_config(None) is None
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['windw'\]"):
        engine_config({"kvllm": {"windw": 64}})
    with pytest.raises(ValueError, match="must be an object"):
        engine_config({"kvllm": "kara"})
    with pytest.raises(ValueError, match="retention"):
        engine_config({"kvllm": {"retention": 2}})


def test_request_overrides() -> None:
    assert request_config(KARA, None) is KARA
    assert request_config(KARA, {"kvllm": {"off": True}}) is None
    snap = request_config(KARA, {"kvllm": json.dumps({"method": "snapkv", "retention": 0.5})})
    assert (snap.method, snap.retention, snap.window) == ("snapkv", 0.5, 64)
    tuned = request_config(KARA, {"kvllm": {"params": {"rho": 0.25}}})
    assert tuned.method_params.rho == 0.25
    for bad, fragment in [
        ({"window": 64}, "unknown field"),
        ({"retention": 0}, "retention"),
        ({"off": "yes"}, "off='yes'"),
        ({"method": "pyramidkv"}, "pyramidkv"),
        ({"params": {"nope": 1}}, "unknown field"),
        ("{not json", "JSON object"),
        ([1], "must be an object"),
    ]:
        with pytest.raises(ValueError, match=fragment):
            request_config(KARA, {"kvllm": bad})
    with pytest.raises(ValueError, match="started without compression"):
        request_config(None, {"kvllm": {"retention": 0.5}})


def _topology(monkeypatch: pytest.MonkeyPatch, nodes: list[int], cpus: list[tuple[int, int]]) -> None:
    """Fake what vLLM reads of the machine: NUMA nodes, and (logical CPU, physical core) pairs."""
    import vllm.utils.cpu_resource_utils as cpu_utils

    monkeypatch.setenv(engine.BIND, "")  # restored at teardown to what it was, also when unset
    monkeypatch.delenv(engine.BIND)
    monkeypatch.setattr(cpu_utils, "get_visible_memory_node", lambda: nodes)
    monkeypatch.setattr(
        cpu_utils, "get_allowed_cpu_list", lambda: [cpu_utils.LogicalCPUInfo(i, core, 0) for i, core in cpus]
    )


def test_cpu_threads_are_bound_when_vllm_cannot(monkeypatch: pytest.MonkeyPatch) -> None:
    _topology(monkeypatch, [0], [(0, 0), (1, 1)])
    assert engine.bind_cpu_threads(1) is None  # one rank: vLLM's default works
    assert engine.bind_cpu_threads(2) == "0|1" == os.environ[engine.BIND]
    assert engine.bind_cpu_threads(2) is None  # set already (by the user, or above): left alone
    # SMT: one logical CPU per physical core, as vLLM's auto binding picks them.
    _topology(monkeypatch, [0], [(0, 0), (1, 1), (2, 2), (3, 3), (4, 0), (5, 1), (6, 2), (7, 3)])
    assert engine.bind_cpu_threads(2) == "4,5|6,7"
    _topology(monkeypatch, [0, 1], [(0, 0), (1, 1)])
    assert engine.bind_cpu_threads(2) is None  # a NUMA node per rank: vLLM binds itself
    _topology(monkeypatch, [0], [(0, 0)])
    with pytest.raises(ValueError, match="set VLLM_CPU_OMP_THREADS_BIND yourself"):
        engine.bind_cpu_threads(2)


def test_tensor_parallel_size_must_divide_the_kv_heads() -> None:
    check_parallel(1, 3)
    check_parallel(2, 2)
    check_parallel(4, None)  # unknown here: the scheduler checks it in the engine
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 .* the model's 2 KV heads.* \[1, 2\]"):
        check_parallel(4, 2)
    with pytest.raises(ValueError, match="tensor_parallel_size=2"):
        check_parallel(2, 3)
    assert worker_ranks({"tensor_parallel_size": 2, "data_parallel_size": 2}) == 4
    assert worker_ranks({}) == 1


def test_serve_checks_tensor_parallelism_and_binds_threads(tiny_model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`kvllm serve --tensor-parallel-size N`: refused before anything starts when N does not
    divide the KV heads; otherwise the CPU binding is set for its N ranks, then vLLM starts."""
    from kvllm.vllm import server

    monkeypatch.setenv(server.ENV, "{}")  # serve() overwrites it; restored after the test
    started, ranks = [], []
    monkeypatch.setattr(engine, "run_api_server", started.append)
    monkeypatch.setattr(engine, "bind_cpu_threads", ranks.append)
    with pytest.raises(ValueError, match="tensor_parallel_size=4"):
        server.serve(KARA, [tiny_model, "--tensor-parallel-size", "4"], 5)
    assert started == []
    server.serve(KARA, [tiny_model, "--tensor-parallel-size", "2"], 5)
    assert ranks == [2] and "--tensor-parallel-size" in started[0]


@pytest.mark.parametrize(("flags", "count"), [([], 1), (["--api-server-count", "2"], 2), (["--headless"], 0)])
def test_serve_dispatches_like_vllm_serve(flags: list[str], count: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """`kvllm serve` goes through `vllm serve`'s dispatch, so `--api-server-count` and
    `--headless` are honoured (vLLM's API-server entry ignores both); one API server in
    this process without them, also with data parallelism. Nothing is started here."""
    import sys

    import vllm.entrypoints.cli.serve as vllm_serve

    monkeypatch.setattr(sys, "argv", sys.argv)  # run_api_server sets them; restored after
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # what vLLM's CLI setup sets
    ran: list[tuple[str, int | None]] = []

    async def one_server(args: object) -> None:
        ran.append(("one", args.api_server_count))  # type: ignore[attr-defined]

    monkeypatch.setattr(vllm_serve, "run_server", one_server)
    monkeypatch.setattr(vllm_serve, "run_multi_api_server", lambda args: ran.append(("multi", args.api_server_count)))
    monkeypatch.setattr(vllm_serve, "run_headless", lambda args: ran.append(("headless", args.api_server_count)))
    engine.run_api_server(["--model", "m", "--data-parallel-size", "2", *flags])
    kind = {0: "headless", 1: "one", 2: "multi"}[count]
    assert ran == [(kind, None if count == 1 else count)]


def _served_argv(monkeypatch: pytest.MonkeyPatch, cli_args: list[str], share: float | None = 0.41) -> list[str]:
    """The argv ``kvllm CLI_ARGS`` hands vLLM's server, with nothing started, and the free
    memory measured as if a share of ``share`` fitted (``None``: vLLM's default fits)."""
    from typer.testing import CliRunner

    from kvllm.cli import app
    from kvllm.vllm import server

    monkeypatch.setenv(server.ENV, "{}")  # serve() overwrites it; restored after the test
    started: list[list[str]] = []
    monkeypatch.setattr(engine, "run_api_server", started.append)
    monkeypatch.setattr(engine, "fitted_memory_share", lambda ranks: share)
    result = CliRunner().invoke(app, cli_args)
    assert result.exit_code == 0, result.output
    (argv,) = started
    return argv


@pytest.mark.parametrize(
    ("cli_args", "model"),
    [
        # The README's serving line with [MODEL] left out, and two lines that once failed.
        (["serve", "--kv-compression", "kara", "--kv-retention", "0.2", "--dtype", "float32", "--port", "8000"], None),
        (["serve", "--port", "8000"], None),
        (["serve", "--dtype", "float32", "--gpu-memory-utilization", "0.4", "--port", "8013"], None),
        (["serve", "MODEL", "--kv-retention", "0.3", "--dtype", "float32"], "MODEL"),
        (["serve", "--port", "8000", "--kv-retention", "0.3", "MODEL"], "MODEL"),
        (["serve", "--model", "MODEL", "--port", "8000"], "MODEL"),
    ],
)
def test_serve_finds_the_model_among_vllm_flags(
    tiny_model: str, cli_args: list[str], model: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's parser tells the model from a flag's value, wherever it stands; none given:
    the shipped model. Every other flag reaches vLLM's server as given."""
    from kvllm.assets import model_path

    cli_args = [tiny_model if a == "MODEL" else a for a in cli_args]
    argv = _served_argv(monkeypatch, cli_args)
    args = engine.parse_server_args(argv)
    assert (args.model_tag or args.model) == (tiny_model if model else str(model_path()))
    if "--port" in cli_args:
        assert args.port == int(cli_args[cli_args.index("--port") + 1])
    if "--kv-retention" in cli_args:
        assert args.additional_config["kvllm"]["retention"] == float(cli_args[cli_args.index("--kv-retention") + 1])


@pytest.mark.parametrize(
    ("flags", "share", "expected"),
    [
        ([], 0.41, 0.41),  # vLLM's default does not fit: the fitted share
        ([], None, 0.92),  # it fits: vLLM's default, untouched
        (["--gpu-memory-utilization", "0.3"], 0.41, 0.3),  # the user's choice wins
        (["--gpu_memory_utilization=0.3"], 0.41, 0.3),
        (["--kv-cache-memory-bytes", "1000000000"], 0.41, 0.92),  # no share is checked then
    ],
)
def test_serve_fits_the_memory_share_only_when_none_is_given(
    flags: list[str], share: float | None, expected: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    argv = _served_argv(monkeypatch, ["serve", *flags], share=share)
    assert engine.parse_server_args(argv).gpu_memory_utilization == expected


def _node(total_gib: float, free_gib: float) -> object:
    from vllm.utils.cpu_resource_utils import MemoryNodeInfo

    return MemoryNodeInfo(total_memory=int(total_gib * 2**30), available_memory=int(free_gib * 2**30))


@pytest.mark.parametrize(
    ("total", "free", "ranks", "expected"),
    [
        (13.21, 11.75, 1, 0.69),  # a node where vLLM's default failed: 0.92 asks 12.16 GiB of 11.75 free
        (13.21, 11.75, 2, 0.34),  # two workers on the one node share it
        (8.46, 7.9, 1, 0.68),  # a smaller machine: the API server there took 0.9 GiB before the worker's check
        (26.42, 26.0, 1, None),  # 0.92 fits beside the start-up reserve: vLLM's default stays
    ],
)
def test_fitted_memory_share_passes_vllms_own_check(
    total: float, free: float, ranks: int, expected: float | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chosen share passes the check vllm-cpu's worker makes at start-up
    (``ceil(total x share) <= available``, every worker on the node reserving its share)."""
    import math

    import vllm.utils.cpu_resource_utils as cpu_utils

    node = _node(total, free)
    monkeypatch.setattr(cpu_utils, "get_visible_memory_node", lambda: [0])
    monkeypatch.setattr(cpu_utils, "get_memory_node_info", lambda n: node)
    share = engine.fitted_memory_share(ranks)
    assert share == expected
    if share is not None:
        # The worker's check passes after the API server has taken the start-up reserve.
        left = node.available_memory - engine.STARTUP_RESERVE
        assert ranks * math.ceil(node.total_memory * share) <= left
        assert ranks * math.ceil(node.total_memory * (share + 0.01)) <= left  # not needlessly low
    monkeypatch.setattr(cpu_utils, "get_memory_node_info", lambda n: _node(13.21, 0.05))
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        engine.fitted_memory_share(1)


def test_a_request_cannot_name_a_calibration_file(tmp_path) -> None:
    """Calibration files are the operator's: a request naming another path gets a clear
    error (HTTP 400 at the server), before anything opens it; the engine's own passes."""
    import torch
    from safetensors.torch import save_file

    engine_path = str(tmp_path / "engine.safetensors")
    save_file({"q_filters": torch.zeros(2, 2, 32)}, engine_path)
    base = CompressionConfig(method="kara", params={"rho": 0.5})
    with pytest.raises(ValueError, match=r"params\.calibration cannot be set per request"):
        request_config(base, {"kvllm": {"method": "qfilter", "params": {"calibration": "/etc/passwd"}}})
    qfilter = base.replace(method="qfilter", params={"calibration": engine_path})
    with pytest.raises(ValueError, match=r"params\.calibration cannot be set per request"):
        request_config(qfilter, {"kvllm": {"params": {"calibration": "/etc/passwd"}}})
    assert request_config(qfilter, {"kvllm": {"retention": 0.5}}).params["calibration"] == engine_path


def test_a_calibration_file_of_another_model_fails_at_start_up(tmp_path) -> None:
    """``check_vllm_config`` runs ``check_model`` in the process that builds the engine's
    config, before any engine process starts, and refuses qfilter under tensor parallelism
    (a rank's windows hold a share of the KV heads the file has)."""
    from transformers import Qwen3Config

    from kvllm.methods.qfilter import save_calibration
    from kvllm.vllm.settings import check_model

    model = Qwen3Config(
        hidden_size=32, vocab_size=100, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8
    )
    llama = str(tmp_path / "llama.safetensors")
    save_calibration(llama, torch.randn(2, 2, 8), {"model": "m", "model_type": "llama"})
    with pytest.raises(ValueError, match=r"model_type llama \(this model: qwen3\)"):
        check_model(CompressionConfig(method="qfilter", params={"calibration": llama}), model, 1)
    path = str(tmp_path / "qwen3.safetensors")
    save_calibration(path, torch.randn(2, 2, 8), {"model": "m", "model_type": "qwen3"})
    config = CompressionConfig(method="qfilter", params={"calibration": path})
    check_model(config, model, 1)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2.*--tensor-parallel-size 1"):
        check_model(config, model, 2)
    check_model(CompressionConfig(method="kara"), model, 2)


ENGINE = {"dtype": "float32", "enforce_eager": True, "gpu_memory_utilization": 0.3, "max_model_len": 512}


def _vllm_config(model: str, **kwargs: object) -> object:
    """The ``VllmConfig`` ``kvllm.LLM`` would start, built (and checked, by the plugin) here."""
    from kvllm.vllm.plugin import register

    register()
    return engine.engine_args_of_llm(model, engine_kwargs(KARA, {**ENGINE, **kwargs})).create_engine_config()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}},
            r"speculative decoding \(--speculative-config\)",
        ),
        ({"kv_cache_dtype": "fp8"}, r"kv_cache_dtype='fp8' \(--kv-cache-dtype\)"),
        ({"kv_transfer_config": {"kv_connector": "ExampleConnector", "kv_role": "kv_both"}}, "KV connector"),
        ({"pipeline_parallel_size": 2}, r"pipeline_parallel_size=2 \(--pipeline-parallel-size\)"),
    ],
)
def test_engine_features_a_round_would_break_are_refused_at_start_up(
    tiny_model: str, kwargs: dict, message: str
) -> None:
    """Refused where vLLM builds the engine's config, before any engine process exists."""
    with pytest.raises(ValueError, match=message + ".* is not supported with KV compression"):
        _vllm_config(tiny_model, **kwargs)


def test_a_kv_cache_dtype_equal_to_the_models_is_accepted(tiny_model: str) -> None:
    """Not a quantized cache: bf16 KV for a bf16 model is what auto gives."""
    assert _vllm_config(tiny_model, dtype="bfloat16", kv_cache_dtype="bfloat16") is not None
    with pytest.raises(ValueError, match=r"kv_cache_dtype='float16'.*model's dtype \(bfloat16\)"):
        _vllm_config(tiny_model, dtype="bfloat16", kv_cache_dtype="float16")


def test_settings_vllm_decides_itself_are_checked_as_it_decided(
    tiny_model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The runner version, the platform, async scheduling (the CPU platform turns it off
    today) and the attention ISA are vLLM's decisions: checked on the config it built."""
    from vllm.platforms import current_platform

    from kvllm.vllm.settings import check_vllm_config

    config = _vllm_config(tiny_model)
    assert check_vllm_config(config) is not None
    with monkeypatch.context() as m:
        m.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
        with pytest.raises(ValueError, match="VLLM_USE_V2_MODEL_RUNNER=1"):
            check_vllm_config(config)
    with monkeypatch.context() as m:
        m.setattr(type(current_platform), "is_cpu", lambda self: False)
        with pytest.raises(ValueError, match="CPU model runner only"):
            check_vllm_config(config)
    with monkeypatch.context() as m:
        m.setattr(config.parallel_config, "decode_context_parallel_size", 2)
        with pytest.raises(ValueError, match=r"decode_context_parallel_size=2 \(--decode-context-parallel-size\)"):
            check_vllm_config(config)
    with monkeypatch.context() as m:
        m.setattr(config.scheduler_config, "async_scheduling", True)
        with pytest.raises(ValueError, match="async scheduling"):
            check_vllm_config(config)
    with monkeypatch.context() as m:
        # On a CPU with AMX, vLLM runs bf16 attention with the "amx" ISA, whose cache
        # layout rounds cannot read: refused at start-up, not at the first round.
        m.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
        m.setattr(config.model_config, "dtype", torch.bfloat16)
        with pytest.raises(ValueError, match=r"ISA 'amx'.*--dtype float32"):
            check_vllm_config(config)


def test_only_one_kv_cache_group_of_full_attention_is_accepted() -> None:
    from types import SimpleNamespace

    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    from kvllm.vllm.settings import check_kv_cache

    full = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
    window = SlidingWindowSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32, sliding_window=128)

    def layout(*specs: object) -> SimpleNamespace:
        return SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=s) for s in specs])

    check_kv_cache(layout(full))
    with pytest.raises(ValueError, match="2 KV cache groups"):
        check_kv_cache(layout(full, window))
    with pytest.raises(ValueError, match="SlidingWindowSpec"):
        check_kv_cache(layout(window))
    with pytest.raises(ValueError, match=r"FullAttentionSpec \(window 64\)"):
        check_kv_cache(layout(dataclasses.replace(full, sliding_window=64)))


def test_cross_layer_kv_sharing_is_refused(tmp_path) -> None:
    """Layers that read another layer's KV cache: announced by the config, refused where
    vLLM builds the engine's config; and found in the loaded model by the worker."""
    from types import SimpleNamespace

    from kvllm.testing import save_tiny_model
    from kvllm.vllm.settings import check_kv_sharing

    model = save_tiny_model(tmp_path / "shared", seed=1, hidden_size=128, layers=2, heads=4, kv_heads=2, head_dim=32)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "num_kv_shared_layers": 1}))
    with pytest.raises(ValueError, match=r"cross-layer KV sharing \(num_kv_shared_layers=1.* is not supported"):
        _vllm_config(str(model))

    def layer(name: str, target: str | None) -> SimpleNamespace:
        return SimpleNamespace(layer_name=name, kv_sharing_target_layer_name=target)

    check_kv_sharing([layer("layers.0.attn", None), layer("layers.1.attn", None)])
    with pytest.raises(ValueError, match=r"1 layers read another layer's KV cache, e.g. layers.1.attn -> layers.0"):
        check_kv_sharing([layer("layers.0.attn", None), layer("layers.1.attn", "layers.0.attn")])
