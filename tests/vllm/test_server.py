"""`kvllm serve`: vLLM's OpenAI server with the plugin, in its real multiprocess form."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from kvllm.assets import model_path
from kvllm.bench.common import free_port
from kvllm.config import CompressionConfig
from kvllm.vllm.launch import start_server
from tests.vllm.conftest import PROMPTS, SharedServer, engine, greedy, serving

TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"

FLAGS = ["--kv-window", "32", "--kv-buffer", "8", "--kv-period", "4", "--kv-retention", "0.25"]
FLAGS += ["--dtype", "float32", "--block-size", "32", "--max-model-len", "512", "--enforce-eager"]
FLAGS += ["--kv-cache-memory-bytes", "67108864", "--num-gpu-blocks-override", "128", "--max-num-seqs", "32"]
FLAGS += ["--chat-template", TEMPLATE]
# The tiny-prompt guard is on by default only on AMX CPUs (server.tiny_prompt_guard): set
# it here so that it is tested on every machine.
FLAGS += ["--kv-min-prompt-tokens", "5"]


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}


SERVER = SharedServer("server", FLAGS)


@pytest.fixture(scope="module")
def server(tiny_model: str) -> Iterator[str]:
    with SERVER.serving(tiny_model) as url:
        yield url


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


def test_a_per_request_method_runs_that_method(server: str, tiny_model: str) -> None:
    """A request overridden to SnapKV generates exactly what an engine started with SnapKV
    at the server's settings generates, and not what the server's Kara generates."""

    def complete(extra: dict) -> str:
        body = {"model": tiny_model, "prompt": PROMPTS[2], "max_tokens": 150, "temperature": 0.0, "ignore_eos": True}
        response = httpx.post(f"{server}/v1/completions", json={**body, **extra}, timeout=120)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]

    kara, snap = complete({}), complete({"kvllm": {"method": "snapkv"}})
    config = CompressionConfig(method="snapkv", window=32, buffer=8, period=4, retention=0.25)
    with engine(tiny_model, config, num_gpu_blocks_override=128, max_num_seqs=32) as llm:
        (expected,) = llm.generate([PROMPTS[2]], greedy(150))
    assert snap == expected.outputs[0].text
    assert snap != kara


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


def test_a_bad_override_through_vllm_xargs_gets_400(server: str, tiny_model: str) -> None:
    """vLLM's own field, past the middleware: refused where the frontend builds the request,
    not run uncompressed with a warning in the log."""
    import json

    body = {"model": tiny_model, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}
    response = httpx.post(
        f"{server}/v1/chat/completions",
        json={**body, "vllm_xargs": {"kvllm": json.dumps({"retention": 0})}},
        timeout=30,
    )
    assert response.status_code == 400
    assert "retention=0" in response.json()["error"]["message"]
    ok = httpx.post(
        f"{server}/v1/chat/completions",
        json={**body, "vllm_xargs": {"kvllm": json.dumps({"retention": 0.5})}},
        timeout=60,
    )
    assert ok.status_code == 200


@pytest.mark.parametrize("prompt", ["v1", [11, 12], ["a longer prompt here, well over five tokens", "v1"]])
def test_tiny_prompt_is_refused_and_server_survives(server: str, tiny_model: str, prompt: object) -> None:
    """Text and token ids alike, and any prompt of a batch."""
    response = httpx.post(f"{server}/v1/completions", json={"model": tiny_model, "prompt": prompt, "max_tokens": 4})
    assert response.status_code == 400
    assert "at least 5" in response.json()["error"]["message"]
    for ok_prompt in (PROMPTS[1], list(range(10, 16))):
        ok = httpx.post(
            f"{server}/v1/completions", json={"model": tiny_model, "prompt": ok_prompt, "max_tokens": 4}, timeout=60
        )
        assert ok.status_code == 200


@pytest.mark.parametrize(("amx", "expected"), [(True, 5), (False, 0)])
def test_the_tiny_prompt_guard_is_on_where_the_crash_was_seen(
    amx: bool, expected: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    from kvllm.vllm.server import tiny_prompt_guard

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    assert tiny_prompt_guard() == expected


def _readme_serve_lines() -> list[list[str]]:
    """The README's `kvllm serve [MODEL] ...` lines, MODEL left out as its brackets allow."""
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    lines = re.findall(r"^\.venv/bin/kvllm serve \[MODEL\] (.*)$", readme, re.M)
    assert lines, "the README shows no `kvllm serve [MODEL]` line"
    return [line.split() for line in lines]


@pytest.mark.slow
def test_the_readmes_serve_line_as_written_answers(tmp_path: Path) -> None:
    """The README's serving line, no model, no memory share: it must start and answer. Only
    the port is swapped for a free one; the memory share is kvllm serve's own choice.

    Slow (two minutes: it compiles, and zeroes most of the machine's memory); by default
    its parts are checked apart: the line's flags against the CLI (test_cli_docs), the
    default model and memory share (test_settings), compiled equals eager
    (test_compile), and `make demo` serves the shipped model compiled."""
    flags = max(_readme_serve_lines(), key=len)
    if "--port" in flags:
        flags[flags.index("--port") + 1] = str(free_port())
    else:
        flags += ["--port", str(free_port())]
    port = flags[flags.index("--port") + 1]
    log = tmp_path / "server.log"
    process = subprocess.Popen(
        [sys.executable, "-m", "kvllm.cli", "serve", *flags],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env=_env(),
    )
    with serving(process, f"http://127.0.0.1:{port}", log) as base:
        assert httpx.get(f"{base}/health", timeout=5).status_code == 200
        models = httpx.get(f"{base}/v1/models", timeout=5).json()["data"]
        assert [m["id"] for m in models] == [str(model_path())]


STATS = ("method", "retention", "logical_length", "physical_length", "compressions", "tokens_dropped", "blocks_freed")


def _kvllm(text: str) -> dict[str, float]:
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^kvllm:(\w+) (\S+)$", text, re.M)}


def _metrics(base: str) -> dict[str, float]:
    return _kvllm(httpx.get(f"{base}/metrics", timeout=10).text)


def _chat(server: str, model: str, prompt: str, max_tokens: int, **extra: object) -> object:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=300).chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0.0,
        extra_body={"ignore_eos": True},
        **extra,
    )


@pytest.mark.parametrize("include_usage", [False, True])
def test_streamed_response_ends_with_the_statistics(server: str, tiny_model: str, include_usage: bool) -> None:
    """The final chunk (the usage chunk, with include_usage) carries kv_transfer_params
    shaped like a non-streaming response's; no other chunk does."""
    expected = _chat(server, tiny_model, PROMPTS[3], 100).model_extra["kv_transfer_params"]["kvllm"]
    options = {"stream_options": {"include_usage": True}} if include_usage else {}
    chunks = list(_chat(server, tiny_model, PROMPTS[3], 100, stream=True, **options))
    carrying = [i for i, c in enumerate(chunks) if "kv_transfer_params" in (c.model_extra or {})]
    assert carrying == [len(chunks) - 1]
    final = chunks[-1]
    if include_usage:
        assert final.choices == [] and final.usage.completion_tokens == 100
    else:
        assert final.choices[0].finish_reason == "length"
    stats = final.model_extra["kv_transfer_params"]["kvllm"]
    assert set(stats) == set(expected)
    assert {k: stats[k] for k in STATS} == {k: expected[k] for k in STATS}
    assert stats["compressions"] > 0 and stats["compress_seconds"] > 0


def test_streamed_completion_ends_with_the_statistics(server: str, tiny_model: str) -> None:
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=300)
    stream = client.completions.create(
        model=tiny_model,
        prompt=PROMPTS[4],
        max_tokens=80,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[-2].choices[0].finish_reason == "length"
    final = chunks[-1]
    stats = final.model_extra["kv_transfer_params"]["kvllm"]
    assert stats["method"] == "kara" and stats["compressions"] > 0
    # Each from its own source: the tokens seen from vLLM's usage (the last sampled token
    # has no KV yet), the tokens dropped from the flags (a round keeps 0.25 of W=32).
    assert stats["logical_length"] == final.usage.prompt_tokens + final.usage.completion_tokens - 1
    assert stats["tokens_dropped"] == stats["compressions"] * 24
    assert stats["physical_length"] == stats["logical_length"] - stats["tokens_dropped"]


async def _drop_at_statistics(base: str, model: str, prompt: str, usage: bool) -> bool:
    """Stream raw SSE and hang up as soon as the statistics start arriving (whatever of the
    stream's end a read already holds: the final chunk and [DONE] may come in one)."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 60,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        **({"stream_options": {"include_usage": True}} if usage else {}),
    }
    async with (
        httpx.AsyncClient(timeout=120) as client,
        client.stream("POST", f"{base}/v1/chat/completions", json=body) as response,
    ):
        seen = b""
        async for data in response.aiter_raw():
            seen += data
            if b"kv_transfer_params" in seen:
                return True  # hang up here: leaving the block closes the socket
    return False


def test_disconnect_during_the_statistics_chunk_leaks_nothing(server: str, tiny_model: str) -> None:
    async def main() -> list[bool]:
        jobs = [_drop_at_statistics(server, tiny_model, PROMPTS[i], usage=i % 2 == 1) for i in range(8)]
        return await asyncio.gather(*jobs)

    assert all(asyncio.run(main()))
    # One more request: a full engine step after the disconnects, whose metrics count
    # what every finished and dropped request left behind.
    assert _chat(server, tiny_model, PROMPTS[9], 8).choices[0].finish_reason == "length"
    live = _metrics(server)
    assert live["kv_blocks_used"] == 0 and live["kv_physical_tokens"] == 0 and live["kv_logical_tokens"] == 0
    text = httpx.get(f"{server}/metrics", timeout=10).text
    assert float(re.search(r"^vllm:num_requests_running\{[^}]*\} (\S+)$", text, re.M).group(1)) == 0
    assert httpx.get(f"{server}/health", timeout=5).status_code == 200


def test_metrics_move_while_a_request_decodes(server: str, tiny_model: str) -> None:
    """/metrics read during one long request: the counters step up round by round and
    the gauges show it holding fewer slots than tokens; after it, nothing is held."""
    samples: list[dict[str, float]] = []

    async def main() -> None:
        done = asyncio.Event()

        async def poll() -> None:
            async with httpx.AsyncClient(timeout=10) as client:
                while not done.is_set():
                    text = (await client.get(f"{server}/metrics")).text
                    samples.append({m[1]: float(m[2]) for m in re.finditer(r"^kvllm:(\w+) (\S+)$", text, re.M)})
                    await asyncio.sleep(0.02)

        poller = asyncio.create_task(poll())
        stream = await _client(server).completions.create(
            model=tiny_model, prompt=PROMPTS[6], max_tokens=440, temperature=0.0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        async for _ in stream:
            pass
        done.set()
        await poller

    asyncio.run(main())
    running = [s for s in samples if s["kv_logical_tokens"] > 0]
    assert len({s["compression_rounds_total"] for s in running}) >= 3, samples
    assert len({s["tokens_dropped_total"] for s in running}) >= 3
    assert len({s["blocks_freed_total"] for s in running}) >= 2
    assert any(s["kv_physical_tokens"] < s["kv_logical_tokens"] and s["kv_blocks_saved"] > 0 for s in running)
    assert all(s["kv_blocks_used"] > 0 for s in running)
    after = _metrics(server)
    assert after["kv_logical_tokens"] == after["kv_physical_tokens"] == after["kv_blocks_saved"] == 0
    assert after["compression_rounds_total"] >= max(s["compression_rounds_total"] for s in samples)


def test_compression_metrics_are_exported(server: str, tiny_model: str) -> None:
    httpx.post(
        f"{server}/v1/completions",
        json={"model": tiny_model, "prompt": PROMPTS[2], "max_tokens": 100, "ignore_eos": True},
        timeout=120,
    )
    values = _metrics(server)
    names = ("compression_rounds", "tokens_dropped", "blocks_freed", "compress_seconds")
    counters = {f"{name}_total" for name in names}
    gauges = {"kv_logical_tokens", "kv_physical_tokens", "kv_blocks_saved", "kv_blocks_used"}
    assert counters | gauges <= set(values)
    assert values["compression_rounds_total"] > 0 and values["tokens_dropped_total"] > 0
    assert values["compress_seconds_total"] > 0
    # vLLM's own metrics keep their names.
    assert re.search(r"^vllm:kv_cache_usage_perc\{", httpx.get(f"{server}/metrics", timeout=10).text, re.M)


@pytest.mark.slow
def test_metrics_with_two_api_servers(tiny_model: str, tmp_path: Path) -> None:
    """`--api-server-count 2`: each API server answers /metrics from a prometheus
    multiprocess registry, which carries the kvllm:* metrics too: the engine's totals,
    the same from either server and equal to the one request's own statistics (read
    once, not summed over the API servers)."""
    log = tmp_path / "server.log"
    flags = [*FLAGS, "--api-server-count", "2"]
    process, base = start_server(tiny_model, free_port(), flags, log=log, env=_env())
    with serving(process, base, log) as url:
        # vLLM accepts a new connection in the least loaded API server, so two connections
        # held open land on the two servers; the fresh ones may go to either.
        with httpx.Client(base_url=url, timeout=10) as a, httpx.Client(base_url=url, timeout=10) as b:

            def scrape() -> list[str]:
                texts = [a.get("/metrics").text, b.get("/metrics").text]
                return texts + [httpx.get(f"{url}/metrics", timeout=10).text for _ in range(4)]

            before = scrape()
            # The multiprocess registry answered, not the global one (which has the python_gc
            # collector): there really are several API servers.
            assert not any("python_gc_objects_collected_total" in text for text in before)
            assert all(_kvllm(text).get("compression_rounds_total") == 0 for text in before), before[0]
            response = a.post(
                "/v1/completions",
                json={"model": tiny_model, "prompt": PROMPTS[2], "max_tokens": 100, "ignore_eos": True},
                timeout=120,
            )
            assert response.status_code == 200, response.text
            stats = response.json()["kv_transfer_params"]["kvllm"]
            assert stats["compressions"] > 0 and stats["tokens_dropped"] > 0
            for text in scrape():
                values = _kvllm(text)
                assert values["compression_rounds_total"] == stats["compressions"], text
                assert values["tokens_dropped_total"] == stats["tokens_dropped"]
                assert values["kv_logical_tokens"] == values["kv_blocks_used"] == 0
                assert re.search(r"^vllm:request_success_total\{", text, re.M)  # vLLM's own, merged


@pytest.mark.slow
def test_data_parallel_engines_each_serve_and_compress(tiny_model: str, tmp_path: Path) -> None:
    """`--data-parallel-size 2`: two engines, each with its own KvLLM scheduler and pool,
    behind one API server. Concurrent requests land on both; each engine compresses, and
    every request generates exactly what one engine at the same settings generates for it
    alone (one engine's output does not depend on the other's); the kvllm:* counters sum
    both engines' rounds."""
    log = tmp_path / "server.log"
    flags = [*FLAGS, "--data-parallel-size", "2"]
    process, base = start_server(tiny_model, free_port(), flags, log=log, env=_env())
    body = {"model": tiny_model, "max_tokens": 120, "temperature": 0.0, "ignore_eos": True}

    async def main(url: str) -> list[dict]:
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            responses = await asyncio.gather(
                *(client.post("/v1/completions", json={**body, "prompt": p}) for p in PROMPTS[:8])
            )
        assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
        return [r.json() for r in responses]

    with serving(process, base, log) as url:
        served = asyncio.run(main(url))
        text = httpx.get(f"{url}/metrics", timeout=10).text
    per_engine = {
        m.group(1): float(m.group(2))
        for m in re.finditer(r'^vllm:request_success_total\{[^}]*engine="(\d+)"[^}]*\} (\S+)$', text, re.M)
        if float(m.group(2)) > 0
    }
    assert set(per_engine) == {"0", "1"} and sum(per_engine.values()) == 8, per_engine
    stats = [r["kv_transfer_params"]["kvllm"] for r in served]
    assert all(s["compressions"] > 0 for s in stats)
    assert _kvllm(text)["compression_rounds_total"] == sum(s["compressions"] for s in stats)
    config = CompressionConfig(window=32, buffer=8, period=4, retention=0.25)
    with engine(tiny_model, config, num_gpu_blocks_override=128, max_num_seqs=32) as llm:
        alone = [llm.generate([p], greedy(120))[0].outputs[0].text for p in PROMPTS[:8]]
    assert [r["choices"][0]["text"] for r in served] == alone


def _vllm_total(text: str, name: str) -> float:
    return sum(float(m.group(1)) for m in re.finditer(rf"^vllm:{name}_total\{{[^}}]*\}} (\S+)$", text, re.M))


def test_prefix_caching_is_on_by_default_and_metrics_show_the_hits(server: str, tiny_model: str) -> None:
    """The server runs with vLLM's default (prefix caching on): a second request sharing a
    three-block prompt prefix hits the cache, and vLLM's own counter says so."""
    system = "you are a careful solver: read every value, write each step, check the sum. " * 6
    before = _vllm_total(httpx.get(f"{server}/metrics", timeout=10).text, "prefix_cache_hits")
    for prompt in PROMPTS[20:22]:
        body = {"model": tiny_model, "prompt": system + prompt, "max_tokens": 80, "ignore_eos": True}
        out = httpx.post(f"{server}/v1/completions", json=body, timeout=120).json()
        assert out["kv_transfer_params"]["kvllm"]["compressions"] > 0
    after = _vllm_total(httpx.get(f"{server}/metrics", timeout=10).text, "prefix_cache_hits")
    assert after - before >= 3 * 32
