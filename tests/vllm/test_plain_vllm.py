"""KvLLM loaded into vLLM with vLLM's own arguments only: ``vllm.LLM(...)`` and vLLM's API
server (``python -m vllm.entrypoints.launchers.api_server.entry``, what ``vllm serve``
runs). The plugin loads through its entry point; nothing of kvllm's front end is used."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import httpx
import openai
import pytest

from kvllm.vllm.engine import scheduler_of, shutdown
from tests.vllm.conftest import PROMPTS, SharedServer, greedy
from tests.vllm.test_server import TEMPLATE

KVLLM = {"window": 32, "buffer": 8, "period": 4, "retention": 0.25}
SCHEDULER = "kvllm.vllm.scheduler.CompressingScheduler"
SMALL = {"dtype": "float32", "max_model_len": 512, "enforce_eager": True, "kv_cache_memory_bytes": 64 * 2**20}


def test_vllm_llm_with_only_vllm_arguments(tiny_model: str) -> None:
    import vllm

    llm = vllm.LLM(
        tiny_model,
        scheduler_cls=SCHEDULER,
        additional_config={"kvllm": KVLLM},
        enable_prefix_caching=False,
        block_size=32,
        **SMALL,
    )
    try:
        outs = llm.generate(PROMPTS[:4], greedy(100), use_tqdm=False)
        assert scheduler_of(llm).kv_config.retention == 0.25
    finally:
        shutdown(llm)
    for out in outs:
        stats = out.kv_transfer_params["kvllm"]
        assert (stats["method"], stats["retention"]) == ("kara", 0.25) and stats["compressions"] > 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"additional_config": {"kvllm": {"windw": 64}}}, r"kvllm has unknown field\(s\) \[.windw.\]"),
        ({"additional_config": {"kvllm": {"retention": 2}}}, "CompressionConfig.retention=2"),
        ({"additional_config": {"kvllm": "kara"}}, "additional_config.kvllm must be an object"),
        ({"additional_config": {"kvllm": {"window": 48}}}, "window=48 is invalid"),
        ({"scheduler_cls": None}, "--scheduler-cls kvllm.vllm.scheduler.CompressingScheduler"),
    ],
)
def test_a_bad_kvllm_config_fails_before_any_engine_process(tiny_model: str, kwargs: dict, message: str) -> None:
    """Checked where vLLM creates the config (the plugin's hook), so the caller gets the
    ValueError itself, naming the field, and no EngineCore is started."""
    import vllm

    settings = {
        "scheduler_cls": SCHEDULER,
        "additional_config": {"kvllm": KVLLM},
        "enable_prefix_caching": False,
        "block_size": 32,
        **kwargs,
    }
    with pytest.raises(ValueError, match=message):
        vllm.LLM(tiny_model, **{k: v for k, v in settings.items() if v is not None}, **SMALL)


def _flags(kvllm: object) -> list[str]:
    flags = ["--scheduler-cls", SCHEDULER, "--additional-config", json.dumps({"kvllm": kvllm})]
    flags += ["--no-enable-prefix-caching", "--block-size", "32", "--middleware", "kvllm.vllm.server.KvllmMiddleware"]
    flags += ["--dtype", "float32", "--max-model-len", "512", "--enforce-eager", "--kv-cache-memory-bytes", "67108864"]
    return [*flags, "--chat-template", TEMPLATE]


DROP_ENV = ("VLLM_ENABLE_V1_MULTIPROCESSING", "KVLLM_SERVE_CONFIG", "KVLLM_METRICS_DIR")


SERVER = SharedServer("vllm_server", _flags(KVLLM), vllm=True, drop_env=DROP_ENV)


@pytest.fixture(scope="module")
def vllm_server(tiny_model: str) -> Iterator[str]:
    with SERVER.serving(tiny_model) as url:
        yield url


def test_vllm_api_server_with_only_vllm_flags(vllm_server: str, tiny_model: str) -> None:
    client = openai.OpenAI(base_url=f"{vllm_server}/v1", api_key="none", max_retries=0, timeout=300)
    ask = {"model": tiny_model, "messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 100}
    ask |= {"temperature": 0.0}
    plain = client.chat.completions.create(**ask, extra_body={"ignore_eos": True})
    stats = plain.model_extra["kv_transfer_params"]["kvllm"]
    assert (stats["method"], stats["retention"]) == ("kara", 0.25) and stats["compressions"] > 0
    # The plugin found the API process: streamed statistics and live metrics.
    chunks = list(client.chat.completions.create(**ask, stream=True, extra_body={"ignore_eos": True}))
    streamed = chunks[-1].model_extra["kv_transfer_params"]["kvllm"]
    assert {k: streamed[k] for k in ("logical_length", "physical_length")} == {
        k: stats[k] for k in ("logical_length", "physical_length")
    }
    text = httpx.get(f"{vllm_server}/metrics", timeout=10).text
    assert float(re.search(r"^kvllm:compression_rounds_total (\S+)$", text, re.M).group(1)) >= 2 * stats["compressions"]
    # Per-request overrides: through the middleware (validated against the engine's own
    # config), and through vLLM's own vllm_xargs.
    snap = client.chat.completions.create(**ask, extra_body={"ignore_eos": True, "kvllm": {"method": "snapkv"}})
    assert snap.model_extra["kv_transfer_params"]["kvllm"]["method"] == "snapkv"
    xargs = {"ignore_eos": True, "vllm_xargs": {"kvllm": json.dumps({"off": True})}}
    assert (
        client.chat.completions.create(**ask, extra_body=xargs).model_extra["kv_transfer_params"]["kvllm"][
            "compressions"
        ]
        == 0
    )
    bad = httpx.post(f"{vllm_server}/v1/chat/completions", json={**ask, "kvllm": {"retention": 0}}, timeout=30)
    assert bad.status_code == 400 and "retention=0" in bad.json()["error"]["message"]


REFUSED = SharedServer("refused_output", _flags({**KVLLM, "windw": 64}), vllm=True, drop_env=DROP_ENV)


@pytest.fixture(scope="module")
def refused_output(tiny_model: str) -> str:
    """What vLLM's API server printed as it exited, given a malformed kvllm config."""
    REFUSED.start(tiny_model)
    assert REFUSED.process.wait(timeout=300) != 0
    return REFUSED.log.read_text()


def test_vllm_api_server_refuses_a_malformed_kvllm_config(refused_output: str) -> None:
    assert "ValueError: additional_config.kvllm has unknown field(s) ['windw']" in refused_output
    assert "EngineCore" not in refused_output  # refused before an engine process started
