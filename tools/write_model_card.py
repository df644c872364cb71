"""Write the shipped model's card from its training summary and a Full-KV eval run.

Usage: python tools/write_model_card.py MODEL_DIR EVAL_DIR "EVAL COMMAND"
(EVAL_DIR is a `kvllm eval` output folder containing Full-KV cells.)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    model_dir, eval_dir, eval_command = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    train = json.loads((model_dir / "training.json").read_text())
    config = json.loads((model_dir / "config.json").read_text())
    rows = [r for r in json.loads((eval_dir / "results.json").read_text()) if r["method"] == "full"]
    args = train["args"]
    flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in args.items() if k != "out")
    table = "\n".join(
        f"| {r['family']} | {r['n']} | {100 * r['accuracy']:.1f}% | {r['mean_new_tokens']:.0f} |" for r in rows
    )
    card = f"""# kara-reasoner-tiny

A small reasoning model trained from scratch on CPU for KvLLM's offline demos and accuracy
curves. Its chains of thought re-read values written hundreds of tokens earlier, so KV-cache
compression of generated tokens measurably matters.

- Architecture: Qwen3 (`Qwen3ForCausalLM`), {config["num_hidden_layers"]} layers, hidden
  {config["hidden_size"]}, {config["num_attention_heads"]} query heads / {config["num_key_value_heads"]} KV heads
  (GQA), head dim {config["head_dim"]}, tied embeddings, {train["params"] / 1e6:.2f}M parameters.
- Tokenizer: byte-level BPE ({config["vocab_size"]} tokens) trained with `tokenizers` on task
  text; every digit is its own token (the first of a value with its leading space);
  `<think>`/`</think>` are plain tokens.
- Data: the three `kvllm.eval.tasks` families (trace, gen-needle, prompt-needle) mixed evenly,
  training seeds only (>= 1,000,000; held-out evaluation uses seeds < 1,000,000), plus a
  share of training-only associative-recall examples (`name VV` records, then names drawn
  with replacement and their values), which alone fill the first minutes. Programs grow with training (a
  curriculum): from 2-3 constants and 1-3 steps up to 2-16 constants and 1-48 steps.
  Loss on the chain of thought and answer only.
- Training: {train["steps"]} AdamW steps, {train["train_tokens"] / 1e6:.2f}M tokens in
  {train["train_seconds"] / 60:.1f} minutes on 2 CPU cores in fp32 ({train["tokens_per_second"]:.0f} tokens/s).
  fp32 because this machine's CPU (AVX2, no AMX/AVX-512) emulates bf16 matmul ~60x slower.

Command:

```bash
python tools/train_reasoner.py --out kvllm/assets/kara-reasoner-tiny {flags}
```

## Full-KV accuracy (held-out, greedy)

| family | problems | exact match | mean generated tokens |
| --- | --- | --- | --- |
{table}

Measured with:

```bash
{eval_command}
```
"""
    (model_dir / "README.md").write_text(card)
    print(card)


if __name__ == "__main__":
    main()
