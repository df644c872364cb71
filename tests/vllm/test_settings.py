"""How settings reach vLLM: the one engine builder, serve's argv, overrides, bad values."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

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
        assert served.enable_prefix_caching is False
        assert CompressionConfig(**served.additional_config["kvllm"]).method == compression.method
    assert served.scheduler_cls == SCHEDULER


def test_serve_refuses_prefix_caching_and_a_misfit_block_size(tiny_model: str) -> None:
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        serve_argv(tiny_model, KARA, ["--enable-prefix-caching"])
    with pytest.raises(ValueError, match="multiple of vLLM's block_size=128"):
        serve_argv(tiny_model, KARA, ["--block-size", "128"])


def test_engine_kwargs_keeps_user_settings_and_fits_the_block_size() -> None:
    kwargs = engine_kwargs(KARA, {"block_size": 64, "additional_config": {"other": 1}})
    assert kwargs["block_size"] == 64 and kwargs["enable_prefix_caching"] is False
    assert kwargs["additional_config"]["other"] == 1
    assert kwargs["additional_config"]["kvllm"]["block_size"] == 64
    assert engine_kwargs(None, {}) == {"scheduler_cls": SCHEDULER}


def test_check_engine_names_the_parameter() -> None:
    assert check_engine(KARA, 32, False).block_size == 32
    with pytest.raises(ValueError, match=r"window=64 .* block_size=128"):
        check_engine(KARA, 128, None)
    with pytest.raises(ValueError, match="pyramidkv"):
        check_engine(CompressionConfig(method="pyramidkv"), 32, False)


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
        server.serve(tiny_model, KARA, ["--tensor-parallel-size", "4"], 5)
    assert started == []
    server.serve(tiny_model, KARA, ["--tensor-parallel-size", "2"], 5)
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
