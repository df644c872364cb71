"""``kvllm bench soak``: thousands of mixed, cancelled and overridden requests through
``kvllm serve`` under a pool small enough to preempt, then checks that nothing was lost.

One server runs the whole soak. A fixed number of client tasks (``concurrency``) send
requests one after another: random token-id prompts, random output lengths (EOS
ignored), streaming or not, some with a per-request ``"kvllm"`` override, some with
compression off, a few with an invalid override (which must get HTTP 400), and some
cancelled by the client part-way (a stream closed after a random number of chunks, or a
non-streaming request whose task is cancelled after a random delay). Half the prompts
start with a shared prefix: one of any length, or one a whole number of blocks long, and
some prompts are exactly that block-aligned prefix. Prompts are prefilled in small
chunks, so a chunk can end anywhere in a shared, cached prefix, one token short of it
included. Every request is drawn from one seeded stream, so a soak is
reproducible up to timing.

At the end it checks (:func:`checks`):

- **no request lost**: each one finished with exactly its ``max_tokens`` (and, when it
  compressed, its statistics), was cancelled by the client, or was an invalid override
  answered with 400; nothing else (no 5xx, no dropped connection, no short output);
- **every block back**: once idle, ``kvllm:kv_blocks_used``, vLLM's
  ``kv_cache_usage_perc`` and its running and waiting request gauges are 0;
- **memory flat**: the RSS of the API process and of each engine process, sampled as
  requests complete, stays within ``rss_tolerance`` of its value at the end of warm-up;
- **off equals vanilla**: every finished request with compression off wrote what vLLM's
  own server writes for it (the same prompt, greedy), replayed after the soak: shared
  prefixes and rounds beside it must not change what it reads;
- **no round refused**: KvLLM's server runs with ``KVLLM_STRICT=1``, so a round that
  would rewrite a shared or cached block, or that fails, raises in the engine (which the
  checks above then see), and ``kvllm:rounds_refused_total`` must stay 0.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from kvllm.bench.common import counters, free_port, sse_lines
from kvllm.config import CompressionConfig

OFF: dict[str, Any] = {"off": True}
# Per-request overrides the soak draws from (each valid for a uniform paged engine), and
# one the server must refuse.
OVERRIDES: tuple[dict[str, Any], ...] = (
    {"retention": 0.1},
    {"retention": 0.5},
    {"method": "snapkv", "retention": 0.2},
    {"method": "h2o"},
    {"method": "streamingllm", "retention": 0.3},
    OFF,
)
BAD_OVERRIDE: dict[str, Any] = {"retention": 0}
OUTCOMES = ("finished", "cancelled", "rejected", "failed")
# kvllm serve, or vLLM's own API server without the plugin (the same soak, as the
# baseline of the memory check).
SYSTEMS = ("kara", "vanilla")


@dataclass(frozen=True)
class Soak:
    """One soak.

    Attributes
    ----------
    requests
        Requests sent in all.
    concurrency
        Client tasks sending back to back (requests in flight, at most).
    output_min, output_max
        Output lengths, uniform (EOS ignored).
    prompt_min, prompt_max
        Prompt lengths in tokens, uniform (random ids; at least 5, see the server's guard).
    shared_prefix
        Tokens of the random prefixes half the prompts start with (a shared system
        prompt, which prefix caching serves): one of this length and one of it rounded
        up to whole blocks, which some prompts are exactly; 0: none.
    chunk
        vLLM's ``max_num_batched_tokens``: prompts longer than this are prefilled in
        chunks (chunked prefill); small, so that chunks end anywhere.
    cancel
        Share of requests the client cancels part-way.
    override, bad
        Shares with a valid per-request override, and with an invalid one.
    stream
        Share of requests that stream.
    system
        ``kara`` (``kvllm serve``) or ``vanilla`` (vLLM's server, no statistics).
    pool_blocks
        The server's KV pool (``--num-gpu-blocks-override``): small enough to preempt.
    warmup
        Share of requests after which RSS is taken as the reference.
    rss_tolerance
        How far above the reference an RSS sample may go.
    """

    model: str
    out: Path
    requests: int = 10_000
    concurrency: int = 64
    output_min: int = 16
    output_max: int = 256
    prompt_min: int = 5
    prompt_max: int = 200
    shared_prefix: int = 100
    chunk: int = 96
    cancel: float = 0.2
    override: float = 0.3
    bad: float = 0.01
    stream: float = 0.7
    pool_blocks: int = 192
    max_num_seqs: int = 64
    warmup: float = 0.1
    rss_tolerance: float = 0.10
    compression: CompressionConfig = field(default_factory=lambda: CompressionConfig(window=64, buffer=16, period=8))
    system: str = "kara"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.system not in SYSTEMS:
            raise ValueError(f"--system {self.system!r} is invalid: must be one of {', '.join(SYSTEMS)}")
        if self.system == "vanilla" and (self.override or self.bad):
            raise ValueError("--system vanilla needs --override 0 --bad 0: vLLM's own server has no kvllm field")
        if self.requests < 1 or self.concurrency < 1:
            raise ValueError(f"--requests {self.requests} / --concurrency {self.concurrency} is invalid: must be >= 1")
        if not 5 <= self.prompt_min <= self.prompt_max:
            raise ValueError(f"--prompt-min {self.prompt_min} / --prompt-max {self.prompt_max}: need 5 <= min <= max")
        if not 1 <= self.output_min <= self.output_max:
            raise ValueError(f"--output-min {self.output_min} / --output-max {self.output_max}: need 1 <= min <= max")
        for name in ("cancel", "override", "bad", "stream", "warmup", "rss_tolerance"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)} is invalid: must be in [0, 1]")
        if self.override + self.bad > 1:
            raise ValueError(f"--override {self.override} + --bad {self.bad} is invalid: must be <= 1")
        if self.shared_prefix < 0:
            raise ValueError(f"--shared-prefix {self.shared_prefix} is invalid: must be >= 0")
        if self.chunk < self.max_num_seqs:
            raise ValueError(f"--chunk {self.chunk} is invalid: vLLM needs >= max_num_seqs ({self.max_num_seqs})")
        need = -(-(self.aligned_prefix + self.prompt_max + self.output_max) // self.compression.block_size) + 1
        if self.pool_blocks < need:
            raise ValueError(f"--pool {self.pool_blocks} is invalid: the longest request needs {need} blocks")

    @property
    def aligned_prefix(self) -> int:
        """The block-aligned shared prefix's length."""
        block = self.compression.block_size
        return -(-self.shared_prefix // block) * block

    @property
    def max_model_len(self) -> int:
        return self.aligned_prefix + self.prompt_max + self.output_max + 16

    def server_flags(self) -> list[str]:
        c = self.compression
        flags = [
            "--dtype", "float32", "--block-size", str(c.block_size), "--num-gpu-blocks-override",
            str(self.pool_blocks), "--max-num-seqs", str(self.max_num_seqs), "--max-model-len",
            str(self.max_model_len), "--enforce-eager", "--gpu-memory-utilization", "0.3", "--seed", str(self.seed),
            "--enable-chunked-prefill", "--max-num-batched-tokens", str(self.chunk),
        ]  # fmt: skip
        if self.system == "vanilla":
            return flags
        return [
            *flags, "--kv-compression", c.method, "--kv-retention", str(c.retention), "--kv-window", str(c.window),
            "--kv-buffer", str(c.buffer), "--kv-period", str(c.period),
        ]  # fmt: skip


@dataclass(frozen=True)
class Request:
    """One drawn request: what is sent, and when the client gives up on it."""

    index: int
    prompt: list[int]
    max_tokens: int
    stream: bool
    override: dict[str, Any] | None
    bad: bool
    cancel_after: int | None  # streamed chunks (streaming) or milliseconds (non-streaming)
    stats: bool = True  # its response must carry kvllm's statistics


def draw(soak: Soak, vocab: int) -> list[Request]:
    """Every request of the soak, from one seeded stream."""
    rng = random.Random(soak.seed)
    shared = [rng.randrange(vocab) for _ in range(soak.shared_prefix)]
    aligned = [rng.randrange(vocab) for _ in range(soak.aligned_prefix)]
    out = []
    for i in range(soak.requests):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(soak.prompt_min, soak.prompt_max))]
        if shared and rng.random() < 0.5:
            u = rng.random()
            prompt = shared + prompt if u < 0.5 else aligned + prompt if u < 0.85 else aligned
        max_tokens = rng.randint(soak.output_min, soak.output_max)
        stream = rng.random() < soak.stream
        u = rng.random()
        bad = u < soak.bad
        override = BAD_OVERRIDE if bad else rng.choice(OVERRIDES) if u < soak.bad + soak.override else None
        cancel_after = None
        if not bad and rng.random() < soak.cancel:
            # A stream is closed after some of its chunks; a non-streaming request after
            # a delay that may or may not outlast it (both happen to real clients).
            cancel_after = rng.randint(1, max_tokens) if stream else rng.randint(10, 2000)
        out.append(Request(i, prompt, max_tokens, stream, override, bad, cancel_after, soak.system == "kara"))
    return out


def body(model: str, request: Request) -> dict[str, Any]:
    data: dict[str, Any] = {
        "model": model, "prompt": request.prompt, "max_tokens": request.max_tokens, "ignore_eos": True,
        "temperature": 0.0, "stream": request.stream,
    }  # fmt: skip
    if request.stream:
        data["stream_options"] = {"include_usage": True}
    if request.override is not None:
        data["kvllm"] = request.override
    return data


async def send(client: Any, base: str, model: str, request: Request) -> dict[str, Any]:
    """One request's outcome: ``finished`` / ``cancelled`` / ``rejected`` / ``failed``, and why."""
    url = f"{base}/v1/completions"
    try:
        if request.stream:
            return await _stream(client, url, model, request)
        job = asyncio.ensure_future(client.post(url, json=body(model, request)))
        if request.cancel_after is not None:
            done, _ = await asyncio.wait({job}, timeout=request.cancel_after / 1000)
            if not done:
                job.cancel()
                return {"outcome": "cancelled"}
        response = await job
        return _judge(request, response.status_code, response.json())
    except Exception as err:  # a client-side error (a dropped connection, bad JSON) is a finding, not a crash
        return {"outcome": "failed", "why": f"{type(err).__name__}: {err}"}


async def _stream(client: Any, url: str, model: str, request: Request) -> dict[str, Any]:
    async with client.stream("POST", url, json=body(model, request)) as response:
        if response.status_code != 200:
            return _judge(request, response.status_code, json.loads(await response.aread()))
        chunks, finish, usage, stats, text = 0, None, None, None, []
        async for line in sse_lines(response.aiter_bytes()):
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            chunks += 1
            for choice in chunk.get("choices") or []:
                finish = choice.get("finish_reason") or finish
                text.append(choice.get("text") or "")
            usage = chunk.get("usage") or usage
            stats = (chunk.get("kv_transfer_params") or {}).get("kvllm", stats)
            if request.cancel_after is not None and chunks >= request.cancel_after:
                return {"outcome": "cancelled"}  # leaving the block closes the connection
    tokens = (usage or {}).get("completion_tokens")
    return _judge(request, 200, {"choices": [{"finish_reason": finish, "text": "".join(text)}],
                                 "usage": {"completion_tokens": tokens},
                                 "kv_transfer_params": {"kvllm": stats} if stats is not None else None})  # fmt: skip


def _judge(request: Request, status: int, data: dict[str, Any]) -> dict[str, Any]:
    if request.bad:
        ok = status == 400 and "retention" in json.dumps(data)
        return {"outcome": "rejected" if ok else "failed", "why": None if ok else f"bad override got {status}"}
    if status != 200:
        return {"outcome": "failed", "why": f"HTTP {status}: {json.dumps(data)[:200]}"}
    tokens = (data.get("usage") or {}).get("completion_tokens")
    finish = (data.get("choices") or [{}])[0].get("finish_reason")
    if tokens != request.max_tokens or finish != "length":
        return {"outcome": "failed", "why": f"{tokens} of {request.max_tokens} tokens, finish {finish!r}"}
    stats = (data.get("kv_transfer_params") or {}).get("kvllm")
    if stats is None and request.stats:
        return {"outcome": "failed", "why": "no statistics"}
    stats = stats or {}
    outcome = {"outcome": "finished", "rounds": stats.get("compressions", 0), "off": stats.get("method") is None}
    if request.override == OFF:  # kept to compare with vLLM's own server (off_equals_vanilla)
        outcome["text"] = (data.get("choices") or [{}])[0].get("text")
    return outcome


# The idle checks' metrics: vLLM's gauges and counters, and KvLLM's.
GAUGES = {
    name.split(":")[1]: name
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:num_preemptions_total", "kvllm:kv_blocks_used", "kvllm:compression_rounds_total",
                 "kvllm:blocks_freed_total", "kvllm:rounds_refused_total")
}  # fmt: skip


def rss(pid: int) -> dict[str, float]:
    """MiB resident, for the server process and each of its descendants, keyed by name and pid."""
    import psutil

    root = psutil.Process(pid)
    out = {}
    for p in [root, *root.children(recursive=True)]:
        try:
            out[f"{p.name()}-{p.pid}"] = p.memory_info().rss / 2**20
        except psutil.NoSuchProcess:
            continue
    return out


async def drive(soak: Soak, base: str, requests: list[Request], pid: int, tick: Callable[[str], None]) -> dict:
    """Send every request; sample RSS as they complete. Returns outcomes and samples."""
    import httpx

    queue = iter(requests)
    outcomes: list[dict[str, Any]] = [{} for _ in requests]
    samples: list[dict[str, Any]] = []
    every = max(1, soak.requests // 100)
    done = 0
    limits = httpx.Limits(max_connections=soak.concurrency + 4, max_keepalive_connections=soak.concurrency)

    async with httpx.AsyncClient(timeout=httpx.Timeout(600), limits=limits) as client:

        async def worker() -> None:
            nonlocal done
            for request in queue:
                outcomes[request.index] = {"index": request.index, **await send(client, base, soak.model, request)}
                done += 1
                if done % every == 0:
                    samples.append({"done": done, "time": time.monotonic(), **rss(pid)})
                tick(outcomes[request.index]["outcome"])

        await asyncio.gather(*(worker() for _ in range(soak.concurrency)))
    return {"outcomes": outcomes, "samples": samples}


def wait_idle(base: str, timeout: float = 60) -> dict[str, float]:
    """Gauges once nothing runs or waits (after ``timeout`` s, whatever they are)."""
    start = time.monotonic()
    while True:
        now = counters(base, GAUGES)
        idle = now["num_requests_running"] == 0 and now["num_requests_waiting"] == 0 and now["kv_blocks_used"] == 0
        if idle or time.monotonic() - start > timeout:
            return now
        time.sleep(0.5)


def checks(soak: Soak, outcomes: list[dict[str, Any]], idle: dict[str, float], samples: list[dict]) -> dict:
    """The soak's verdicts, each with the figures behind it."""
    counts = Counter(o.get("outcome", "lost") for o in outcomes)
    lost = soak.requests - sum(counts[k] for k in ("finished", "cancelled", "rejected"))
    blocks = {k: idle[k] for k in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                                   "kv_blocks_used")}  # fmt: skip
    reference_at = max(1, int(soak.requests * soak.warmup))
    after = [s for s in samples if s["done"] >= reference_at]
    growth = {}
    if after:
        for name in [k for k in after[0] if k not in ("done", "time")]:
            series = [s[name] for s in after if name in s]
            growth[name] = round(max(series) / series[0] - 1, 4)
    refused = {"no_round_refused": {"ok": idle["rounds_refused_total"] == 0}} if soak.system != "vanilla" else {}
    return {
        **refused,
        "no_request_lost": {"ok": lost == 0, "lost": lost, "counts": dict(counts)},
        "every_block_back": {"ok": all(v == 0 for v in blocks.values()), **blocks},
        "rss_flat": {"ok": bool(growth) and all(g <= soak.rss_tolerance for g in growth.values()),
                     "growth_after_warmup": growth, "reference_at": reference_at},
    }  # fmt: skip


def replay_off(soak: Soak, requests: list[Request], outcomes: list[dict[str, Any]], log: Path) -> dict[str, Any]:
    """Send the finished compression-off requests to vLLM's own server (no plugin, the same
    engine flags) and compare what it writes with what they got in the soak."""
    import httpx

    from kvllm.vllm.launch import start_server, stop, wait_healthy

    off = [(requests[o["index"]], o["text"]) for o in outcomes if o.get("outcome") == "finished" and "text" in o]
    if not off:
        return {"ok": False, "compared": 0, "mismatched": [], "why": "no compression-off request finished"}
    vanilla = replace(soak, system="vanilla", override=0.0, bad=0.0)
    env = {**os.environ, "VLLM_PLUGINS": "no-plugin"}  # a name matching no plugin
    process, base = start_server(soak.model, free_port(), vanilla.server_flags(), log=log, env=env, vllm=True)
    try:
        wait_healthy(process, base, timeout=600)

        async def compare() -> list[int]:
            limit = asyncio.Semaphore(soak.concurrency)
            async with httpx.AsyncClient(timeout=httpx.Timeout(600)) as client:

                async def one(request: Request, text: str) -> int | None:
                    plain = Request(request.index, request.prompt, request.max_tokens, False, None, False, None)
                    async with limit:
                        response = await client.post(f"{base}/v1/completions", json=body(soak.model, plain))
                    return None if response.json()["choices"][0]["text"] == text else request.index

                found = await asyncio.gather(*(one(r, t) for r, t in off))
            return [i for i in found if i is not None]

        mismatched = asyncio.run(compare())
    finally:
        stop(process)
    return {"ok": not mismatched, "compared": len(off), "mismatched": mismatched[:20]}


def run_soak(soak: Soak, tick: Callable[[str], None]) -> dict[str, Any]:
    """Start ``kvllm serve``, run the soak, check it, stop the server; writes ``soak.json``."""
    from transformers import AutoConfig

    from kvllm.vllm.launch import start_server, stop, wait_healthy
    from kvllm.vllm.scheduler import STRICT_ENV

    soak.out.mkdir(parents=True, exist_ok=True)
    vocab = AutoConfig.from_pretrained(soak.model).vocab_size
    requests = draw(soak, vocab)
    log = soak.out / "server.log"
    vanilla = soak.system == "vanilla"
    # KvLLM's server runs strict: a round that would rewrite a shared or cached block, or
    # that fails, raises in the engine instead of being refused, so it cannot pass unseen.
    env = {**os.environ, **({"VLLM_PLUGINS": "no-plugin"} if vanilla else {STRICT_ENV: "1"})}
    process, base = start_server(soak.model, free_port(), soak.server_flags(), log=log, env=env, vllm=vanilla)
    try:
        try:
            wait_healthy(process, base, timeout=600)
        except (RuntimeError, TimeoutError) as err:
            raise RuntimeError(f"server: {err}:\n{log.read_text()[-3000:]}") from err
        start = time.monotonic()
        result = asyncio.run(drive(soak, base, requests, process.pid, tick))
        seconds = time.monotonic() - start
        idle = wait_idle(base)
        alive = process.poll() is None
    finally:
        stop(process)
    verdicts = checks(soak, result["outcomes"], idle, result["samples"])
    verdicts["server_alive"] = {"ok": alive}
    if not vanilla and soak.override:
        verdicts["off_equals_vanilla"] = replay_off(soak, requests, result["outcomes"], soak.out / "vanilla.log")
    failed = [o for o in result["outcomes"] if o.get("outcome") != "finished" and o.get("why")]
    finished = [o for o in result["outcomes"] if o.get("outcome") == "finished"]
    report = {
        # The model by its folder's name: a stored report names no path of the machine it ran on.
        "soak": {
            **{k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(soak).items()},
            "model": Path(soak.model).name,
        },
        "seconds": round(seconds, 1),
        "ok": all(v["ok"] for v in verdicts.values()),
        "checks": verdicts,
        "idle_metrics": idle,
        "finished_compressed": sum(1 for o in finished if o["rounds"] > 0),
        "finished_off": sum(1 for o in finished if o["off"]),
        "failures": failed[:20],
        "rss_samples": result["samples"],
    }
    (soak.out / "soak.json").write_text(json.dumps(report, indent=1))
    return report


def write_report(report: dict[str, Any], out: Path) -> None:
    """``soak.md`` (the verdicts and their figures) and ``rss.png`` (RSS over requests done)."""
    import matplotlib.pyplot as plt

    from kvllm.plots import save_figure

    c = report["checks"]
    counts = c["no_request_lost"]["counts"]
    idle = report["idle_metrics"]
    lines = [
        f"# Soak: {report['soak']['requests']} requests, {report['seconds']:.0f} s, "
        f"{'all checks passed' if report['ok'] else 'FAILED'}",
        "",
        "| check | ok | figures |",
        "| --- | --- | --- |",
        f"| no request lost | {c['no_request_lost']['ok']} | lost {c['no_request_lost']['lost']}; "
        + ", ".join(f"{k} {counts.get(k, 0)}" for k in OUTCOMES)
        + " |",
        f"| every block back | {c['every_block_back']['ok']} | "
        + ", ".join(f"{k} {v:g}" for k, v in c["every_block_back"].items() if k != "ok")
        + " |",
        f"| RSS flat (<= {report['soak']['rss_tolerance']:.0%} over warm-up) | {c['rss_flat']['ok']} | "
        + ", ".join(f"{k} {v:+.1%}" for k, v in c["rss_flat"]["growth_after_warmup"].items())
        + " |",
        f"| server alive | {c['server_alive']['ok']} | |",
        *(
            [f"| no round refused (strict) | {c['no_round_refused']['ok']} | {idle['rounds_refused_total']:g} |"]
            if "no_round_refused" in c
            else []
        ),
        *(
            [
                f"| off requests equal vLLM's own | {c['off_equals_vanilla']['ok']} | "
                f"{c['off_equals_vanilla']['compared']} compared, mismatched {c['off_equals_vanilla']['mismatched']} |"
            ]
            if "off_equals_vanilla" in c
            else []
        ),
        "",
        f"Finished requests that compressed: {report['finished_compressed']}; with compression off: "
        f"{report['finished_off']}. Over the soak: {idle['num_preemptions_total']:g} preemptions, "
        f"{idle['compression_rounds_total']:g} compression rounds, {idle['blocks_freed_total']:g} blocks freed.",
    ]
    if report["failures"]:
        lines += ["", "First failures:", ""] + [f"- request {f['index']}: {f['outcome']}, {f['why']}"
                                                 for f in report["failures"]]  # fmt: skip
    (out / "soak.md").write_text("\n".join(lines) + "\n")
    samples = report["rss_samples"]
    if samples:
        fig, ax = plt.subplots(figsize=(7, 3.5))
        for name in sorted({k for s in samples for k in s} - {"done", "time"}):
            points = [(s["done"], s[name]) for s in samples if name in s]
            ax.plot(*zip(*points, strict=True), label=name)
        ax.axvline(c["rss_flat"]["reference_at"], color="grey", linestyle=":", label="end of warm-up")
        ax.set_xlabel("requests done")
        ax.set_ylabel("RSS (MiB)")
        ax.legend(fontsize=7)
        save_figure(fig, out / "rss.png", title="Soak: resident memory per process")
