"""``kvllm bench``: selection timing, the throughput sweep, goodput, the serving benchmark and the soak."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvllm.bench.goodput import DEFAULT_SYSTEMS as GOODPUT_SYSTEMS
from kvllm.cli.options import (
    ALL_SYSTEMS,
    CONCURRENCY,
    METHODS,
    POOLS,
    SERVE_CONCURRENCY,
    SERVERS,
    Buffer,
    D,
    Lazy,
    LazyKeep,
    Model,
    Op,
    Period,
    Retention,
    Shape,
    Window,
    console,
    make_config,
    model_or_shape,
    model_path,
    progress,
    split,
    trained_op,
)


def bench_selection(
    method: Annotated[list[str], typer.Option(help="Methods to time (repeatable or commas).")] = METHODS,
    retention: Retention = D.retention,
    window: Window = D.window,
    buffer: Buffer = D.buffer,
    layers: Annotated[int, typer.Option(help="Model layers.")] = 36,
    heads: Annotated[int, typer.Option(help="Query heads.")] = 32,
    kv_heads: Annotated[int, typer.Option(help="KV heads.")] = 8,
    head_dim: Annotated[int, typer.Option(help="Head dimension.")] = 128,
    batch: Annotated[int, typer.Option(help="Windows selected together.")] = 1,
    repeats: Annotated[int, typer.Option(help="Timed repeats.")] = 5,
    lazy: Lazy = D.lazy,
    lazy_keep: LazyKeep = D.lazy_keep,
    window_read: Annotated[
        bool,
        typer.Option(help="Also time reading the window's keys and values from vLLM's paged CPU cache layout."),
    ] = False,
) -> None:
    """Time one window's selection (scoring + choice) for a model shape."""
    from kvllm.bench.selection import read_table, time_selection, time_window_read, timing_table
    from kvllm.methods import method_class

    methods = split(method)
    if lazy > 1 and method == METHODS:  # by default, the methods lazy retention can run
        methods = [m for m in methods if method_class(m).uniform and (lazy_keep == 0 or method_class(m).has_scores())]
    configs = [
        make_config(method=m, retention=retention, window=window, buffer=buffer, lazy=lazy, lazy_keep=lazy_keep)
        for m in methods
    ]
    shape = {"layers": layers, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim}
    timings = [time_selection(c, **shape, batch=batch, repeats=repeats) for c in configs]
    console.print(timing_table(timings, window, buffer, shape, batch))
    if window_read:
        read = time_window_read(
            layers=layers, kv_heads=kv_heads, head_dim=head_dim, batch=batch, span=window + buffer, repeats=repeats
        )
        console.print(read_table(read, timings))


def bench_throughput(
    model: Model = None,
    shape: Shape = None,
    system: Annotated[
        list[str],
        typer.Option(
            help="Systems (repeatable or commas). kara: Kara as `kvllm serve` runs it (vLLM's admission rule); "
            "kara-projected: with projected admission, as the snapkv-* systems run; vanilla-default: the baseline."
        ),
    ] = ALL_SYSTEMS,
    concurrency: Annotated[list[str], typer.Option(help="Requests in flight (repeatable or commas).")] = CONCURRENCY,
    pool: Annotated[
        list[str],
        typer.Option(help="KV pools: blocks, Nx (room for N whole uncompressed requests) or max (repeatable, commas)."),
    ] = POOLS,
    repeats: Annotated[int, typer.Option(help="Repeats of every cell (systems alternate).")] = 3,
    output_tokens: Annotated[int, typer.Option(help="Tokens generated per request (EOS ignored).")] = 2048,
    output_max: Annotated[
        int | None, typer.Option(help="With it, output lengths are uniform over [--output-tokens, --output-max].")
    ] = None,
    requests: Annotated[int, typer.Option(help="Requests per cell (at least its concurrency).")] = 32,
    retention: Retention = D.retention,
    window: Window = D.window,
    buffer: Buffer = D.buffer,
    period: Period = D.period,
    threshold_budget: Annotated[
        int | None,
        typer.Option(help="SnapKV-threshold: generated slots kept; default: Kara's footprint at the longest output."),
    ] = None,
    threshold_interval: Annotated[int, typer.Option(help="SnapKV-threshold: growth that triggers a round.")] = 64,
    out: Annotated[Path, typer.Option(help="Output folder (reruns resume).")] = Path("bench-throughput"),
) -> None:
    """Output throughput vs concurrency under a small KV pool: vanilla vLLM vs KvLLM."""
    from kvllm.bench.report import summary_rich, write_report
    from kvllm.bench.sweep import Sweep, run_sweep
    from kvllm.bench.throughput import Workload, matched_threshold_budget

    path = model_or_shape(model, shape)
    if threshold_budget is None:
        kara = make_config(retention=retention, window=window, buffer=buffer, period=period)
        threshold_budget = matched_threshold_budget(kara, output_max or output_tokens, threshold_interval)
    compression = make_config(
        window=window, buffer=buffer, period=period, threshold_budget=threshold_budget,
        threshold_interval=threshold_interval,
    )  # fmt: skip
    try:
        sweep = Sweep(
            model=str(path), out=out, systems=tuple(split(system)), concurrency=tuple(split(concurrency, int)),
            pools=tuple(_pool(p) for p in split(pool)), repeats=repeats, retention=retention,
            compression=compression,
            workload=Workload(output_tokens=output_tokens, output_max=output_max, requests=requests),
        )  # fmt: skip
        specs = sweep.specs()
    except ValueError as err:
        raise typer.BadParameter(str(err)) from err
    with progress() as bar:
        job = bar.add_task("bench", total=len(specs) * len(sweep.concurrency))
        rows = run_sweep(sweep, lambda message: bar.update(job, advance=1, description=message))
    lengths = f"{output_tokens}-{output_max}" if output_max else str(output_tokens)
    summary = write_report(rows, out, title=f"{path.name}, {lengths} output tokens/request")
    console.print(summary_rich(summary))
    console.print(f"mean ratio to {summary['baseline']}: {summary['mean_ratio']}")
    if summary["limit"]:
        console.print(f"limit (pool {summary['tight_pool']} over {summary['ceiling_pool']}): {summary['limit']}")
    console.print(f"wrote {out}/results.csv, results.json, summary.json, summary.md and the plots")


def _pool(value: str) -> int | str:
    return int(value) if value.isdigit() else value


def bench_serve(
    model: Model = None,
    shape: Shape = None,
    system: Annotated[list[str], typer.Option(help="Servers: vanilla (vLLM's), kara (kvllm serve).")] = SERVERS,
    concurrency: Annotated[
        list[str], typer.Option(help="Load points: requests in flight (commas).")
    ] = SERVE_CONCURRENCY,
    rate: Annotated[list[str] | None, typer.Option(help="Load points: requests/s, Poisson (commas).")] = None,
    prompts: Annotated[int, typer.Option(help="Requests per load point (with --turns, conversations).")] = 32,
    input_len: Annotated[int, typer.Option(help="Prompt tokens (vLLM's random dataset).")] = 150,
    prefix_len: Annotated[
        int, typer.Option(help="Shared prompt prefix before each prompt's own tokens (a system prompt).")
    ] = 0,
    output_len: Annotated[int, typer.Option(help="Output tokens per request (EOS ignored).")] = 2048,
    turns: Annotated[
        int,
        typer.Option(
            help="Requests per conversation, sent one after another. A turn is one request whose prompt is the "
            "previous turn's prompt and answer plus --input-len new tokens (a chat resending its history); "
            "--concurrency is then conversations in flight, and --rate is not allowed. 1: independent requests "
            "through vLLM's client."
        ),
    ] = 1,
    answer_len: Annotated[
        int | None,
        typer.Option(
            help="With --turns: later turns resend only the last N tokens of each earlier answer, as a chat "
            "template that drops the reasoning (Qwen3's) sends the history. Left out: whole answers."
        ),
    ] = None,
    pool: Annotated[int, typer.Option(help="KV pool of both servers, in blocks.")] = 553,
    max_num_seqs: Annotated[int, typer.Option(help="vLLM's --max-num-seqs for both servers.")] = 64,
    repeats: Annotated[int, typer.Option(help="Server starts per system (systems alternate).")] = 3,
    retention: Retention = D.retention,
    window: Window = D.window,
    buffer: Buffer = D.buffer,
    period: Period = D.period,
    out: Annotated[Path, typer.Option(help="Output folder (reruns resume).")] = Path("bench-serve"),
) -> None:
    """Serving benchmark: vLLM's API server vs kvllm serve, with vLLM's client (TTFT/TPOT/ITL) or chats (--turns)."""
    from kvllm.bench.serving import ServeBench, run_bench
    from kvllm.bench.serving_report import write_report

    path = model_or_shape(model, shape)
    compression = make_config(retention=retention, window=window, buffer=buffer, period=period)
    try:
        bench = ServeBench(
            model=str(path), out=out, systems=tuple(split(system)), concurrency=tuple(split(concurrency, int)),
            rates=tuple(split(rate or [], float)), prompts=prompts, input_len=input_len, prefix_len=prefix_len,
            output_len=output_len, turns=turns, answer_len=answer_len, pool_blocks=pool, max_num_seqs=max_num_seqs,
            repeats=repeats, compression=compression,
        )  # fmt: skip
    except ValueError as err:
        raise typer.BadParameter(str(err)) from err
    with progress() as bar:
        job = bar.add_task("bench serve", total=len(bench.order()) * len(bench.points))
        rows = run_bench(bench, lambda message: bar.update(job, advance=1, description=message))
    shape = f"{output_len} output tokens/request" + (f", {turns} turns/conversation" if turns > 1 else "")
    shape += f", earlier answers resent as their last {answer_len} tokens" if answer_len else ""
    cells = write_report(rows, out, title=f"{path.name}, {shape}, pool {pool} blocks")
    console.print((out / "summary.md").read_text(), markup=False, highlight=False)
    console.print(f"{len(cells)} cells; wrote {out}/results.csv, results.json, summary.json, summary.md, serving.png")


def bench_soak(
    model: Model = None,
    shape: Shape = None,
    system: Annotated[str, typer.Option(help="kara (kvllm serve) or vanilla (vLLM's server: the baseline).")] = "kara",
    requests: Annotated[int, typer.Option(help="Requests sent in all.")] = 10_000,
    concurrency: Annotated[int, typer.Option(help="Client tasks sending back to back.")] = 64,
    output_min: Annotated[int, typer.Option(help="Shortest output (tokens, EOS ignored).")] = 16,
    output_max: Annotated[int, typer.Option(help="Longest output.")] = 256,
    prompt_max: Annotated[int, typer.Option(help="Longest prompt (random token ids, at least 5).")] = 200,
    shared_prefix: Annotated[
        int,
        typer.Option(help="Tokens of the shared prefixes half the prompts start with (one block-aligned; 0: none)."),
    ] = 100,
    chunk: Annotated[
        int, typer.Option(help="max_num_batched_tokens: prompts are prefilled in chunks of at most this many tokens.")
    ] = 96,
    cancel: Annotated[float, typer.Option(help="Share of requests the client cancels part-way.")] = 0.2,
    override: Annotated[float, typer.Option(help="Share with a per-request kvllm override.")] = 0.3,
    bad: Annotated[float, typer.Option(help="Share with an invalid override (each must get HTTP 400).")] = 0.01,
    pool: Annotated[int, typer.Option(help="KV pool in blocks: small enough to preempt.")] = 192,
    warmup: Annotated[float, typer.Option(help="Share of requests after which RSS is the reference.")] = 0.1,
    rss_tolerance: Annotated[float, typer.Option(help="Growth over the reference RSS allowed (0.1 = 10%).")] = 0.1,
    retention: Retention = D.retention,
    window: Annotated[int, typer.Option(help="Compression window W (the soak's default runs many rounds).")] = 64,
    buffer: Annotated[int, typer.Option(help="Protected buffer b.")] = 16,
    period: Annotated[int, typer.Option(help="Compression period P.")] = 8,
    out: Annotated[Path, typer.Option(help="Output folder.")] = Path("bench-soak"),
) -> None:
    """Soak kvllm serve: many mixed, cancelled, overridden requests; then check nothing was lost."""
    from kvllm.bench.soak import Soak, run_soak, write_report

    path = model_or_shape(model, shape)
    try:
        soak = Soak(
            model=str(path), out=out, system=system, requests=requests, concurrency=concurrency, output_min=output_min,
            output_max=output_max, prompt_max=prompt_max, shared_prefix=shared_prefix, chunk=chunk, cancel=cancel,
            override=override, bad=bad, pool_blocks=pool,
            warmup=warmup, rss_tolerance=rss_tolerance,
            compression=make_config(retention=retention, window=window, buffer=buffer, period=period),
        )  # fmt: skip
    except ValueError as err:
        raise typer.BadParameter(str(err)) from err
    with progress() as bar:
        job = bar.add_task("soak", total=requests)
        report = run_soak(soak, lambda outcome: bar.update(job, advance=1, description=f"soak ({outcome})"))
    write_report(report, out)
    console.print((out / "soak.md").read_text(), markup=False, highlight=False)
    if not report["ok"]:
        raise typer.Exit(1)


def bench_goodput(
    model: Annotated[
        Path | None,
        typer.Option(help="A real-weights model that writes the tasks' chains: a directory or a shipped model's name."),
    ] = Path("kara-reasoner-6l"),
    family: Annotated[str, typer.Option(help="Task family: reason (default) or trace.")] = "reason",
    test_seeds: Annotated[str, typer.Option(help="Held-out task seeds A:B (B excluded).")] = "0:48",
    op: Op = None,
    system: Annotated[
        list[str],
        typer.Option(
            help="Systems (repeatable or commas): vanilla-default, vanilla-unlimited (no memory pressure: the limit), "
            "and compressing systems METHOD, METHOD-threshold, METHOD@R or METHOD@R/W/B (kara@0.5/256/64)."
        ),
    ] = GOODPUT_SYSTEMS,
    pool: Annotated[list[str], typer.Option(help="KV pools: Nx (N whole Full-KV requests) or blocks.")] = ["8x"],  # noqa: B006
    concurrency: Annotated[list[str], typer.Option(help="Requests in flight (max_num_seqs).")] = ["32"],  # noqa: B006
    repeats: Annotated[int, typer.Option(help="Repeats of every cell (systems alternate).")] = 3,
    cap: Annotated[
        int, typer.Option(help="Tokens a request may generate (>= 1.5x the longest reference chain).")
    ] = 3200,
    period: Period = D.period,
    calibration: Annotated[
        Path | None,
        typer.Option(help="The calibration file of kara-retain or qfilter; default: the one the model ships, if any."),
    ] = None,
    out: Annotated[Path, typer.Option(help="Output folder (reruns resume).")] = Path("bench-goodput"),
) -> None:
    """Goodput inside vLLM: graded tasks served to their EOS, accuracy and answers per second."""
    import shlex
    import sys

    from kvllm.assets import calibration_file
    from kvllm.bench.goodput import Goodput, run_goodput
    from kvllm.bench.goodput_report import write_report

    path = model_path(model)
    if calibration is None:  # the shipped file of the one calibrated method asked for, if any
        from kvllm.bench.goodput import _SYSTEM
        from kvllm.methods import available, calibrated

        named = {m["name"] for s in split(system) if (m := _SYSTEM.match(s)) and m["name"] in available()}
        files = [calibration_file(path, name) for name in named if calibrated(name)]
        calibration = next((f for f in files if f is not None), None)
    try:
        a, _, b = test_seeds.partition(":")
        run = Goodput(
            model=str(path), out=out, family=family, seeds=(int(a), int(b)), op=op or trained_op(path),
            systems=tuple(split(system)), pools=tuple(split(pool)), concurrency=tuple(split(concurrency, int)),
            repeats=repeats, cap=cap, compression=make_config(period=period),
            calibration=None if calibration is None else str(calibration),
        )  # fmt: skip
        cells = run.cells()
    except ValueError as err:
        raise typer.BadParameter(str(err)) from err
    with progress() as bar:
        job = bar.add_task("goodput", total=len(cells))
        rows = run_goodput(run, lambda message: bar.update(job, advance=1, description=message))
    command = "kvllm " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    write_report(rows, out, command=command)
    console.print((out / "summary.md").read_text(), markup=False, highlight=False)
    console.print(f"wrote {out}/results.jsonl, summary.json, summary.md, goodput.png and completions/")
