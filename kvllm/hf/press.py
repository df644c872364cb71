"""``model.generate`` with compression: ``with compress(model, config) as press: model.generate(...)``.

kvpress's users write ``with press(model): model.generate(...)``; this is that, for any
registered method and KvLLM's decoding-time policies. Inside the ``with`` block, each
``model.generate`` call gets a fresh :class:`~kvllm.hf.cache.CompressingCache` as its
``past_key_values`` and runs KvLLM's attention (:mod:`kvllm.hf.attention`), so sampling,
stopping criteria, streamers, logits processors and ``GenerationConfig`` are
transformers' own. Around every forward, two hooks do what :func:`kvllm.hf.generate`'s
loop does: announce the forward's tokens (``begin_step``, from the attention mask
``generate`` passes) and book it afterwards (``end_step``, which may run a round).

Positions stay logical: ``generate`` derives ``position_ids`` from the attention mask,
which counts every token a row has seen, while the cache holds fewer slots. A finished
row is fed the pad token by ``generate`` (EOS by :func:`kvllm.hf.generate`); rounds are
batch-wide either way, so the rows still running get the same tokens.

Not supported, refused before anything runs: beam search and group beam search (they
reorder the cache's rows), assisted and prompt-lookup decoding (they crop it), a
``past_key_values`` of the caller's, and ``use_cache=False``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedModel

from kvllm.config import CompressionConfig
from kvllm.generation import SeqStats
from kvllm.hf import attention
from kvllm.hf.cache import CompressingCache

# generate() arguments that would reorder or crop the cache, with what to say of each.
UNSUPPORTED = {
    "num_beams": "beam search reorders the cache's rows",
    "assistant_model": "assisted decoding crops the cache",
    "prompt_lookup_num_tokens": "prompt-lookup decoding crops the cache",
}


@dataclass
class Press:
    """What a ``compress`` block leaves behind: the last ``generate`` call's cache and statistics."""

    config: CompressionConfig | None
    cache: CompressingCache | None = None

    @property
    def stats(self) -> list[SeqStats]:
        """Per row, at the end of the last ``generate`` call: logical/physical length, rounds,
        seconds. A row that stopped early is still fed (pad tokens) until the batch ends,
        and counts those steps, where :func:`kvllm.hf.generate` stops its count."""
        if self.cache is None:
            raise RuntimeError("no model.generate call has run inside this compress() block yet")
        return self.cache.stats()


@contextmanager
def compress(model: PreTrainedModel, config: CompressionConfig | None) -> Iterator[Press]:
    """Make ``model.generate`` compress with ``config`` inside the block (``None``: never).

    Raises ``ValueError`` from ``generate`` for the unsupported features (module doc).
    """
    press = Press(config)
    original = model.generate
    hooks = []
    current: dict[str, CompressingCache] = {}

    def before(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        cache = current.get("cache")
        if cache is None or kwargs.get("past_key_values") is not cache:
            return args, kwargs  # a forward of someone else's, inside the block
        ids = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else args[0]
        mask = kwargs.get("attention_mask")
        q = ids.shape[1]
        cache.begin_step(mask[:, -q:] if mask is not None else torch.ones_like(ids))
        return args, {**kwargs, "kvllm_cache": cache}

    def after(module: Any, args: tuple, kwargs: dict, output: Any) -> Any:
        cache = current.get("cache")
        if cache is not None and kwargs.get("past_key_values") is cache:
            cache.end_step()
        return output

    def generate(*args: Any, **kwargs: Any) -> Any:
        _refuse_unsupported(model, kwargs)
        ids = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else (args[0] if args else None)
        if ids is None:
            raise ValueError("compress(): model.generate needs input_ids (inputs_embeds alone are not supported)")
        mask = kwargs.get("attention_mask")
        if mask is None:
            mask = torch.ones_like(ids)
        cache = CompressingCache.for_batch(model.config, config, ids, mask)
        current["cache"] = press.cache = cache
        # Our attention reads the cache's slot validity instead of transformers' mask.
        previous = model.config._attn_implementation
        model.set_attn_implementation(attention.NAME)
        try:
            return original(*args, **{**kwargs, "past_key_values": cache})
        finally:
            model.set_attn_implementation(previous)
            current.pop("cache", None)

    hooks.append(model.register_forward_pre_hook(before, with_kwargs=True))
    hooks.append(model.register_forward_hook(after, with_kwargs=True))
    model.generate = generate  # type: ignore[method-assign]
    try:
        yield press
    finally:
        del model.generate  # the class's own again
        for hook in hooks:
            hook.remove()


def _refuse_unsupported(model: PreTrainedModel, kwargs: dict[str, Any]) -> None:
    """Raise ``ValueError`` naming a ``generate`` feature the compressing cache cannot serve."""
    base = kwargs.get("generation_config") or model.generation_config or GenerationConfig()
    if kwargs.get("past_key_values") is not None:
        raise ValueError("compress(): model.generate(past_key_values=...) is invalid: compress() supplies the cache")
    if kwargs.get("use_cache", base.use_cache) is False:
        raise ValueError("compress(): model.generate(use_cache=False) is invalid: compression needs the cache")
    for name, why in UNSUPPORTED.items():
        value = kwargs.get(name, getattr(base, name, None))
        if name == "num_beams" and (value or 1) > 1:
            raise ValueError(f"compress(): num_beams={value} is not supported: {why}; use num_beams=1")
        if name != "num_beams" and value is not None:
            raise ValueError(f"compress(): {name} is not supported: {why}")
