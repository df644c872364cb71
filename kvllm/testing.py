"""Small random-weight models and a locally trained tokenizer, for tests and demos.

Nothing is downloaded: the tokenizer is a byte-level BPE trained here with
``tokenizers`` on generated text, and the model weights are random.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    GPTJConfig,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

SPECIAL_TOKENS = ["<pad>", "<eos>", "<think>", "</think>"]
ARCHITECTURES = ("qwen3", "qwen2", "llama", "gptj")


def _corpus(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    words = "the a value of is and to we then so let compute check sum step answer".split()
    lines = []
    for _ in range(n):
        parts = [rng.choice(words) if rng.random() < 0.6 else f"v{rng.randrange(20)} = {rng.randrange(100)}"]
        parts += [rng.choice(words) for _ in range(rng.randrange(3, 12))]
        lines.append(" ".join(parts) + rng.choice([".", ",", "!", "?", ";"]))
    return lines


def train_tokenizer(vocab_size: int = 512, seed: int = 0) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on generated text, with pad and EOS tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(2000, seed), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def model_config(
    arch: str = "qwen3",
    *,
    vocab_size: int = 512,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
) -> PretrainedConfig:
    """A small config of ``arch`` (qwen3, qwen2 or llama) with GQA ``heads:kv_heads``; or of
    gptj, whose RoPE rotates interleaved pairs (no GQA: ``kv_heads`` and ``head_dim`` unused,
    the head is ``hidden_size / heads`` and all of it rotates)."""
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=4096,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
        tie_word_embeddings=True,
    )
    if arch == "qwen3":
        return Qwen3Config(head_dim=head_dim, **common)
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch == "llama":
        return LlamaConfig(head_dim=head_dim, **common)
    if arch == "gptj":
        return GPTJConfig(
            vocab_size=vocab_size,
            n_positions=4096,
            n_embd=hidden_size,
            n_layer=layers,
            n_head=heads,
            rotary_dim=hidden_size // heads,
            n_inner=2 * hidden_size,
            pad_token_id=0,
            eos_token_id=1,
            bos_token_id=1,
        )
    raise ValueError(f"arch={arch!r} is invalid: must be one of {', '.join(ARCHITECTURES)}")


def random_model(config: PretrainedConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """A causal LM with seeded random weights, in eval mode, eager attention."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=dtype)
    # Wider-than-default weights give peaked, prompt-dependent logits, so that
    # differential tests compare decisive argmaxes rather than near-ties.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    return model.eval()


def save_tiny_model(path: str | Path, arch: str = "qwen3", seed: int = 0, **shape: int) -> Path:
    """Write a random-weight model and its tokenizer to ``path`` (safetensors)."""
    path = Path(path)
    tokenizer = train_tokenizer()
    model = random_model(model_config(arch, vocab_size=len(tokenizer), **shape), seed=seed)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def save_tiny_lora(path: str | Path, model: str | Path, rank: int = 4, seed: int = 0) -> Path:
    """Write a random LoRA adapter (PEFT's format) on the q and v projections of the
    model saved at ``model`` by :func:`save_tiny_model`."""
    import json

    from safetensors.torch import save_file
    from transformers import AutoConfig

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = AutoConfig.from_pretrained(model)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    widths = {"q_proj": config.num_attention_heads * head_dim, "v_proj": config.num_key_value_heads * head_dim}
    adapter = {"r": rank, "lora_alpha": 2 * rank, "target_modules": sorted(widths), "peft_type": "LORA"}
    adapter |= {"base_model_name_or_path": str(model), "lora_dropout": 0.0, "bias": "none", "task_type": "CAUSAL_LM"}
    (path / "adapter_config.json").write_text(json.dumps(adapter))
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for name, width in widths.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            tensors[f"{prefix}.lora_A.weight"] = 0.3 * torch.randn(rank, config.hidden_size, generator=generator)
            tensors[f"{prefix}.lora_B.weight"] = 0.3 * torch.randn(width, rank, generator=generator)
    save_file(tensors, path / "adapter_model.safetensors")
    return path
