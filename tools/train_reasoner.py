"""Train KvLLM's shipped small reasoning model on the generated task families.

A Qwen3-architecture model (GQA, tied embeddings) with a byte-level BPE tokenizer that
splits digits, trained on a mixture of ``kvllm.eval.tasks`` families with the loss on
the chain of thought and answer only. Writes safetensors, tokenizer, config and a model
card (with held-out Full-KV accuracy) to ``--out``.

Usage::

    python tools/train_reasoner.py --out kvllm/assets/kara-reasoner-tiny --minutes 40
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from kvllm.eval.tasks import END_THINK, FAMILIES, NAMES, THINK, TRAIN_SEEDS, Difficulty, make_task

# The shipped model's shape; tools/probe_recall.py trains the same one.
SHAPE = {"hidden": 192, "layers": 4, "heads": 6, "kv_heads": 2}
# A chat turn is a task prompt without its thinking marker; the template adds it back.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}\n " + THINK


def build_tokenizer(vocab_size: int, seed: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE over generated task text; every digit is its own token."""
    rng = random.Random(seed)
    corpus = [make_task(rng.choice(FAMILIES), rng.choice(TRAIN_SEEDS), _difficulty(rng, 1.0)).text for _ in range(1500)]
    tok = Tokenizer(models.BPE())
    # Each digit is a token, with the space before it if any (" 4", "1"): the name right
    # before a value is then the token right before its first digit.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r" ?\d"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    # Reasoning markers are plain (non-special) tokens, so decoded text keeps them.
    tok.add_tokens([AddedToken(THINK, normalized=False), AddedToken(END_THINK, normalized=False)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def model_config(vocab_size: int, hidden: int, layers: int, heads: int, kv_heads: int, **ids: int) -> Qwen3Config:
    """Qwen3 with GQA, tied embeddings and a 4x MLP; ``ids`` are the special token ids."""
    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=8192,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        **ids,
    )


def name_token_ids(tok: PreTrainedTokenizerFast) -> torch.Tensor:
    """The variable names' tokens, as they appear in text (after a space)."""
    return torch.tensor(tok.convert_tokens_to_ids(["Ġ" + name for name in NAMES]))


def _difficulty(rng: random.Random, level: float, steps: int | None = None, top_steps: int = 48) -> Difficulty:
    """Mixed lengths up to a curriculum ``level`` in [0, 1].

    Level 0 is 2-3 constants and 1-3 steps: with few distractors the copy circuits form
    in hundreds of steps, where with 6-16 constants they had not after 1,900
    (``docs/training-attempts.md``).
    """
    top_constants = 3 + round(13 * level)
    top = 3 + round((top_steps - 3) * level)
    steps = steps if steps is not None else rng.randint(1, top)
    return Difficulty(constants=rng.randint(2, top_constants), steps=steps, depth=rng.random())


def _recall(rng: random.Random, pairs: int) -> tuple[str, str]:
    """A training-only associative-recall example in the tasks' value format (``bo 41``).

    The prompt lists ``pairs`` values; the chain of thought writes ``pairs`` of them back,
    drawn with replacement. Reading a value back is the lookup that every task needs
    (find the name, copy what follows). Queries without replacement let a model skip
    the lookup and copy a value not yet written back, which is right half the time with
    4 records; probes sat on that shortcut for 600+ steps and formed the lookup within
    300 once it was gone (``docs/training-attempts.md``). The queried names are random,
    so :func:`_batch` puts no loss on them: a loss there slowed the lookup's forming.
    """
    names = rng.sample(NAMES, pairs)
    records = [f"{name} {rng.randrange(100):02d}" for name in names]
    queries = [rng.choice(records) for _ in records]
    lines = ["recall: report every value.", *records, THINK, *queries, END_THINK, queries[-1]]
    text = "\n ".join(lines)
    split = text.index(THINK) + len(THINK)
    return text[:split], text[split:]


def _batch(
    tok: PreTrainedTokenizerFast,
    rng: random.Random,
    token_budget: int,
    level: float,
    top_steps: int,
    recall: float,
    name_ids: torch.Tensor,
):
    """Examples up to ``token_budget`` padded tokens; labels only on the target.

    A ``recall`` share of the examples are :func:`_recall` ones as long as the tasks.
    """
    rows: list[tuple[list[int], int, bool]] = []
    longest = 0
    # One program length per batch keeps padding (wasted compute) small.
    steps = _difficulty(rng, level, top_steps=top_steps).steps
    while True:
        d = _difficulty(rng, level, steps, top_steps)
        is_recall = rng.random() < recall
        if is_recall:
            text, answer = _recall(rng, min(len(NAMES), d.constants + d.steps))
        else:
            task = make_task(rng.choice(FAMILIES), rng.choice(TRAIN_SEEDS), d)
            text, answer = task.prompt, task.target
        prompt = tok(text)["input_ids"]
        target = tok(answer)["input_ids"] + [tok.eos_token_id]
        ids = prompt + target
        if rows and max(longest, len(ids)) * (len(rows) + 1) > token_budget:
            break
        rows.append((ids, len(prompt), is_recall))
        longest = max(longest, len(ids))
    input_ids = torch.full((len(rows), longest), tok.pad_token_id)
    labels = torch.full((len(rows), longest), -100)
    mask = torch.zeros((len(rows), longest), dtype=torch.long)
    for i, (ids, n_prompt, is_recall) in enumerate(rows):
        target = torch.tensor(ids[n_prompt:])
        if is_recall:
            target[torch.isin(target, name_ids)] = -100
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, n_prompt : len(ids)] = target
        mask[i, : len(ids)] = 1
    return input_ids, labels, mask


def _save(model: Qwen3ForCausalLM, tok: PreTrainedTokenizerFast, out: Path) -> None:
    model.eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--minutes", type=float, default=40.0)
    p.add_argument("--hidden", type=int, default=SHAPE["hidden"])
    p.add_argument("--layers", type=int, default=SHAPE["layers"])
    p.add_argument("--heads", type=int, default=SHAPE["heads"])
    p.add_argument("--kv-heads", type=int, default=SHAPE["kv_heads"])
    p.add_argument("--vocab", type=int, default=512, help="BPE vocabulary cap (the corpus saturates near 420)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--warmup", type=int, default=100, help="optimizer steps of linear warm-up")
    p.add_argument("--decay", type=float, default=0.2, help="final share of the time the learning rate decays")
    p.add_argument("--batch-tokens", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--top-steps", type=int, default=48, help="longest program of the curriculum")
    p.add_argument("--level-up", type=float, default=0.8, help="digit accuracy that raises the curriculum level")
    p.add_argument("--recall", type=float, default=0.2, help="share of training-only recall examples")
    p.add_argument(
        "--recall-warmup", type=float, default=10.0, help="most minutes of recall-only examples first (3-4 records)"
    )
    p.add_argument("--qk-init", type=float, default=1.0, help="initial weight of Qwen3's q/k RMSNorms")
    p.add_argument("--log-every", type=float, default=60.0, help="seconds between log lines")
    p.add_argument("--save-every", type=float, default=0.0, help="minutes between snapshots (0: at the end)")
    args = p.parse_args()
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)

    tok = build_tokenizer(args.vocab, args.seed)
    config = model_config(
        len(tok),
        args.hidden,
        args.layers,
        args.heads,
        args.kv_heads,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.eos_token_id,
    )
    model = Qwen3ForCausalLM(config)
    model.config._attn_implementation = "sdpa"
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.fill_(args.qk_init)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"params {n_params / 1e6:.2f}M, vocab {len(tok)}, threads {torch.get_num_threads()}", flush=True)
    decay = [p for n, p in model.named_parameters() if p.dim() > 1]
    no_decay = [p for n, p in model.named_parameters() if p.dim() <= 1]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.98),
    )
    digit_ids = torch.tensor(tok.convert_tokens_to_ids([p + d for p in ("", "Ġ") for d in "0123456789"]))
    name_ids = name_token_ids(tok)
    budget = args.minutes * 60
    start = time.perf_counter()
    step, tokens, log_loss, log_n, log_hit, log_digits = 0, 0, 0.0, 0, 0, 0
    level, digit_ema, warming = 0.0, 0.0, True
    last_log = last_save = start
    model.train()
    while (elapsed := time.perf_counter() - start) < budget:
        progress = elapsed / budget
        # Constant after warm-up, cosine down to a tenth in the last ``decay`` share only:
        # the copy circuits need many steps at a high rate to form.
        warm = min(1.0, (step + 1) / args.warmup)
        tail = max(0.0, (progress - (1 - args.decay)) / args.decay)
        lr = args.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * tail)))
        for group in opt.param_groups:
            group["lr"] = lr
        # Recall only until the lookup has formed (digits mostly right), then the tasks.
        if warming and (elapsed > 60 * args.recall_warmup or digit_ema > args.level_up):
            warming, digit_ema = False, 0.0
            print(f"{elapsed / 60:5.1f} min step {step}: recall warm-up done, tasks from now on", flush=True)
        # Harder tasks once digits are mostly right, and by a time floor in any case.
        floor = min(1.0, max(0.0, (progress - 0.2) / 0.5))
        if digit_ema > args.level_up and not warming:
            level = min(1.0, level + 0.01)
        level = max(level, floor)
        if warming:
            # Level 0, one-step programs: recall examples of 3-4 records.
            input_ids, labels, mask = _batch(
                tok, rng, args.batch_tokens, level=0.0, top_steps=1, recall=1.0, name_ids=name_ids
            )
        else:
            input_ids, labels, mask = _batch(tok, rng, args.batch_tokens, level, args.top_steps, args.recall, name_ids)
        out = model(input_ids=input_ids, attention_mask=mask, labels=labels)
        loss = out.loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens += int(mask.sum())
        log_loss += loss.item()
        log_n += 1
        # Teacher-forced accuracy on digit targets: the values copied and computed, the
        # part of the chain of thought that the format alone does not predict.
        with torch.no_grad():
            target = labels[:, 1:]
            digits = torch.isin(target, digit_ids)
            hit = int(((out.logits[:, :-1].argmax(-1) == target) & digits).sum())
            log_hit += hit
            log_digits += int(digits.sum())
            digit_ema = 0.95 * digit_ema + 0.05 * hit / max(1, int(digits.sum()))
        if time.perf_counter() - last_log > args.log_every:
            now = time.perf_counter() - start
            print(
                f"{now / 60:5.1f} min step {step} loss {log_loss / log_n:.4f} "
                f"digit acc {log_hit / max(1, log_digits):.3f} level {level:.2f} lr {lr:.2e} "
                f"{tokens / now:.0f} tok/s ({tokens / 1e6:.2f}M tokens)",
                flush=True,
            )
            log_loss, log_n, log_hit, log_digits, last_log = 0.0, 0, 0, 0, time.perf_counter()
        if args.save_every and time.perf_counter() - last_save > 60 * args.save_every:
            _save(model, tok, args.out)
            model.train()
            last_save = time.perf_counter()

    wall = time.perf_counter() - start
    _save(model, tok, args.out)
    summary = {
        "params": n_params,
        "steps": step,
        "train_tokens": tokens,
        "train_seconds": round(wall, 1),
        "tokens_per_second": round(tokens / wall, 1),
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    (args.out / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2), flush=True)


if __name__ == "__main__":
    main()
