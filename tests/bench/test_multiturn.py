"""`kvllm bench serve --turns`: the conversations' draw, the client's parsing and figures
(against a stand-in server), the validation, and one run against two real servers."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import numpy as np
import pytest
from typer.testing import CliRunner

from kvllm.bench.multiturn import (
    TurnRecord,
    draw,
    first_prompt,
    next_prompt,
    point_result,
    prompt_ids,
    run_conversations,
    tokenizer_ids,
)
from kvllm.bench.serving import PERCENTILES, ServeBench, row_of
from kvllm.bench.serving_report import markdown_table, summarize
from kvllm.cli import app
from kvllm.testing import save_tiny_model, train_tokenizer


def test_turn_one_shares_the_prefix_and_each_turn_extends_the_last() -> None:
    ids = prompt_ids(60, special_ids=[0, 1, 59])
    prefix, messages = draw(seed=3, conversations=4, turns=3, prefix_len=20, input_len=7, ids=ids)
    assert len(prefix) == 20 and len(messages) == 4
    assert all(len(turns) == 3 and all(len(m) == 7 for m in turns) for turns in messages)
    firsts = [first_prompt(prefix, turns[0]) for turns in messages]
    assert all(p[:20] == prefix and p[20:] == turns[0] for p, turns in zip(firsts, messages, strict=True))
    assert len({tuple(p[20:]) for p in firsts}) == 4  # each conversation's own message
    # Turn k+1 is turn k's prompt, then its output, then the next message.
    output = [5, 6, 7, 8]
    second = next_prompt(firsts[0], output, messages[0][1])
    assert second == [*firsts[0], *output, *messages[0][1]]
    drawn = prefix + [t for turns in messages for m in turns for t in m]
    assert not {0, 1, 59} & set(drawn) and set(drawn) <= set(range(60))
    # The same seed draws the same ids; more conversations leave the first ones as they were.
    assert draw(3, 4, 3, 20, 7, ids) == (prefix, messages)
    more = draw(3, 6, 3, 20, 7, ids)
    assert more[0] == prefix and more[1][:4] == messages
    assert draw(4, 4, 3, 20, 7, ids) != (prefix, messages)


def test_prompt_ids_leave_out_the_tokenizers_special_ids(tmp_path: Path) -> None:
    assert prompt_ids(10, [3, 9]) == [0, 1, 2, 4, 5, 6, 7, 8]
    tokenizer = train_tokenizer()
    tokenizer.save_pretrained(tmp_path)
    ids = tokenizer_ids(str(tmp_path))
    special = {tokenizer.convert_tokens_to_ids(t) for t in ("<pad>", "<eos>", "<think>", "</think>")}
    assert not special & set(ids) and len(ids) == tokenizer.vocab_size - len(special)


def stand_in_server(output_len: int, sent: list[list[int]], short: bool = False) -> httpx.MockTransport:
    """A /v1/completions that streams as vLLM's does with ``return_token_ids``: each
    choice's ``token_ids`` holds that chunk's new ids, the prompt's ride on the first
    chunk, and a last chunk without choices carries the usage."""

    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        assert body["return_token_ids"] and body["stream"] and body["ignore_eos"]
        assert body["max_tokens"] == output_len and body["stream_options"] == {"include_usage": True}
        prompt = body["prompt"]
        sent.append(prompt)
        out = [(len(prompt) + i) % 50 + 2 for i in range(output_len - short)]
        chunks = [{"choices": [{"index": 0, "text": "x", "prompt_token_ids": prompt, "token_ids": out[:2]}]}]
        chunks += [{"choices": [{"index": 0, "text": "x", "token_ids": [t]}]} for t in out[2:]]
        chunks.append({"choices": [], "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(out)}})
        text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, content=text.encode(), headers={"content-type": "text/event-stream"})

    return httpx.MockTransport(handle)


def test_each_turn_resends_the_last_prompt_and_the_answers_token_ids() -> None:
    prefix, messages = draw(seed=0, conversations=3, turns=3, prefix_len=8, input_len=5, ids=prompt_ids(50, [0, 1]))
    sent: list[list[int]] = []
    server = stand_in_server(6, sent)
    records, duration = asyncio.run(run_conversations("http://x", "m", prefix, messages, 6, 2, transport=server))
    assert duration > 0 and len(records) == len(sent) == 9
    assert sorted((r.conversation, r.turn) for r in records) == [(c, k) for c in range(3) for k in (1, 2, 3)]
    for c in range(3):
        mine = [p for p in sent if p[8:13] == messages[c][0]]  # a conversation's prompts, in order
        assert [len(p) for p in mine] == [13, 24, 35]
        assert mine[0] == first_prompt(prefix, messages[c][0])
        for k in (1, 2):
            answer = [(len(mine[k - 1]) + i) % 50 + 2 for i in range(6)]
            assert mine[k] == next_prompt(mine[k - 1], answer, messages[c][k])
    # vLLM's client's timing: the first chunk is the first token (it held two ids), then an
    # ITL per further chunk.
    assert all(r.output_len == 6 and len(r.itl) == 4 and 0 < r.ttft <= r.latency for r in records)


def test_a_stripped_history_resends_only_each_answers_last_tokens() -> None:
    assert next_prompt([1, 2], [3, 4, 5, 6], [7], answer_len=2) == [1, 2, 5, 6, 7]
    assert next_prompt([1, 2], [3, 4, 5, 6], [7], answer_len=4) == [1, 2, 3, 4, 5, 6, 7]
    prefix, messages = draw(seed=0, conversations=2, turns=3, prefix_len=8, input_len=5, ids=prompt_ids(50, [0, 1]))
    sent: list[list[int]] = []
    server = stand_in_server(6, sent)
    asyncio.run(run_conversations("http://x", "m", prefix, messages, 6, 1, transport=server, answer_len=2))
    for c in range(2):
        mine = [p for p in sent if p[8:13] == messages[c][0]]
        assert [len(p) for p in mine] == [13, 20, 27]  # + 2 answer tokens + 5 new ones per turn
        for k in (1, 2):
            answer = [(len(mine[k - 1]) + i) % 50 + 2 for i in range(6)]
            assert mine[k] == [*mine[k - 1], *answer[-2:], *messages[c][k]]


def test_a_short_answer_fails_the_turn_loudly() -> None:
    prefix, messages = draw(seed=0, conversations=1, turns=2, prefix_len=0, input_len=5, ids=prompt_ids(50, []))
    server = stand_in_server(6, [], short=True)
    with pytest.raises(RuntimeError, match="conversation 0 turn 1: 5 output token ids of 6"):
        asyncio.run(run_conversations("http://x", "m", prefix, messages, 6, 1, transport=server))


def test_ttft_is_taken_over_all_turns_and_by_turn() -> None:
    ttfts = {1: (0.1, 0.3), 2: (0.5, 0.7), 3: (0.9, 1.1)}
    records = [
        TurnRecord(c, k, prompt_len=100 * k, output_len=11, ttft=t, latency=t + 1.0, itl=(0.1,) * 10)
        for k, pair in ttfts.items()
        for c, t in enumerate(pair)
    ]
    result = point_result(records, duration=2.0, percentiles=PERCENTILES)
    assert result["completed"] == 6 and result["output_throughput"] == pytest.approx(33.0)
    assert result["total_token_throughput"] == pytest.approx((66 + 1200) / 2)
    assert result["request_throughput"] == pytest.approx(3.0)
    everything = [0.1, 0.3, 0.5, 0.7, 0.9, 1.1]
    assert result["mean_ttft_ms"] == pytest.approx(600)
    for p in (50, 90, 99):
        assert result[f"p{p}_ttft_ms"] == pytest.approx(np.percentile(everything, p) * 1000)
    assert result["p50_ttft_turn1_ms"] == pytest.approx(200)
    assert result["p50_ttft_later_ms"] == pytest.approx(800)  # turns 2 and 3
    # vLLM's TPOT: (latency - TTFT) / (tokens - 1) = 1 s / 10; ITL between chunks.
    assert result["p50_tpot_ms"] == pytest.approx(100) and result["p99_itl_ms"] == pytest.approx(100)
    row = row_of("kara", 0, "concurrency", 2.0, result, {"prefix_hits": 96.04, "rounds": 3.0, "preemptions": 0.0})
    assert row["p50_ttft_later_ms"] == pytest.approx(800) and row["completed"] == 6 and row["prefix_hits"] == 96.0
    # One turn per conversation: no later turns to take a median of.
    assert point_result(records[:2], 1.0, PERCENTILES)["p50_ttft_later_ms"] is None


def test_the_report_compares_the_later_turns_ttft_with_vanillas() -> None:
    def row(system: str, repeat: int, later: float) -> dict:
        base = {"system": system, "repeat": repeat, "load": "concurrency", "value": 4.0, "preemptions": 0}
        figures = {f"p{p}_{f}_ms": 10.0 for f in ("ttft", "tpot", "itl") for p in (50, 90, 99)}
        turns = {"p50_ttft_turn1_ms": 20.0, "p50_ttft_later_ms": later, "prefix_hits": 500.0}
        return {**base, **figures, **turns, "rounds": 0, "output_throughput": 100.0}

    rows = [row("vanilla", 0, 10), row("kara", 0, 30), row("vanilla", 1, 20), row("kara", 1, 20)]
    kara = next(c for c in summarize(rows) if c["system"] == "kara")
    assert kara["p50_ttft_later_ms_ratio"] == [2.0, 1.0, 3.0]
    table = markdown_table(summarize(rows))
    assert "TTFT p50 turn 1 / later ms" in table and "| 20/25 | 500 |" in table


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"turns": 0}, "--turns 0 is invalid: must be >= 1"),
        ({"turns": 2, "rates": (1.0,)}, "--turns 2 runs at fixed concurrency only: drop --rate \\[1.0\\]"),
        # 60 + 3 x (100 + 200) = 960 tokens: 30 blocks of 32, plus one.
        (
            {"turns": 3, "prefix_len": 60, "input_len": 100, "output_len": 200, "pool_blocks": 30},
            "--pool 30 is invalid: one conversation's last turn of --prefix-len 60 \\+ --turns 3 x "
            "\\(--input-len 100 \\+ --output-len 200\\) needs 31 blocks",
        ),
        ({"turns": 1, "answer_len": 8}, "--answer-len 8 is invalid: it needs --turns > 1"),
        ({"turns": 2, "output_len": 100, "answer_len": 101}, "must be in \\[1, 100\\] \\(--output-len\\)"),
        # 60 + 3 x 100 + 2 x 20 + 200 = 600 tokens: 19 blocks of 32, plus one.
        (
            {"turns": 3, "prefix_len": 60, "input_len": 100, "output_len": 200, "answer_len": 20, "pool_blocks": 19},
            "--pool 19 is invalid: .* earlier answers cut to --answer-len 20 needs 20 blocks",
        ),
    ],
)
def test_bad_multi_turn_benchmarks_fail_before_any_server(tmp_path: Path, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ServeBench(model="m", out=tmp_path, **kwargs)


def test_the_limits_hold_a_conversations_last_turn(tmp_path: Path) -> None:
    bench = ServeBench(model="m", out=tmp_path, turns=3, prefix_len=60, input_len=100, output_len=200, pool_blocks=31)
    flags = bench.server_flags()
    assert flags[flags.index("--max-model-len") + 1] == str(60 + 3 * 300 + 64)
    assert bench.points == [("concurrency", 16.0), ("concurrency", 32.0)]


def test_the_cli_passes_turns_through(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["bench", "serve", "--model", str(tmp_path), "--turns", "2", "--rate", "1"])
    assert result.exit_code == 2 and "--turns 2" in result.output


@pytest.mark.slow
def test_multi_turn_against_a_real_server(tmp_path: Path) -> None:
    model = save_tiny_model(tmp_path / "model", seed=1, hidden_size=128, layers=2, heads=4, kv_heads=2, head_dim=32)
    out = tmp_path / "bench"
    args = ["bench", "serve", "--model", str(model), "--concurrency", "2", "--prompts", "2", "--turns", "2"]
    args += ["--input-len", "16", "--output-len", "96", "--pool", "24", "--max-num-seqs", "4", "--repeats", "1"]
    args += ["--window", "32", "--buffer", "8", "--period", "4", "--out", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    rows = {r["system"]: r for r in json.loads((out / "results.json").read_text())}
    assert set(rows) == {"vanilla", "kara"}
    for system, r in rows.items():
        assert r["completed"] == 4 and r["output_throughput"] > 0  # 2 conversations x 2 turns
        assert 0 < r["p50_ttft_ms"] <= r["p99_ttft_ms"] and r["p50_ttft_turn1_ms"] > 0 and r["p50_ttft_later_ms"] > 0
        turns = json.loads((out / "runs" / f"{system}-r0" / "concurrency-2" / "turns.json").read_text())["turns"]
        assert [(t["conversation"], t["turn"], t["output_len"]) for t in turns] == [
            (c, k, 96) for c in range(2) for k in (1, 2)
        ]
        assert [t["prompt_len"] for t in turns] == [16, 128, 16, 128]  # 16 + 96 + 16
    # Vanilla caches the blocks a request generated: turn 2 finds turn 1's 16 + 95
    # computed tokens cached, 3 full blocks of 32 (96 tokens), in each conversation.
    assert rows["vanilla"]["prefix_hits"] >= 2 * 96
    # A compressing request caches only its prompt blocks (its rounds rewrite the
    # generated ones), and turn 1's 16-token prompt fills no block: kara hits less.
    assert rows["kara"]["prefix_hits"] < rows["vanilla"]["prefix_hits"]
    assert rows["vanilla"]["rounds"] == 0 and rows["kara"]["rounds"] > 0
    assert "TTFT p50 turn 1 / later ms" in (out / "summary.md").read_text()
