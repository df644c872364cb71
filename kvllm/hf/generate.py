"""Batched generation on transformers with a compressing cache (the reference backend).

The loop is our own rather than ``model.generate`` so that positions stay logical
after compaction: RoPE positions count every token a row has seen, while the cache
holds fewer slots. Positions follow ``model.generate``'s rule for left padding
(cumulative attention mask - 1), so without compression both produce the same tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvllm.config import CompressionConfig
from kvllm.generation import Generation, SeqStats
from kvllm.hf import attention
from kvllm.hf.cache import CompressingCache
from kvllm.methods import Method

# Teacher forcing feeds at most this many known tokens per forward: a round every P
# steps cuts chunks shorter anyway, and without compression this bounds a forward's
# logits [B, q, V] (the largest buffer; a 152k vocabulary makes 64 rows 39 MB per
# sequence) and its [B, Hkv, G * q, N] attention scores.
MAX_CHUNK = 64


def _next_tokens(logits: Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> Tensor:
    if temperature == 0.0:
        return logits.argmax(-1)
    probs = (logits.float() / temperature).softmax(-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(-1, descending=True)
        # Drop a token once the tokens before it already cover top_p.
        drop = sorted_probs.cumsum(-1) - sorted_probs > top_p
        probs = probs.scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.inference_mode()
def generate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    config: CompressionConfig | None,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    stop_at_eos: bool = True,
    on_step: Callable[[int], None] | None = None,
    forced: Sequence[Sequence[int]] | None = None,
    method: Method | None = None,
) -> Generation:
    """Generate continuations of ``prompts`` as one left-padded batch.

    Parameters
    ----------
    model, tokenizer
        A transformers causal LM (Qwen3, Qwen2, Llama, ...) and its tokenizer.
    prompts
        Raw prompt texts (apply a chat template beforehand if the model wants one).
    config
        Compression settings; ``None`` disables compression.
    max_new_tokens
        Tokens to generate per prompt at most.
    temperature, top_p, seed
        Sampling; ``temperature=0`` is greedy.
    stop_at_eos
        Stop a row at the tokenizer's EOS token (rows that stop are fed EOS and masked
        out of the text, as ``model.generate`` pads them).
    on_step
        Called with the number of tokens generated so far (for progress bars).
    forced
        Teacher forcing: per prompt, the tokens to feed instead of sampled ones (a row
        whose tokens run out is fed EOS and masked, like a row that stopped). The
        result's ``predictions`` hold the model's argmax at every forced position, and
        the cache compresses exactly as in free generation. The known tokens go
        through in chunks between rounds (``max_new_tokens`` is then unused).
    method
        A selector instead of ``config.method``'s (the evaluation's oracle).
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} is invalid: must be >= 1")
    device = model.device
    enc = tokenizer(list(prompts), return_tensors="pt", padding=True, padding_side="left")
    input_ids = enc["input_ids"].to(device)
    mask = enc["attention_mask"].to(device)
    cache = CompressingCache.for_batch(model.config, config, input_ids, mask, method)
    if forced is not None:
        if len(forced) != len(prompts) or not all(forced):
            raise ValueError("forced must hold one non-empty token list per prompt")
        fill = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
        width = max(len(f) for f in forced)
        forced_ids = torch.tensor([list(f) + [fill] * (width - len(f)) for f in forced], device=device)
    positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)
    eos = tokenizer.eos_token_id if stop_at_eos else None
    generator = torch.Generator(device=device).manual_seed(seed)

    # Our attention reads the cache's slot validity; transformers builds no mask for an
    # implementation it has no mask function for (its mask assumes slots == positions).
    previous = model.config._attn_implementation
    model.set_attn_implementation(attention.NAME)
    try:
        cache.begin_step(mask)
        logits = model(
            input_ids=input_ids,
            position_ids=positions,
            past_key_values=cache,
            kvllm_cache=cache,
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1]
        cache.end_step()
        if forced is not None:
            preds, stats = _force(model, cache, logits, positions[:, -1:], forced_ids, eos, on_step)
            predicted = [row[: len(f)] for row, f in zip(preds, forced, strict=True)]
        else:
            predicted = None
            generated, stats = _decode(
                model, cache, logits, positions[:, -1:], max_new_tokens, eos, temperature, top_p, generator, on_step
            )
    finally:
        model.set_attn_implementation(previous)

    token_ids = [list(f) for f in forced] if forced is not None else [_until_eos(row, eos) for row in generated]
    texts = tokenizer.batch_decode(token_ids, skip_special_tokens=True)
    final = cache.stats()
    return Generation(
        texts=texts,
        token_ids=token_ids,
        stats=[s if s is not None else f for s, f in zip(stats, final, strict=True)],
        predictions=predicted,
    )


def _step(model, cache: CompressingCache, tokens: Tensor, position: Tensor) -> Tensor:
    """Feed ``tokens`` ``[B, q]`` at the ``q`` positions after ``position`` ``[B, 1]``;
    returns their logits ``[B, q, V]``."""
    cache.begin_step(torch.ones_like(tokens))
    steps = torch.arange(1, tokens.shape[1] + 1, device=tokens.device)
    logits = model(
        input_ids=tokens, position_ids=position + steps, past_key_values=cache, kvllm_cache=cache, use_cache=True
    ).logits
    cache.end_step()
    return logits


def _decode(
    model,
    cache: CompressingCache,
    logits: Tensor,
    position: Tensor,
    max_new_tokens: int,
    eos: int | None,
    temperature: float,
    top_p: float,
    generator: torch.Generator,
    on_step: Callable[[int], None] | None,
) -> tuple[list[list[int]], list[SeqStats | None]]:
    """Free generation, one token per forward; each row's statistics when it stops."""
    out: list[Tensor] = []
    done = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
    # A row that stops keeps being fed EOS with the batch; its statistics are taken
    # when it stops.
    stats: list[SeqStats | None] = [None] * logits.shape[0]
    for step in range(max_new_tokens):
        token = _next_tokens(logits, temperature, top_p, generator)
        if eos is not None:
            token = token.masked_fill(done, eos)
            newly = (token == eos) & ~done
            done |= newly
            for row in newly.nonzero().flatten().tolist():
                stats[row] = cache.stats()[row]
        out.append(token)
        if cache.method is not None:
            cache.method.observe(token)
        if on_step is not None:
            on_step(step + 1)
        if step + 1 == max_new_tokens or bool(done.all()):
            break
        logits = _step(model, cache, token.unsqueeze(1), position + step)[:, -1]
    return torch.stack(out, dim=1).tolist(), stats


def _force(
    model,
    cache: CompressingCache,
    logits: Tensor,
    position: Tensor,
    forced: Tensor,
    eos: int | None,
    on_step: Callable[[int], None] | None,
) -> tuple[list[list[int]], list[SeqStats | None]]:
    """Teacher forcing: feed ``forced`` ``[B, T]`` and keep the argmax before each token.

    The tokens are known, so they go through in chunks that end where
    :meth:`CompressingCache.steps_to_round` says a round runs, and where a row's first
    EOS is due: the cache compresses, and each row's statistics are taken, exactly where
    the step-by-step loop (:func:`_decode`) would, at a sixteenth of the forwards with
    P = 16. The logits equal that loop's up to floating-point rounding (a forward of q
    tokens multiplies other shapes), so a near tie could flip an argmax; on the
    evaluation's grids every cell reproduced problem for problem. Returns the argmax
    before each token fed, up to where the step-by-step loop stops, and each row's
    statistics at its first EOS (EOS is fed after it).
    """
    rows, width = forced.shape
    if eos is not None:
        first = [row.index(eos) if eos in row else width for row in forced.tolist()]
        after = torch.arange(width, device=forced.device) > torch.tensor(first, device=forced.device).unsqueeze(1)
        fed = forced.masked_fill(after, eos)
        # The step-by-step loop stops once every row has written its EOS.
        last = min(width - 1, max(first))
    else:
        first, fed, last = [width] * rows, forced, width - 1
    stops = sorted({f for f in first if f <= last} | {last})
    stats: list[SeqStats | None] = [None] * rows
    predictions = [logits.argmax(-1, keepdim=True)]
    step = 0
    while True:
        for row in (r for r in range(rows) if first[r] == step):
            stats[row] = cache.stats()[row]
        if step == last:
            break
        end = min(next(s for s in stops if s > step), step + cache.steps_to_round(min(MAX_CHUNK, last - step)))
        chunk = _step(model, cache, fed[:, step:end], position + step)
        predictions.append(chunk.argmax(-1))
        step = end
        if on_step is not None:
            on_step(step)
    if on_step is not None:
        on_step(last + 1)  # the last token, whose argmax is kept but which is not fed
    return torch.cat(predictions, dim=1).tolist(), stats


def _until_eos(row: list[int], eos: int | None) -> list[int]:
    """The row's tokens up to and including its first EOS."""
    if eos is not None and eos in row:
        return row[: row.index(eos) + 1]
    return row
