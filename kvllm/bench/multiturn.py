"""Multi-turn conversations for ``kvllm bench serve --turns N``.

vLLM's serving-benchmark client has no multi-turn dataset, so this small client runs
one. Each conversation sends ``turns`` requests one after another; turn 1's prompt is a
shared prefix (a system prompt, the same for every conversation) and ``input_len``
random token ids of its own, and turn k+1's prompt is turn k's prompt, turn k's output
and ``input_len`` new ids (the user's next message), as a chat client resends its
history; with ``answer_len``, only the last ``answer_len`` tokens of turn k's output,
as a reasoning model's chat template sends an earlier answer without its reasoning.
At most ``concurrency`` conversations are in flight.

That is the workload where the two servers' prefix caches differ: vanilla vLLM caches
the blocks a request generated too, so a later turn finds the whole earlier turn cached;
a compressing KvLLM request caches only its prompt blocks (its rounds rewrite the
generated ones), so it prefills the earlier answer again. The figures keep the
definitions of vLLM's client (``vllm.benchmarks.serve``): TTFT to the first streamed
chunk, ITL between chunks, TPOT per request after the first token, output tok/s over the
point's duration, with the same percentiles; TTFT is also split into turn 1 and the
later turns.

The prompts go as token ids (``/v1/completions`` takes a list of ints) and the output
comes back as token ids (``return_token_ids``: each streamed choice's ``token_ids`` holds
that chunk's new tokens), so no text is re-tokenized between turns: turn k+1 starts with
exactly the tokens the server held for turn k.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvllm.bench.common import sse_lines


def prompt_ids(vocab_size: int, special_ids: Sequence[int]) -> list[int]:
    """Token ids a random prompt may hold: ``[0, vocab_size)`` without ``special_ids``.

    A special id (EOS, padding, a chat-template marker) in a random prompt could change
    how the server treats it; the plain ids are all alike to it.
    """
    special = set(special_ids)
    return [i for i in range(vocab_size) if i not in special]


def tokenizer_ids(model: str) -> list[int]:
    """:func:`prompt_ids` of ``model``'s tokenizer: its base vocabulary without its
    special ids (the named ones and any added token marked special)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    special = set(tokenizer.all_special_ids)
    special |= {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    return prompt_ids(tokenizer.vocab_size, sorted(special))


def draw(
    seed: int, conversations: int, turns: int, prefix_len: int, input_len: int, ids: Sequence[int]
) -> tuple[list[int], list[list[list[int]]]]:
    """The shared prefix and every conversation's user messages (``[conversation][turn]``).

    Everything random is drawn here, before any request, from seeded generators: one for
    the prefix and one per conversation (string seeds, which Python hashes the same way
    in every process), so a conversation's messages do not depend on the server's
    answers, on timing, or on how many conversations there are.
    """
    prefix = random.Random(f"prefix/{seed}").choices(ids, k=prefix_len)
    messages = []
    for c in range(conversations):
        rng = random.Random(f"conversation/{seed}/{c}")
        messages.append([rng.choices(ids, k=input_len) for _ in range(turns)])
    return prefix, messages


def first_prompt(prefix: Sequence[int], message: Sequence[int]) -> list[int]:
    """Turn 1: the shared prefix, then the conversation's first message."""
    return [*prefix, *message]


def next_prompt(
    prompt: Sequence[int], output: Sequence[int], message: Sequence[int], answer_len: int | None = None
) -> list[int]:
    """Turn k+1: turn k's prompt, its output, then the next message (the chat so far).

    With ``answer_len``, only the output's last ``answer_len`` tokens go back: a chat
    template that drops the earlier turns' reasoning (Qwen3's removes their ``<think>``
    blocks) sends each earlier answer without the chain of thought before it.
    """
    kept = output if answer_len is None else output[len(output) - answer_len :]
    return [*prompt, *kept, *message]


@dataclass(frozen=True)
class TurnRecord:
    """One finished turn, timed as vLLM's client times a request (seconds)."""

    conversation: int
    turn: int  # from 1
    prompt_len: int
    output_len: int
    ttft: float  # request sent -> first chunk with a choice
    latency: float  # request sent -> last chunk with a choice
    itl: tuple[float, ...] = ()  # between consecutive chunks with a choice


def body(model: str, prompt: Sequence[int], output_len: int) -> dict[str, Any]:
    """The request vLLM's client sends (its payload for ``/v1/completions``), with the
    prompt as token ids and ``return_token_ids`` for the output's."""
    return {
        "model": model, "prompt": list(prompt), "repetition_penalty": 1.0, "max_tokens": output_len,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True,
    }  # fmt: skip


async def send_turn(
    client: Any, url: str, model: str, prompt: Sequence[int], output_len: int, conversation: int, turn: int
) -> tuple[TurnRecord, list[int]]:
    """Stream one turn; returns its record and its output token ids.

    Raises
    ------
    RuntimeError
        On an HTTP error, an error event in the stream, or an output of other than
        ``output_len`` ids: the next turn would be built on a wrong history, so the
        point fails instead of measuring it.
    """
    where = f"conversation {conversation} turn {turn}"
    start = time.perf_counter()
    ttft, last, itl, output, usage = None, start, [], [], None
    async with client.stream("POST", url, json=body(model, prompt, output_len)) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{where}: HTTP {response.status_code}: {(await response.aread())[:500]!r}")
        async for line in sse_lines(response.aiter_bytes()):
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"{where}: the stream reported {json.dumps(chunk['error'])[:500]}")
            if choices := chunk.get("choices"):
                now = time.perf_counter()
                if ttft is None:
                    ttft = now - start
                else:
                    itl.append(now - last)
                last = now
                output += choices[0].get("token_ids") or []
            usage = chunk.get("usage") or usage
    if ttft is None or len(output) != output_len:
        tokens = (usage or {}).get("completion_tokens")
        raise RuntimeError(
            f"{where}: {len(output)} output token ids of {output_len} (usage says {tokens} completion tokens)"
        )
    record = TurnRecord(conversation, turn, len(prompt), len(output), ttft, last - start, tuple(itl))
    return record, output


async def run_conversations(
    base: str,
    model: str,
    prefix: Sequence[int],
    messages: Sequence[Sequence[Sequence[int]]],
    output_len: int,
    concurrency: int,
    transport: Any = None,
    answer_len: int | None = None,
) -> tuple[list[TurnRecord], float]:
    """Every conversation's turns, at most ``concurrency`` conversations at a time;
    returns the turns' records and the seconds from the first request to the last reply.
    ``transport``: httpx's, e.g. a ``MockTransport`` standing in for the server in tests;
    ``answer_len``: as in :func:`next_prompt`."""
    import httpx

    url = f"{base}/v1/completions"
    queue = iter(range(len(messages)))
    records: list[TurnRecord] = []
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency)
    # A read timeout applies between chunks, not to the whole turn, which may be long.
    async with httpx.AsyncClient(timeout=httpx.Timeout(600), limits=limits, transport=transport) as client:

        async def worker() -> None:
            # Each worker takes the next conversation once its current one is done, so
            # the in-flight count stays at ``concurrency`` until the queue runs out.
            for c in queue:
                prompt: list[int] = []
                output: list[int] = []
                for k, message in enumerate(messages[c]):
                    prompt = next_prompt(prompt, output, message, answer_len) if k else first_prompt(prefix, message)
                    record, output = await send_turn(client, url, model, prompt, output_len, c, k + 1)
                    records.append(record)

        start = time.perf_counter()
        tasks = [asyncio.ensure_future(worker()) for _ in range(min(concurrency, len(messages)))]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            # One failed turn fails the point: stop the other conversations before the
            # client closes under them, then raise the turn's own error.
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        duration = time.perf_counter() - start
    return records, duration


def _ms(values: Sequence[float], percentiles: Sequence[int]) -> dict[str, float]:
    import numpy as np

    # As in vLLM's client: the mean and the percentiles of no values are 0.
    return {"mean": float(np.mean(values or 0)) * 1000} | {
        f"p{p}": float(np.percentile(values or 0, p)) * 1000 for p in percentiles
    }


def point_result(records: Sequence[TurnRecord], duration: float, percentiles: Sequence[int]) -> dict[str, Any]:
    """One load point's figures under vLLM's client's result keys (what
    :func:`kvllm.bench.serving.row_of` reads), plus its ``TURN_KEYS``; a completed
    request is a turn."""
    outputs = sum(r.output_len for r in records)
    result: dict[str, Any] = {
        "completed": len(records),
        "duration": duration,
        "output_throughput": outputs / duration,
        "total_token_throughput": (outputs + sum(r.prompt_len for r in records)) / duration,
        "request_throughput": len(records) / duration,
    }
    figures = {
        "ttft": [r.ttft for r in records],
        # vLLM's TPOT: a request's time after its first token over its other tokens.
        "tpot": [(r.latency - r.ttft) / (r.output_len - 1) for r in records if r.output_len > 1],
        "itl": [x for r in records for x in r.itl],
    }
    for figure, values in figures.items():
        for stat, value in _ms(values, percentiles).items():
            result[f"{stat}_{figure}_ms"] = value
    first = [r.ttft for r in records if r.turn == 1]
    later = [r.ttft for r in records if r.turn > 1]
    result["p50_ttft_turn1_ms"] = _ms(first, (50,))["p50"] if first else None
    result["p50_ttft_later_ms"] = _ms(later, (50,))["p50"] if later else None
    return result


def run_point(
    base: str,
    model: str,
    prefix: Sequence[int],
    messages: Sequence[Sequence[Sequence[int]]],
    output_len: int,
    concurrency: int,
    percentiles: Sequence[int],
    save: Path | None = None,
    answer_len: int | None = None,
) -> dict[str, Any]:
    """One load point of :func:`draw`'s conversations against the server at ``base``;
    with ``save``, also writes every turn's record there (``turns.json``, as vLLM's
    client leaves its ``client.json``); ``answer_len``: as in :func:`next_prompt`."""
    records, duration = asyncio.run(
        run_conversations(base, model, prefix, messages, output_len, concurrency, answer_len=answer_len)
    )
    result = point_result(records, duration, percentiles)
    if save is not None:
        save.mkdir(parents=True, exist_ok=True)
        turns = sorted((asdict(r) for r in records), key=lambda r: (r["conversation"], r["turn"]))
        (save / "turns.json").write_text(json.dumps({"result": result, "turns": turns}, indent=1) + "\n")
    return result
