"""Train KvLLM's shipped small reasoning model on the generated task families.

A Qwen3-architecture model (GQA, tied embeddings) with a byte-level BPE tokenizer that
makes every digit a token, trained on a mixture of ``kvllm.eval.tasks`` families (plus
training-only recall examples and arithmetic drills) with the loss on the chain of
thought and answer only. Writes safetensors, tokenizer and config, and a
``training.json`` summary, to ``--out``.

Usage (the default model's two stages and their timings are in its card,
``kvllm/assets/kara-reasoner-tiny/README.md``; the three stages of the second,
``kara-reasoner-6l``, in its own)::

    python tools/train_reasoner.py --out /tmp/stage1 --minutes 40
    python tools/train_reasoner.py --out kvllm/assets/kara-reasoner-tiny --init-from /tmp/stage1 \
        --minutes 19 --floor-until 0.6 --drill 0.4
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from kvllm.eval.lookup import STATEMENT
from kvllm.eval.tasks import (
    CHAT_TEMPLATE,
    END_THINK,
    FAMILIES,
    HEDGES,
    NAMES,
    OPS,
    RESTATE,
    THINK,
    TRACE_FAMILIES,
    TRAIN_SEEDS,
    Difficulty,
    apply,
    draw_operator,
    make_task,
)

# The shipped model's shape; tools/probe_recall.py trains the same one.
SHAPE = {"hidden": 192, "layers": 4, "heads": 6, "kv_heads": 2}


def build_tokenizer(
    vocab_size: int, seed: int, families: tuple[str, ...] = TRACE_FAMILIES, op: str = "add"
) -> PreTrainedTokenizerFast:
    """Byte-level BPE over generated task text of ``families``; every digit is a token of its own."""
    rng = random.Random(seed)
    corpus = [
        make_task(rng.choice(families), rng.choice(TRAIN_SEEDS), _difficulty(rng, 1.0, op=op)).text for _ in range(1500)
    ]
    tok = Tokenizer(models.BPE())
    # Each digit is a token of its own, the same for a value's first and second digit: the
    # name right before a value (``bo41``) is then the token right before its first digit.
    # First digits with tokens of their own (" 4") kept the lookup from forming in
    # probes that formed it with shared digits (docs/appendix/training-record.md, runs 12-17).
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\d"), behavior="isolated"),
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


def model_config(
    vocab_size: int, hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int | None = None, **ids: int
) -> Qwen3Config:
    """Qwen3 with GQA, tied embeddings and a 4x MLP; ``ids`` are the special token ids.

    ``head_dim`` defaults to ``hidden // heads``; Qwen3 lets it differ (heads x head_dim
    query width over a narrower residual), which keeps a 64-wide head in a small model.
    """
    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim or hidden // heads,
        max_position_embeddings=8192,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        **ids,
    )


def name_token_ids(tok: PreTrainedTokenizerFast) -> torch.Tensor:
    """The variable names' tokens, as they appear in text (after a space)."""
    return torch.tensor(tok.convert_tokens_to_ids(["Ġ" + name for name in NAMES]))


def _difficulty(
    rng: random.Random, level: float, steps: int | None = None, top_steps: int = 48, op: str = "add"
) -> Difficulty:
    """Mixed lengths up to a curriculum ``level`` in [0, 1].

    Level 0 is 2-3 constants and 1-3 steps: with few distractors the copy circuits form
    in hundreds of steps, where with 6-16 constants they had not after 1,900
    (``docs/appendix/training-record.md``).
    """
    top_constants = 3 + round(13 * level)
    steps = steps if steps is not None else rng.randint(1, _longest(level, top_steps))
    constants = rng.randint(2, top_constants)
    # Programs of more than 74 steps (reason's 84) leave fewer names for constants.
    return Difficulty(constants=constants, steps=min(steps, len(NAMES) - constants), depth=rng.random(), op=op)


def _longest(level: float, top_steps: int) -> int:
    """The most steps a program has at curriculum ``level``."""
    return 3 + round((top_steps - 3) * level)


def _recall(rng: random.Random, pairs: int, queries: int) -> tuple[str, str]:
    """A training-only associative-recall example in the tasks' value format (``bo41``).

    The prompt lists ``pairs`` values; the chain of thought writes ``queries`` of them
    back, drawn with replacement. Reading a value back is the lookup that every task needs
    (find the name, copy what follows). Queries without replacement let a model skip
    the lookup and copy a value not yet written back, which is right half the time with
    4 records; probes sat on that shortcut for 600+ steps and formed the lookup within
    300 once it was gone (``docs/appendix/training-record.md``). The queried names are random,
    so :func:`_batch` puts no loss on them: a loss there slowed the lookup's forming.
    """
    names = rng.sample(NAMES, pairs)
    records = [f"{name}{rng.randrange(100):02d}" for name in names]
    asked = [rng.choice(records) for _ in range(queries)]
    # No header line: every token of context dilutes the attention a lookup starts from.
    text = " " + "\n ".join([*records, THINK, *asked, END_THINK, asked[-1]])
    split = text.index(THINK) + len(THINK)
    return text[:split], text[split:]


def _drill(rng: random.Random, lines: int, op: str = "add") -> tuple[str, str]:
    """A training-only drill of the statements' operator: chain-of-thought lines of random values.

    Each line has the trace's exact shape (``ce = bo + ku = bo41 + ku13 = ce54``), so the
    circuits that combine what sits at fixed offsets in a line are the ones the tasks
    use. :func:`_batch` scores only each line's result: names and operand values are
    random here. In tasks a line's arithmetic is one target in 18 tokens; here it is the
    whole point, which the tasks alone did not teach in time (runs 12-17).
    """
    out = []
    for _ in range(lines):
        name, x, y = rng.sample(NAMES, 3)
        vx, vy, symbol = rng.randrange(100), rng.randrange(100), draw_operator(rng, op)
        result = apply(vx, symbol, vy)
        out.append(f"{name} = {x} {symbol} {y} = {x}{vx:02d} {symbol} {y}{vy:02d} = {name}{result:02d}")
    text = "\n ".join(["drill: evaluate every line.", THINK, *out])
    split = text.index(THINK) + len(THINK)
    return text[:split], text[split:]


# A name is two letters between non-letters; ``bo41`` holds one, ``code57`` none.
_NAME = re.compile(rf"(?<![a-z])({'|'.join(NAMES)})(?![a-z])")
# A restatement (``so ce is 54.``) starts with a word that is also a name.
_RESTATEMENT = re.compile(rf"^ ?{RESTATE} (?=[a-z]{{2}} is )")


def rename(texts: tuple[str, ...], rng: random.Random) -> tuple[str, ...]:
    """``texts`` with the variable names permuted at random, the same way in each.

    A training-only variant of the tasks. Their programs name statements in the order of
    ``NAMES``, so a model can write each next statement's name by that order without
    reading the prompt's program, and then has nothing that tells it where the program
    ends: stage 8 of the second model wrote statements on past the last one
    (docs/appendix/training-record.md, "Stages 8 and 9"). With the names permuted, the next name is
    only where the prompt's next line has it, and after the last line stands the
    thinking marker. Hedging lines and a restatement's first word (``so``, also a name)
    are words, not names, and keep their letters.
    """
    mapping = dict(zip(NAMES, rng.sample(NAMES, len(NAMES)), strict=True))

    def line(text: str) -> str:
        if text.strip() in HEDGES:
            return text
        head = m.group() if (m := _RESTATEMENT.match(text)) else ""
        return head + _NAME.sub(lambda name: mapping[name.group()], text[len(head) :])

    return tuple("\n".join(map(line, text.split("\n"))) for text in texts)


def copy_spans(target: str) -> tuple[list[tuple[int, int]], tuple[int, int] | None]:
    """Character spans of a task target's copies from the prompt's program, and its end.

    The copies are each statement line's name (which statement comes next) and its two
    operand names, copied from the prompt's line that defines the name; a check line's
    name is a random earlier step, not a copy, so check lines have none. Stage 7 of the
    second model copied a reason statement's first operand right only 0.46 of the time
    teacher-forced (the second 0.98), so its free chains left the program. The end is
    the line `` </think>``, whose first token (the space) is where a chain decides to
    stop: stage 8 gave it a probability of 0.02-0.13 right after reason's last statement,
    so its chains ran past the program (docs/appendix/training-record.md, "Stages 8 and 9").
    """
    spans, end, offset = [], None, 0
    for line in target.split("\n"):
        if m := STATEMENT.match(line):
            spans += [(offset + m.start(g), offset + m.end(g)) for g in (1, 2, 4)]
        elif line.strip() == END_THINK:
            end = (offset, offset + len(line))
        offset += len(line) + 1
    return spans, end


def _batch(
    tok: PreTrainedTokenizerFast,
    rng: random.Random,
    token_budget: int,
    level: float,
    top_steps: int,
    recall: float,
    drill: float,
    name_ids: torch.Tensor,
    digit_ids: torch.Tensor,
    pairs: int | None = None,
    families: tuple[str, ...] = TRACE_FAMILIES,
    op: str = "add",
    shuffle: float = 0.0,
    long: float = 0.0,
):
    """Examples up to ``token_budget`` padded tokens; labels only on the target.

    A ``recall`` share of the examples are :func:`_recall` ones and a ``drill`` share
    :func:`_drill` ones, as long as the tasks; a ``shuffle`` share of the tasks have their
    names permuted (:func:`rename`); a ``long`` share of the batches hold only programs
    of the level's most steps; with ``pairs``, all are recall examples of
    that many records (the warm-up). Returns ids, labels, attention mask, and where a
    label is one of a task's copies from the prompt, where its end (:func:`copy_spans`)
    and where its answer (the line after the end).
    """
    rows: list[tuple[list[int], int, str, list[bool], list[bool], list[bool]]] = []
    longest = 0
    line_end = torch.tensor([tok.convert_tokens_to_ids("Ċ"), tok.eos_token_id])
    # One program length per batch keeps padding (wasted compute) small. The longest
    # programs are the rarest draw, yet every reason task is graded at that length, where
    # the answer line reads a question more than a thousand tokens back. Only when asked:
    # a draw here would change the data of runs made without it.
    if long and rng.random() < long:
        steps = _longest(level, top_steps)
    else:
        steps = _difficulty(rng, level, top_steps=top_steps).steps
    while True:
        d = _difficulty(rng, level, steps, top_steps, op)
        draw = rng.random()
        kind = "recall" if pairs is not None or draw < recall else "drill" if draw < recall + drill else "task"
        n = min(len(NAMES), d.constants + d.steps)
        if pairs is not None:
            # Twice as many queries as records: more lookups per token of context.
            text, answer = _recall(rng, pairs, 2 * pairs)
        elif kind == "recall":
            text, answer = _recall(rng, n, n)
        elif kind == "drill":
            text, answer = _drill(rng, n, op)
        else:
            task = make_task(rng.choice(families), rng.choice(TRAIN_SEEDS), d)
            text, answer = task.prompt, task.target
            # Only when asked: a draw here would change the data of runs made without it.
            if shuffle and rng.random() < shuffle:
                text, answer = rename((text, answer), rng)
        prompt = tok(text)["input_ids"]
        encoded = tok(answer, return_offsets_mapping=True)
        target = encoded["input_ids"] + [tok.eos_token_id]
        spans, end = copy_spans(answer) if kind == "task" else ([], None)
        offsets = encoded["offset_mapping"]
        copies = [any(a < stop and start < b for start, stop in spans) for a, b in offsets] + [False]
        stops = [end is not None and a < end[1] and end[0] < b for a, b in offsets] + [False]
        answers = [end is not None and a >= end[1] for a, _ in offsets] + [False]
        ids = prompt + target
        if rows and max(longest, len(ids)) * (len(rows) + 1) > token_budget:
            break
        rows.append((ids, len(prompt), kind, copies, stops, answers))
        longest = max(longest, len(ids))
    input_ids = torch.full((len(rows), longest), tok.pad_token_id)
    labels = torch.full((len(rows), longest), -100)
    mask = torch.zeros((len(rows), longest), dtype=torch.long)
    copy = torch.zeros((len(rows), longest), dtype=torch.bool)
    end = torch.zeros((len(rows), longest), dtype=torch.bool)
    answer = torch.zeros((len(rows), longest), dtype=torch.bool)
    for i, (ids, n_prompt, kind, copies, stops, answers) in enumerate(rows):
        target = torch.tensor(ids[n_prompt:])
        if kind == "recall":
            target[torch.isin(target, name_ids)] = -100
        elif kind == "drill":
            # Only results: the two digits that end a line (before a line break or EOS).
            ends = torch.zeros(len(target), dtype=torch.bool)
            ends[:-1] = torch.isin(target[:-1], digit_ids) & torch.isin(target[1:], line_end)
            result = ends.clone()
            result[:-1] |= ends[1:]
            target[~result] = -100
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, n_prompt : len(ids)] = target
        mask[i, : len(ids)] = 1
        copy[i, n_prompt : len(ids)] = torch.tensor(copies)
        end[i, n_prompt : len(ids)] = torch.tensor(stops)
        answer[i, n_prompt : len(ids)] = torch.tensor(answers)
    return input_ids, labels, mask, copy, end, answer


class Batches:
    """Training batches (:func:`_batch`), made in the training loop or, with ``workers``,
    by that many processes ahead of it: a GPU step takes less time than making its batch.

    ``budgets`` are the padded tokens of a task batch and of a warm-up one; ``fixed``, the
    rest of :func:`_batch`'s arguments but the level and the warm-up's records, which
    :meth:`next` takes each step (a worker's batches lag them by the queue's length).
    Without workers the batches are those of a ``random.Random(seed)``, as before workers.
    """

    def __init__(self, workers: int, seed: int, budgets: tuple[int, int], **fixed: object) -> None:
        self.budgets, self.fixed, self.rng = budgets, fixed, random.Random(seed)
        self.processes = []
        if workers:
            # Spawned, not forked: the parent may hold a CUDA context, which forks break.
            ctx = mp.get_context("spawn")
            self.level, self.pairs = ctx.Value("d", 0.0), ctx.Value("i", 0)
            self.queue = ctx.Queue(maxsize=2 * workers)
            for i in range(workers):
                args = (seed * 1000 + i + 1, budgets, fixed, self.level, self.pairs, self.queue)
                self.processes.append(ctx.Process(target=_make_batches, args=args, daemon=True))
                self.processes[-1].start()

    def next(self, level: float, pairs: int | None) -> tuple[torch.Tensor, ...]:
        if not self.processes:
            return _sized_batch(self.rng, self.budgets, level, pairs, self.fixed)
        self.level.value, self.pairs.value = level, pairs or 0
        return tuple(map(torch.from_numpy, self.queue.get()))

    def close(self) -> None:
        for process in self.processes:
            process.terminate()


def _sized_batch(
    rng: random.Random, budgets: tuple[int, int], level: float, pairs: int | None, fixed: dict
) -> tuple[torch.Tensor, ...]:
    """:func:`_batch` at the task budget, or at the warm-up's when its records are given."""
    return _batch(rng=rng, token_budget=budgets[pairs is not None], level=level, pairs=pairs, **fixed)


def _make_batches(seed: int, budgets: tuple[int, int], fixed: dict, level, pairs, queue) -> None:
    """A worker of :class:`Batches`: batches, as numpy arrays (plain pickles), into ``queue``."""
    torch.set_num_threads(1)
    rng = random.Random(seed)
    while True:
        batch = _sized_batch(rng, budgets, level.value, pairs.value or None, fixed)
        queue.put(tuple(t.numpy() for t in batch))


def far_key_mask(
    labels: torch.Tensor,
    mask: torch.Tensor,
    rate: float,
    clean: float,
    window: tuple[int, int],
    generator: torch.Generator,
    whole: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A 4D attention mask (``(batch, 1, T, T)``, True where a query reads a key) in which
    each sequence has lost a random share of its generated keys older than a window.

    The robustness change of ``kara-reasoner-6l`` v3, and no compression method's: per
    sequence, a rate is drawn uniformly from ``[0, rate]`` (0 for a ``clean`` share of
    the sequences, which keeps Full KV's contexts in the mix) and a window from
    ``window``; each generated key is dropped with that rate, and a dropped key is hidden
    from every query at least the window after it, as an evicted key is from all later
    decoding steps. The prompt (before the first label) and the newest ``window`` keys
    are never hidden, as a round never touches the prompt or the protected tail. A model
    trained only on complete contexts learned a stop that fails when a part of the far
    context is gone, while it survives losing all of it (``docs/models.md``, v2).

    ``whole`` (``[batch, T]`` bool) marks queries that read every key anyway
    (``--drop-answer-whole``: the answer line's).

    Returns the mask and which sequences lost keys (``[batch]`` bool): ``--drop-unscored``
    puts no loss on their value digits and answer line, which may read a hidden key.
    """
    batch, length = labels.shape
    labelled = labels != -100
    start = torch.where(labelled.any(1), labelled.int().argmax(1), length)
    rates = torch.rand(batch, generator=generator) * rate
    rates[torch.rand(batch, generator=generator) < clean] = 0.0
    windows = torch.randint(window[0], window[1] + 1, (batch,), generator=generator)
    pos = torch.arange(length)
    real = mask.bool().cpu()
    dropped = (torch.rand(batch, length, generator=generator) < rates[:, None]) & (pos >= start[:, None]) & real
    distance = pos[:, None] - pos[None, :]  # query minus key
    far = distance[None] >= windows[:, None, None]
    hidden = dropped[:, None, :] & far
    if whole is not None:
        hidden &= ~whole.bool().cpu()[:, :, None]
    keep = (distance >= 0)[None] & real[:, None, :] & ~hidden
    return keep[:, None], hidden.flatten(1).any(1)


def weighted_loss(logits: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, the mean over the labelled tokens weighted by ``weight``
    (one per label); with weights of 1, the plain mean that ``transformers`` computes
    from ``labels``. A batch with no weight left (``--drop-unscored`` can unscore a
    one-sequence batch whole) gives a zero loss, not 0/0."""
    target = labels[:, 1:]
    weight = weight[:, 1:] * (target != -100)
    ce = torch.nn.functional.cross_entropy(logits[:, :-1].float().transpose(1, 2), target, reduction="none")
    return (ce * weight).sum() / weight.sum().clamp(min=1e-6)


def _prev_token_head(model: Qwen3ForCausalLM) -> None:
    """Start layer 0's first query head (and its KV head) as a previous-token head.

    A lookup (find the name, copy what follows) is an induction head, which needs a head
    that moves each token's predecessor into its position, and the two only get a
    gradient from each other; from a random start the pair formed after 0.7 minutes in
    one run and not within 2-4 minutes in five others (``docs/appendix/training-record.md``,
    runs 12-17). So every token embedding gets a shared direction ``c``, the head's query
    and key read only ``c`` (so they are the same for every token), and their rotary pairs
    are set so that the score peaks at distance 1. Everything trains freely from there.
    Whether this speeds the lookup up is not settled: with it, three runs formed the
    lookup at steps 900-1,650; without it, one run formed it at step 279 and five others
    had not by steps 800-1,260, when they were stopped.
    """
    config = model.config
    d = config.head_dim
    half = d // 2
    emb = model.model.embed_tokens.weight  # tied with the output: a shared shift changes no softmax
    c = torch.randn(config.hidden_size)
    c *= emb.norm(dim=1).mean() / c.norm()
    emb += c
    q, k = torch.zeros(d), torch.zeros(d)
    # The two fastest rotary pairs (angles 1 and ~0.56 per position): q . R(delta) k is
    # then cos(delta - 1) + cos(0.56 (delta - 1)), largest at delta = 1.
    for i in (0, 1):
        angle = config.rope_parameters["rope_theta"] ** (-2 * i / d)
        q[i] = 1.0
        k[i], k[i + half] = math.cos(angle), math.sin(angle)
    attn = model.model.layers[0].self_attn
    read = c / c.norm() ** 2
    attn.q_proj.weight[:d] = torch.outer(q, read)
    attn.k_proj.weight[:d] = torch.outer(k, read)


def _init(config: Qwen3Config, args: argparse.Namespace, seed: int) -> tuple[Qwen3ForCausalLM, torch.optim.Optimizer]:
    """A freshly initialised model (weights from ``seed``) and its optimizer."""
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    model.config._attn_implementation = "sdpa"
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.fill_(args.qk_init)
        if args.prev_token_init:
            _prev_token_head(model)
    model.to(args.device)
    decay = [p for n, p in model.named_parameters() if p.dim() > 1]
    no_decay = [p for n, p in model.named_parameters() if p.dim() <= 1]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.98),
    )
    model.train()
    return model, opt


def _save(
    model: Qwen3ForCausalLM, tok: PreTrainedTokenizerFast, out: Path, args: argparse.Namespace, **stats: Any
) -> dict[str, Any]:
    """Save the model and a ``training.json`` of ``stats`` (the run's, at its end) and the
    run's arguments, returned: the commands read the tasks' operator from it
    (``trained_op``), and a periodic checkpoint without one is graded on ``add`` tasks it
    never learned."""
    model.eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    summary = {**stats, "args": {k: str(v) for k, v in vars(args).items()}}
    (out / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--minutes", type=float, default=40.0)
    p.add_argument("--hidden", type=int, default=SHAPE["hidden"])
    p.add_argument("--layers", type=int, default=SHAPE["layers"])
    p.add_argument("--heads", type=int, default=SHAPE["heads"])
    p.add_argument("--kv-heads", type=int, default=SHAPE["kv_heads"])
    p.add_argument("--head-dim", type=int, default=None, help="per-head width; default hidden // heads")
    p.add_argument("--vocab", type=int, default=512, help="BPE vocabulary cap (the corpus saturates near 420)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--warmup", type=int, default=100, help="optimizer steps of linear warm-up")
    p.add_argument("--decay", type=float, default=0.2, help="final share of the time the learning rate decays")
    p.add_argument("--batch-tokens", type=int, default=2048)
    p.add_argument(
        "--recall-batch-tokens", type=int, default=512, help="warm-up batches: smaller, so more steps per minute"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="torch device; on cuda the forward pass runs in bf16 autocast")
    p.add_argument("--workers", type=int, default=0, help="processes that make batches (0: the training loop does)")
    p.add_argument(
        "--families",
        default=",".join(TRACE_FAMILIES),
        help=f"task families to train on, comma-separated, of {', '.join(FAMILIES)} (the shipped model: the default)",
    )
    p.add_argument(
        "--op",
        choices=OPS,
        default="add",
        help="the statements' operator (shift: digits copied and stepped, no table; kvllm.eval.tasks.OPS)",
    )
    p.add_argument("--top-steps", type=int, default=48, help="longest program of the curriculum")
    p.add_argument(
        "--copy-weight",
        type=float,
        default=1.0,
        help="loss weight of a task chain's copies from the prompt's program (statement and operand names)",
    )
    p.add_argument(
        "--end-weight", type=float, default=1.0, help="loss weight of the line that ends a task chain (</think>)"
    )
    p.add_argument(
        "--shuffle-names", type=float, default=0.0, help="share of task examples with their names permuted at random"
    )
    p.add_argument(
        "--long-share",
        type=float,
        default=0.0,
        help="share of batches of programs of the most steps (--top-steps), the length reason tasks are graded at",
    )
    p.add_argument(
        "--answer-weight",
        type=float,
        default=1.0,
        help="loss weight of a task's answer line (after </think>: the asked name and its value)",
    )
    p.add_argument("--level-up", type=float, default=0.85, help="digit accuracy that raises the task level")
    p.add_argument("--lookup-gate", type=float, default=0.9, help="lookup accuracy that adds a warm-up record")
    p.add_argument("--recall", type=float, default=0.2, help="share of training-only recall examples among tasks")
    p.add_argument("--drill", type=float, default=0.3, help="share of training-only arithmetic drills among tasks")
    p.add_argument("--recall-pairs", type=int, default=6, help="records of the warm-up's last stage (from 2)")
    p.add_argument("--recall-warmup", type=float, default=15.0, help="most minutes of recall-only warm-up")
    p.add_argument(
        "--restart-after", type=float, default=5.0, help="minutes without a 2-record lookup before a fresh start"
    )
    p.add_argument(
        "--prev-token-init",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="start one layer-0 head as a previous-token head",
    )
    p.add_argument("--init-from", type=Path, default=None, help="continue from this saved model (no warm-up)")
    p.add_argument(
        "--floor-until", type=float, default=0.0, help="share of the run by which the task level reaches 1 (0: off)"
    )
    p.add_argument("--qk-init", type=float, default=1.0, help="initial weight of Qwen3's q/k RMSNorms")
    p.add_argument("--log-every", type=float, default=60.0, help="seconds between log lines")
    p.add_argument("--save-every", type=float, default=0.0, help="minutes between snapshots (0: at the end)")
    p.add_argument(
        "--drop-far",
        type=float,
        default=0.0,
        help="most share of generated keys older than a window hidden from later queries (0: off; far_key_mask)",
    )
    p.add_argument(
        "--drop-clean", type=float, default=0.3, help="share of sequences with no key hidden, under --drop-far"
    )
    p.add_argument(
        "--drop-unscored",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="under --drop-far, no loss on the value digits and answer line of sequences that lost keys",
    )
    p.add_argument(
        "--drop-answer-whole",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="under --drop-far, the queries that write the answer line read every key",
    )
    p.add_argument(
        "--drop-window",
        default="32,192",
        help="LO,HI: the range of the per-sequence window of newest keys that --drop-far never hides",
    )
    args = p.parse_args()
    families = tuple(f.strip() for f in args.families.split(",") if f.strip())
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown or not families:
        p.error(f"--families {args.families!r} is invalid: must name some of {', '.join(FAMILIES)}")
    if args.workers < 0:
        p.error(f"--workers {args.workers} is invalid: must be >= 0")
    if not 0.0 <= args.shuffle_names <= 1.0:
        p.error(f"--shuffle-names {args.shuffle_names} is invalid: must be in [0, 1]")
    if not 0.0 <= args.long_share <= 1.0:
        p.error(f"--long-share {args.long_share} is invalid: must be in [0, 1]")
    if not 0.0 <= args.drop_far <= 1.0:
        p.error(f"--drop-far {args.drop_far} is invalid: must be in [0, 1]")
    if not 0.0 <= args.drop_clean <= 1.0:
        p.error(f"--drop-clean {args.drop_clean} is invalid: must be in [0, 1]")
    try:
        drop_window = tuple(int(v) for v in args.drop_window.split(","))
    except ValueError:
        drop_window = ()
    if len(drop_window) != 2 or not 1 <= drop_window[0] <= drop_window[1]:
        p.error(f"--drop-window {args.drop_window!r} is invalid: must be LO,HI with 1 <= LO <= HI")

    tok = (
        build_tokenizer(args.vocab, args.seed, families, args.op)
        if args.init_from is None
        else PreTrainedTokenizerFast.from_pretrained(args.init_from)
    )
    config = model_config(
        len(tok),
        args.hidden,
        args.layers,
        args.heads,
        args.kv_heads,
        args.head_dim,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.eos_token_id,
    )
    model, opt = _init(config, args, args.seed)
    if args.init_from is not None:
        # Continue an earlier run (its weights; the optimizer starts afresh) on the tasks.
        model.load_state_dict(Qwen3ForCausalLM.from_pretrained(args.init_from).state_dict())
    n_params = sum(p.numel() for p in model.parameters())
    print(f"params {n_params / 1e6:.2f}M, vocab {len(tok)}, threads {torch.get_num_threads()}", flush=True)
    digit_ids = torch.tensor(tok.convert_tokens_to_ids(list("0123456789")))
    name_ids = name_token_ids(tok)
    batches = Batches(
        args.workers,
        args.seed,
        (args.batch_tokens, args.recall_batch_tokens),
        tok=tok,
        top_steps=args.top_steps,
        recall=args.recall,
        drill=args.drill,
        name_ids=name_ids,
        digit_ids=digit_ids,
        families=families,
        op=args.op,
        shuffle=args.shuffle_names,
        long=args.long_share,
    )
    digit_ids, name_ids = digit_ids.to(args.device), name_ids.to(args.device)
    # Its own generator: the batches' data stays that of a run without --drop-far.
    drop_gen = torch.Generator().manual_seed(args.seed)
    # bf16 on a GPU (its matrix units); fp32 on the CPU, where bf16 matmuls are emulated.
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=torch.device(args.device).type == "cuda")
    budget = args.minutes * 60
    start = time.perf_counter()
    step, tokens, log_loss, log_n = 0, 0, 0.0, 0
    log_hit, log_digits, log_look, log_lookups = 0, 0, 0, 0
    log_copied, log_copies, log_ended, log_ends, log_answered, log_answers = 0, 0, 0, 0, 0, 0
    # Recall-only warm-up from 2 records up, one more each time the lookup is mostly
    # right; then the tasks, one curriculum level up each step their digits are mostly
    # right. The time floor is off unless asked for (``--floor-until``): a level forced up
    # before the lookup formed diverged (run 11).
    level, digit_ema, lookup_ema = 0.0, 0.0, 0.0
    pairs = 2 if args.init_from is None else args.recall_pairs + 1
    last_log = last_save = attempt_start = start
    attempt, attempt_step = 0, 0
    while (elapsed := time.perf_counter() - start) < budget:
        progress = elapsed / budget
        # Whether and when the lookup forms depends on the initialisation and the data
        # order: it formed at step 279 in one run and at step 1,645 in another, on the
        # same 2-record text. Past a patience, a fresh start is cheaper than waiting.
        if pairs == 2 and time.perf_counter() - attempt_start > 60 * args.restart_after:
            attempt, attempt_step, lookup_ema = attempt + 1, 0, 0.0
            model, opt = _init(config, args, args.seed + attempt)
            attempt_start = time.perf_counter()
            print(
                f"{elapsed / 60:5.1f} min step {step}: no lookup yet, restart {attempt} (seed {args.seed + attempt})",
                flush=True,
            )
        # Constant after warm-up, cosine down to a tenth in the last ``decay`` share only:
        # the copy circuits need many steps at a high rate to form.
        warm = min(1.0, (attempt_step + 1) / args.warmup)
        tail = max(0.0, (progress - (1 - args.decay)) / args.decay)
        lr = args.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * tail)))
        for group in opt.param_groups:
            group["lr"] = lr
        if pairs <= args.recall_pairs:
            if lookup_ema > args.lookup_gate:
                pairs, lookup_ema = pairs + 1, 0.0
                print(f"{elapsed / 60:5.1f} min step {step}: lookup formed, recall with {pairs} records", flush=True)
            if elapsed > 60 * args.recall_warmup:
                pairs = args.recall_pairs + 1
                print(f"{elapsed / 60:5.1f} min step {step}: recall warm-up out of time", flush=True)
            if pairs > args.recall_pairs:
                digit_ema = 0.0
                print(f"{elapsed / 60:5.1f} min step {step}: tasks from now on", flush=True)
        warming = pairs <= args.recall_pairs
        if not warming and digit_ema > args.level_up:
            level = min(1.0, level + 0.01)
        if not warming and args.floor_until > 0:
            # A time floor, for runs whose lookup has formed: without it a model that reads
            # values back but cannot yet add never sees a program longer than 3 steps.
            level = max(level, min(1.0, progress / args.floor_until))
        batch = batches.next(level, pairs if warming else None)
        input_ids, labels, mask, copy, end, answer = (t.to(args.device, non_blocking=True) for t in batch)
        blind = None
        if args.drop_far:
            whole = None
            if args.drop_answer_whole:  # the query at t writes token t + 1: one before each answer token
                whole = torch.zeros_like(answer, dtype=torch.bool)
                whole[:, :-1] = answer[:, 1:].bool()
            attention, lost = far_key_mask(labels, mask, args.drop_far, args.drop_clean, drop_window, drop_gen, whole)
            attention = attention.to(args.device, non_blocking=True)
            if args.drop_unscored:  # what a sequence that lost keys may not see: its values and answer
                blind = lost.to(args.device)[:, None] & (torch.isin(labels, digit_ids) | answer)
        else:
            attention = mask
        with autocast:
            out = model(input_ids=input_ids, attention_mask=attention)
        weight = 1 + (args.copy_weight - 1) * copy + (args.end_weight - 1) * end + (args.answer_weight - 1) * answer
        if blind is not None:
            weight = weight * ~blind
        loss = weighted_loss(out.logits, labels, weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step, attempt_step = step + 1, attempt_step + 1
        tokens += int(mask.sum())
        log_loss += loss.item()
        log_n += 1
        # Teacher-forced accuracy on digit targets (the values copied and computed, the
        # part the format alone does not predict) and on the lookups among them (a digit
        # right after a name: the first digit of a value read back or computed).
        with torch.no_grad():
            target = labels[:, 1:]
            right = out.logits[:, :-1].argmax(-1) == target
            digits = torch.isin(target, digit_ids)
            lookups = digits & torch.isin(input_ids[:, :-1], name_ids)
            hit, n_digits = int((right & digits).sum()), int(digits.sum())
            look, n_lookups = int((right & lookups).sum()), int(lookups.sum())
            log_copied, log_copies = log_copied + int((right & copy[:, 1:]).sum()), log_copies + int(copy.sum())
            log_ended, log_ends = log_ended + int((right & end[:, 1:]).sum()), log_ends + int(end.sum())
            log_answered += int((right & answer[:, 1:]).sum())
            log_answers += int(answer.sum())
            log_hit, log_digits = log_hit + hit, log_digits + n_digits
            log_look, log_lookups = log_look + look, log_lookups + n_lookups
            digit_ema = 0.95 * digit_ema + 0.05 * hit / max(1, n_digits)
            lookup_ema = 0.95 * lookup_ema + 0.05 * look / max(1, n_lookups)
        if time.perf_counter() - last_log > args.log_every:
            now = time.perf_counter() - start
            print(
                f"{now / 60:5.1f} min step {step} loss {log_loss / log_n:.4f} "
                f"digits {log_hit / max(1, log_digits):.3f} lookups {log_look / max(1, log_lookups):.3f} "
                f"copies {log_copied / max(1, log_copies):.3f} ends {log_ended / max(1, log_ends):.3f} "
                f"answers {log_answered / max(1, log_answers):.3f} "
                f"{f'records {pairs}' if pairs <= args.recall_pairs else f'level {level:.2f}'} lr {lr:.2e} "
                f"{tokens / now:.0f} tok/s ({tokens / 1e6:.2f}M tokens)",
                flush=True,
            )
            log_loss, log_n, log_hit, log_digits, log_look, log_lookups = 0.0, 0, 0, 0, 0, 0
            log_copied, log_copies, log_ended, log_ends, log_answered, log_answers = 0, 0, 0, 0, 0, 0
            last_log = time.perf_counter()
        if args.save_every and time.perf_counter() - last_save > 60 * args.save_every:
            _save(model, tok, args.out, args)
            model.train()
            last_save = time.perf_counter()

    wall = time.perf_counter() - start
    batches.close()
    summary = _save(
        model, tok, args.out, args,
        params=n_params, restarts=attempt, steps=step, train_tokens=tokens,
        train_seconds=round(wall, 1), tokens_per_second=round(tokens / wall, 1),
    )  # fmt: skip
    print(json.dumps(summary, indent=2), flush=True)


if __name__ == "__main__":
    main()
