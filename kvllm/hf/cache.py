"""A transformers ``Cache`` that compresses generated tokens as it decodes.

Each layer keeps physical K/V ``[B, Hkv, N, D]``, a validity mask ``[B, Hkv, N]``
(left padding, and the slots a variable-budget method drops by masking) and a ring of
the last W + b + P post-RoPE queries, filled by :mod:`kvllm.hf.attention`. After every
decode step :meth:`CompressingCache.end_step` asks the policy for a region, the method for
kept indices, and compacts every layer.

Rows of a batch are left-padded to one prompt length, so their tails grow together and
they are compressed at the same steps over the same slot range: one
:class:`~kvllm.policy.SeqState` in padded coordinates serves the whole batch.
"""

from __future__ import annotations

import dataclasses
import time

import torch
from torch import Tensor
from transformers import PretrainedConfig
from transformers.cache_utils import Cache, DynamicLayer
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from kvllm.config import CompressionConfig
from kvllm.generation import SeqStats
from kvllm.hf.compaction import compact
from kvllm.methods import Method, Selection, Window, build, stream_seed
from kvllm.methods.lazy import lazy_select
from kvllm.methods.rope import Rope
from kvllm.policy import Region, SeqState, build_policy


class CompressedLayer(DynamicLayer):
    """One layer's K/V plus what compression needs: slot validity and recent queries."""

    def __init__(self, ring: int) -> None:
        super().__init__()
        self.ring = ring
        self.valid: Tensor | None = None
        self.queries: Tensor | None = None
        self.incoming_valid: Tensor | None = None
        self.seen = 0

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        new = self.incoming_valid.unsqueeze(1).expand(-1, key_states.shape[1], -1)
        self.valid = new if self.valid is None else torch.cat([self.valid, new], dim=2)
        return keys, values

    def capture(self, query: Tensor) -> None:
        """Remember the post-RoPE queries ``[B, Hq, q, D]`` of this forward's tokens."""
        if self.queries is None:
            b, hq, _, d = query.shape
            self.queries = query.new_zeros(b, hq, self.ring, d)
        q_len = query.shape[2]
        keep = min(q_len, self.ring)
        slots = torch.arange(self.seen + q_len - keep, self.seen + q_len, device=query.device) % self.ring
        self.queries[:, :, slots] = query[:, :, q_len - keep :]
        self.seen += q_len

    def attention_bias(self, q_len: int, dtype: torch.dtype) -> Tensor:
        """Additive mask ``[B, Hkv, q_len, N]``: 0 where a query may attend, else the
        dtype's minimum (as transformers' eager mask, so that a row with no valid key
        stays finite). The ``q_len`` queries are the last slots (causal among them)."""
        n = self.valid.shape[-1]
        allowed = self.valid.unsqueeze(2)
        if q_len > 1:
            q_pos = torch.arange(n - q_len, n, device=allowed.device).unsqueeze(1)
            allowed = allowed & (torch.arange(n, device=allowed.device).unsqueeze(0) <= q_pos)
        bias = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
        bias.masked_fill_(~allowed, torch.finfo(dtype).min)
        return bias


class CompressingCache(Cache):
    """Compressing KV cache for the reference backend.

    Parameters
    ----------
    model_config
        The model's config (for its layer count).
    config
        What to compress, when, and how much. ``None`` never compresses.
    pad_lengths
        Left padding of each row of the batch.
    prompt_ids
        Each row's prompt token ids (without padding): with the round, they seed a
        method's random draws (:func:`~kvllm.methods.stream_seed`) as vLLM's do.
    method
        A selector to use instead of ``config.method``'s (the evaluation's oracle); the
        policy, rounds and compaction stay the same.
    """

    def __init__(
        self,
        model_config: PretrainedConfig,
        config: CompressionConfig | None,
        pad_lengths: list[int],
        prompt_ids: list[list[int]] | None = None,
        method: Method | None = None,
    ) -> None:
        ring = config.query_buffer_len if config is not None else 1
        super().__init__(layers=[CompressedLayer(ring) for _ in range(model_config.num_hidden_layers)])
        self.compression = config
        self.method = method if method is not None else build(config) if config is not None else None
        if self.method is not None:
            self.method.check_model(model_config)
        self.policy = build_policy(config) if config is not None else None
        self.pad_lengths = pad_lengths
        self.prompt_ids = prompt_ids if prompt_ids is not None else [[] for _ in pad_lengths]
        self.state: SeqState | None = None
        self.held_sum = 0.0
        self.held_steps = 0
        self.compress_seconds = 0.0
        self.rope_parameters = rope_parameters(model_config)
        # vLLM's rotary table covers max_position_embeddings positions; this one too, so
        # that a method reaching past the span (ExpectedAttention's future positions)
        # sees the same rows in both backends. Built at the first round.
        self.max_positions: int = model_config.max_position_embeddings
        self.rope: Rope | None = None
        # Lazy retention: the newest candidates' stage-one scores, for the next round's cut.
        self.carry: Tensor | None = None

    @classmethod
    def for_batch(
        cls,
        model_config: PretrainedConfig,
        config: CompressionConfig | None,
        input_ids: Tensor,
        mask: Tensor,
        method: Method | None = None,
    ) -> CompressingCache:
        """The cache of a left-padded batch: each row's padding and prompt ids read off its
        ``input_ids`` and attention ``mask`` (``[B, n]``)."""
        pad_lengths = (mask.shape[1] - mask.sum(1)).tolist()
        prompt_ids = [row[pad:] for row, pad in zip(input_ids.tolist(), pad_lengths, strict=True)]
        return cls(model_config, config, pad_lengths, prompt_ids, method)

    def begin_step(self, token_valid: Tensor) -> None:
        """Announce the next forward's tokens: ``[B, q]``, False for padding."""
        for layer in self.layers:
            layer.incoming_valid = token_valid.bool()

    def end_step(self) -> None:
        """Book the forward just run; after decode steps, maybe compress.

        The first forward is the prompt. A later forward of q tokens is q decode steps
        at once (teacher forcing feeds known tokens in chunks): each is booked as a
        step of its own, and a round may only fall after the last one, which
        :meth:`steps_to_round` lets the caller arrange.
        """
        q_len = self.layers[0].incoming_valid.shape[1]
        if self.state is None:
            self.state = SeqState(prompt_len=q_len)
            return
        for _ in range(q_len - 1):
            self.state.append(1)
            if self.policy is not None and self.policy.plan(self.state) is not None:
                raise RuntimeError("a compression round falls inside a multi-token decode forward")
            self._book_held()
        self.state.append(1)
        if self.policy is not None and (region := self.policy.plan(self.state)) is not None:
            t0 = time.perf_counter()
            self._compress(region)
            self.compress_seconds += time.perf_counter() - t0
        self._book_held()

    def steps_to_round(self, limit: int) -> int:
        """Decode steps until the next one after which a round runs, at most ``limit``.

        A forward of that many tokens ends exactly where the step-by-step loop would
        compress, so chunked teacher forcing runs the same rounds on the same slots.
        """
        if self.policy is None:
            return limit
        probe = dataclasses.replace(self.state)
        for k in range(1, limit + 1):
            probe.append(1)
            if self.policy.plan(probe) is not None:
                return k
        return limit

    def _book_held(self) -> None:
        self.held_sum += self._held()
        self.held_steps += 1

    def _held(self) -> float:
        """Slots held for generated tokens over generated tokens seen (1 before any)."""
        s = self.state
        return (s.length - s.prompt_len) / max(1, s.logical_length - s.prompt_len)

    def region_queries(self, region: Region) -> Tensor:
        """``[B, L, Hq, n_queries, D]``: the queries of the last ``region.n_queries`` tokens
        of ``region``'s span, from each layer's ring."""
        first = self.layers[0]
        # Tail slots were never compressed: padded token index = slot + dropped slots.
        dropped = self.state.logical_length - self.state.length
        q_from = region.start + region.span - region.n_queries + dropped
        slots = torch.arange(q_from, q_from + region.n_queries, device=first.keys.device) % first.ring
        return torch.stack([layer.queries[:, :, slots] for layer in self.layers], dim=1)

    def _compress(self, region: Region) -> None:
        state = self.state
        first = self.layers[0]
        dropped = state.logical_length - state.length
        span = slice(region.start, region.start + region.span)
        positions = tuple(region.start + dropped - pad for pad in self.pad_lengths)
        # Past the model's context, where vLLM would not run, the table reaches the span's end.
        reach = max(self.max_positions, max(positions) + region.span)
        if self.rope is None or self.rope.cos_sin.shape[0] < reach:
            inv_freq, scaling = self.rope_parameters
            # On the cache's device, so that a method's lookups move rows, not the table.
            self.rope = Rope(Rope.from_inv_freq(inv_freq, reach, scaling).cos_sin.to(first.keys.device))
        window = Window(
            queries=self.region_queries(region),
            keys=torch.stack([layer.keys[:, :, span] for layer in self.layers], dim=1),
            n_compress=region.n_compress,
            seeds=tuple(stream_seed(ids, state.rounds) for ids in self.prompt_ids),
            positions=positions,
            values=torch.stack([layer.values[:, :, span] for layer in self.layers], dim=1),
            rope=self.rope,
        )
        selection = self._select(window, region)
        for i, layer in enumerate(self.layers):
            idx = selection.indices[:, i]
            layer.keys = compact(layer.keys, region.start, region.n_compress, idx)
            layer.values = compact(layer.values, region.start, region.n_compress, idx)
            valid = compact(layer.valid, region.start, region.n_compress, idx)
            if selection.valid is not None:
                kept = slice(region.start, region.start + idx.shape[-1])
                valid[:, :, kept] &= selection.valid[:, i]
            layer.valid = valid
        # A variable-budget method pads its rows to the widest; the padding is masked.
        self.policy.commit(state, dataclasses.replace(region, budget=selection.indices.shape[-1]))

    def _select(self, window: Window, region: Region) -> Selection:
        cfg = self.compression
        if cfg.lazy == 1:
            return self.method.select(window, region.budget)
        carried = self.carry if region.candidates else None
        selection, self.carry = lazy_select(self.method, window, cfg.lazy_round(region.candidates), carried)
        return selection

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Physical slots held (transformers' notion of the cache length)."""
        return 0 if self.state is None else self.state.length

    def stats(self) -> list[SeqStats]:
        """Per-row statistics, without each row's left padding."""
        state = self.state
        share = self.compress_seconds / max(1, len(self.pad_lengths))
        return [
            SeqStats(
                logical_length=state.logical_length - pad,
                physical_length=state.length - pad,
                compressions=state.rounds,
                compress_seconds=share,
                held_mean=self.held_sum / self.held_steps if self.held_steps else 1.0,
                held_end=self._held(),
            )
            for pad in self.pad_lengths
        ]


def rope_parameters(config: PretrainedConfig) -> tuple[Tensor, float]:
    """The inverse frequencies and attention scaling transformers' rotary layer computes.

    transformers' model classes compute plain RoPE in a per-class static method and every
    scaled type through ``ROPE_INIT_FUNCTIONS``; the plain formula is restated here.
    """
    params = config.rope_parameters
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        return ROPE_INIT_FUNCTIONS[rope_type](config)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    return 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)), 1.0
