"""What the server benchmarks share: a free port, ``/metrics`` counters, SSE lines.

``kvllm bench serve`` (:mod:`kvllm.bench.serving`), its multi-turn client
(:mod:`kvllm.bench.multiturn`) and ``kvllm bench soak`` (:mod:`kvllm.bench.soak`) all
start servers and read their streams; the helpers live here so that none of the three
imports another for them.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator

# vLLM's counter, and KvLLM's (kvllm/vllm/metrics.py), summed over their label sets.
COUNTERS = {
    "preemptions": "vllm:num_preemptions",
    "rounds": "kvllm:compression_rounds",
    # Prompt tokens served from the prefix cache (vLLM's counter, both servers).
    "prefix_hits": "vllm:prefix_cache_hits",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def counters(base: str, names: dict[str, str] = COUNTERS) -> dict[str, float]:
    """``names`` (key -> metric) from ``/metrics``, each summed over its label sets (0 for
    one the server does not export)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{base}/metrics", timeout=10).text
    totals = dict.fromkeys(names, 0.0)
    for family in text_string_to_metric_families(text):
        for key, name in names.items():
            if family.name in (name, name.removesuffix("_total")):
                totals[key] += sum(s.value for s in family.samples if not s.name.endswith("_created"))
    return totals


async def sse_lines(chunks: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """The lines of a server-sent event stream, split only where SSE splits them.

    Not httpx's ``aiter_lines``: it splits like ``str.splitlines``, also at U+0085,
    U+2028 and U+2029, which JSON leaves unescaped inside strings, so a generated text
    holding one cut its chunk in two (the first soak lost a request to it).
    """
    buffer = b""
    async for data in chunks:
        buffer += data
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r").decode()
    if buffer:
        yield buffer.rstrip(b"\r").decode()
