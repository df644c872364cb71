"""`kvllm serve`: vLLM's OpenAI server with the plugin, in its real multiprocess form."""

from __future__ import annotations

import asyncio
import os
import re
import socket
from collections.abc import Iterator

import httpx
import openai
import pytest

from kvllm.vllm.launch import start_server, stop, wait_healthy
from tests.vllm.conftest import PROMPTS

TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("serve") / "server.log"
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    flags = ["--kv-window", "32", "--kv-buffer", "8", "--kv-period", "4", "--kv-retention", "0.25"]
    flags += ["--dtype", "float32", "--block-size", "32", "--max-model-len", "512", "--enforce-eager"]
    flags += ["--gpu-memory-utilization", "0.3", "--num-gpu-blocks-override", "128", "--max-num-seqs", "32"]
    flags += ["--chat-template", TEMPLATE]
    process, base = start_server(tiny_model, _free_port(), flags, log=log, env=env)
    try:
        try:
            wait_healthy(process, base, timeout=300)
        except (RuntimeError, TimeoutError) as err:
            pytest.fail(f"{err}:\n{log.read_text()[-3000:]}")
        yield base
    finally:
        stop(process)


def _client(base: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=300)


async def _stream(client: openai.AsyncOpenAI, model: str, prompt: str, disconnect_after: int | None) -> str | None:
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=120,
        temperature=0.0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks, finish = 0, None
    async for chunk in stream:
        chunks += 1
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
        if disconnect_after is not None and chunks >= disconnect_after:
            await stream.close()  # the client goes away mid-stream
            return None
    return finish


def test_concurrent_streams_with_a_disconnect(server: str, tiny_model: str) -> None:
    async def main() -> list[str | None]:
        client = _client(server)
        jobs = [_stream(client, tiny_model, PROMPTS[i], 3 if i == 5 else None) for i in range(16)]
        return await asyncio.gather(*jobs)

    results = asyncio.run(main())
    assert results[5] is None
    assert [r for i, r in enumerate(results) if i != 5] == ["length"] * 15
    assert httpx.get(f"{server}/health", timeout=5).status_code == 200


def test_per_request_overrides_are_honoured(server: str, tiny_model: str) -> None:
    async def one(extra: dict) -> dict:
        response = await _client(server).chat.completions.create(
            model=tiny_model,
            messages=[{"role": "user", "content": PROMPTS[0]}],
            max_tokens=100,
            temperature=0.0,
            extra_body={"ignore_eos": True, **extra},
        )
        return response.model_extra["kv_transfer_params"]["kvllm"]

    default = asyncio.run(one({}))
    snap = asyncio.run(one({"kvllm": {"method": "snapkv", "retention": 0.5}}))
    off = asyncio.run(one({"kvllm": {"off": True}}))
    assert (default["method"], default["retention"]) == ("kara", 0.25) and default["compressions"] > 0
    assert (snap["method"], snap["retention"]) == ("snapkv", 0.5) and snap["compressions"] > 0
    assert off["method"] is None and off["compressions"] == 0


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"retention": 0}, "retention=0"),
        ({"method": "nope"}, "method='nope'"),
        ({"window": 64}, "unknown field"),
        ({"method": "adakv"}, "adakv"),
        ("kara", "must be an object"),
    ],
)
def test_bad_override_gets_400(server: str, tiny_model: str, override: object, message: str) -> None:
    response = httpx.post(
        f"{server}/v1/chat/completions",
        json={"model": tiny_model, "messages": [{"role": "user", "content": "hello there"}], "kvllm": override},
        timeout=30,
    )
    assert response.status_code == 400
    assert message in response.json()["error"]["message"]


def test_tiny_prompt_is_refused_and_server_survives(server: str, tiny_model: str) -> None:
    response = httpx.post(f"{server}/v1/completions", json={"model": tiny_model, "prompt": "v1", "max_tokens": 4})
    assert response.status_code == 400
    assert "at least 5" in response.json()["error"]["message"]
    ok = httpx.post(
        f"{server}/v1/completions", json={"model": tiny_model, "prompt": PROMPTS[1], "max_tokens": 4}, timeout=60
    )
    assert ok.status_code == 200


def test_compression_metrics_are_exported(server: str, tiny_model: str) -> None:
    httpx.post(
        f"{server}/v1/completions",
        json={"model": tiny_model, "prompt": PROMPTS[2], "max_tokens": 100, "ignore_eos": True},
        timeout=120,
    )
    text = httpx.get(f"{server}/metrics", timeout=10).text
    values = {
        name: float(m.group(1))
        for name in ("compression_rounds", "tokens_dropped", "blocks_freed", "compress_seconds")
        if (m := re.search(rf"^kvllm:{name}_total (\S+)$", text, re.M))
    }
    assert set(values) == {"compression_rounds", "tokens_dropped", "blocks_freed", "compress_seconds"}
    assert values["compression_rounds"] > 0 and values["tokens_dropped"] > 0
