"""Which keys does a `reason` chain's stop read? Ablate them from a Full-KV cache.

On development seeds, `kara-reasoner-6l` writes each chain with Full KV (greedy, as
`kvllm eval` does; the chains are kept in the temporary folder between runs). Then, for
each chain, one Full-KV pass over the prompt and the chain fills a cache up to the last
``T`` tokens of the stop's decision: the last statement's line end, after whose `\n` the
model writes ` ` (then `</think>`) where it would otherwise write the next statement's
name. A subset of that cache's keys is removed, and the last T tokens are fed again after
it, at their true positions. The probability of that ` ` after them, P(stop), says whether
the stop survives when those T tokens are computed without the keys. With T = W + b
(160, the default) this is the protected tail after a round that dropped them; with
T = 1 it is the deciding query alone.

    python tools/stop_ablation.py [N] [T] [MODEL]

``MODEL`` is a shipped model's name or a model folder (default ``kara-reasoner-6l``);
Full KV's chains are kept per model weights.

The subsets (``far``: the generated keys before the last T tokens, what a round may drop):

- ``all far``; ``far except newlines``: every far key but line ends; ``far newlines``;
- one line kind at a time (statement, check, restate, hedge, other), and the value
  tokens (two digits) of every far statement;
- ``prompt``: the whole prompt; ``prompt program``: the prompt's statement lines;
  ``prompt literals``: its constants (`la78`); ``prompt and all far``: all but the tail;
- a random 80% of the far keys.
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from kvllm.cli.evaluate import family_difficulty
from kvllm.cli.options import model_path, trained_op
from kvllm.eval import lookup
from kvllm.eval.bound import KINDS, PLACES, token_roles
from kvllm.eval.grid import model_fingerprint
from kvllm.eval.problems import task_problems
from kvllm.eval.tasks import END_THINK

DEV_SEEDS = 100_000  # the first development seed (kvllm eval --dev-seeds)


def chains_file(model) -> Path:
    """Where Full KV's chains of ``model`` are kept between runs: named by its weights."""
    return Path(tempfile.gettempdir()) / f"kvllm-stop-ablation-chains-{model_fingerprint(model)[:16]}.json"


def full_chain(model, prompt: list[int], cap: int, eos: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=cap, do_sample=False, eos_token_id=eos)
    return out[0, len(prompt) :].tolist()


def prefix_cache(model, ids: list[int], tail: int) -> DynamicCache:
    """The Full-KV cache of ``ids`` before its last ``tail`` tokens."""
    with torch.no_grad():
        return model(torch.tensor([ids[:-tail]]), use_cache=True).past_key_values


def stop_probability(model, full: DynamicCache, ids: list[int], keep: torch.Tensor, stop: int, tail: int) -> float:
    """P(``stop``) after the last token of ``ids``, when the last ``tail`` tokens are fed
    (at their true positions) after ``full``, the cache of the tokens before them
    (:func:`prefix_cache`), holding only the positions where ``keep`` is true."""
    head = len(ids) - tail
    cache = DynamicCache()
    for i, layer in enumerate(full.layers):
        cache.update(layer.keys[:, :, keep], layer.values[:, :, keep], i)
    kept = int(keep.sum())
    with torch.no_grad():
        logits = model(
            torch.tensor([ids[head:]]),
            position_ids=torch.arange(head, len(ids)).unsqueeze(0),
            cache_position=torch.arange(kept, kept + tail),
            past_key_values=cache,
        ).logits[0, -1]
    return logits.softmax(-1)[stop].item()


def _lines(tokenizer, ids: list[int]) -> Iterator[tuple[str, int, list[int]]]:
    """Each line of the decoded ``ids``: its text, its first character's offset, and the
    indices of its tokens."""
    text, owner = lookup.char_to_token(tokenizer, ids)
    start = 0
    for line in text.split("\n"):
        yield line, start, sorted({owner[c] for c in range(start, start + len(line))})
        start += len(line) + 1


def subsets(roles: torch.Tensor, prompt_len: int, ids: list[int], tokenizer, tail: int) -> dict[str, torch.Tensor]:
    """Name -> keys to drop (bool over ``ids[:-tail]``, the cache the tail is fed after)."""
    t = len(ids) - tail
    pos = torch.arange(t)
    far = pos >= prompt_len
    kind, place = roles[:t] // PLACES, roles[:t] % PLACES
    newline = far & (place == 0)
    digits = torch.tensor([tokenizer.decode([i]).strip().isdigit() for i in ids[:t]])
    prompt_lines = torch.zeros(t, dtype=torch.bool)
    literals = torch.zeros(t, dtype=torch.bool)
    constants = set()
    for line, _, tokens in _lines(tokenizer, ids[:prompt_len]):
        if " = " in line:  # a statement of the program
            prompt_lines[tokens] = True
        elif m := re.fullmatch(r" ?([a-z]{2})\d{2}", line):  # a literal: `la78`
            literals[tokens] = True
            constants.add(m[1])
    values = far & (kind == 0) & digits
    out = {
        "nothing": torch.zeros(t, dtype=torch.bool),
        "all far": far,
        "far except newlines": far & ~newline,
        "far newlines": newline,
        "far statement values": values,
        "prompt": pos < prompt_len,
        "prompt program": prompt_lines,
    }
    for k, (name, _) in enumerate((*KINDS, ("other", None))):
        out[f"far {name} lines"] = far & (kind == k)
    out["prompt and all far"] = pos < t
    out["prompt literals"] = literals
    results = values & (place <= 2)  # a statement's last two tokens before its newline: `= ku76`
    names = far & (kind == 0) & (place == 3)  # the result's name, ` ku` of `= ku76`
    out["far results"] = results
    out["far operand values"] = values & ~results
    out["far except statement values"] = far & ~values
    out["far except results"] = far & ~results
    out["far except results and their names"] = far & ~results & ~names
    # The operand values of reads of the prompt's constants (`ji49` in `je = ji : ci = ji49 : ci27`).
    chain_owner = lookup.char_to_token(tokenizer, ids[prompt_len:t])[1]
    constant_reads = torch.zeros(t, dtype=torch.bool)
    for line, start, _ in _lines(tokenizer, ids[prompt_len:t]):
        if m := lookup.STATEMENT.match(line):
            for name_group, digit_group in ((5, 6), (8, 9)):
                if m[name_group] in constants:
                    a, b = m.span(digit_group)
                    constant_reads[[prompt_len + chain_owner[start + c] for c in range(a, b)]] = True
    out["far except results and constant reads"] = far & ~results & ~constant_reads
    out["far constant reads"] = far & constant_reads
    # r=0.2's count of far keys, dropped at random: whether the stop needs particular keys
    # or only enough of them.
    generator = torch.Generator().manual_seed(t)
    out["a random 80% of far"] = far & (torch.rand(t, generator=generator) < 0.8)
    return out


def main(n: int, tail: int, name: str = "kara-reasoner-6l") -> None:
    path = model_path(Path(name))
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    difficulty = family_difficulty("reason", None, None, 0.5, trained_op(path))
    problems = task_problems("reason", n, difficulty, tokenizer, first_seed=DEV_SEEDS)
    end = tokenizer.convert_tokens_to_ids(END_THINK)
    table: dict[str, list[float]] = {}
    chains_path = chains_file(model)
    chains = json.loads(chains_path.read_text()) if chains_path.exists() else {}
    for problem in problems:
        prompt = tokenizer(problem.prompt)["input_ids"]
        if str(problem.uid) not in chains:
            chains[str(problem.uid)] = full_chain(model, prompt, problem.max_new_tokens, tokenizer.eos_token_id)
            chains_path.write_text(json.dumps(chains))
        chain = chains[str(problem.uid)]
        if end not in chain:
            print(f"seed {problem.uid}: Full KV did not stop; skipped")
            continue
        # The stop is decided at the line end: after `\n` the model writes ` ` (then `</think>`)
        # instead of the next statement's name.
        ids = prompt + chain[: chain.index(end) - 1]
        if chain.index(end) - 1 <= tail:  # no far key to drop: the whole chain is the tail
            print(f"seed {problem.uid}: Full KV stopped within {tail} tokens; skipped")
            continue
        space = chain[chain.index(end) - 1]
        full = prefix_cache(model, ids, tail)
        with torch.no_grad():  # the cache path with nothing dropped must give the full pass's answer
            whole = model(torch.tensor([ids])).logits[0, -1].softmax(-1)[space].item()
        everything = torch.ones(len(ids) - tail, dtype=torch.bool)
        assert abs(whole - stop_probability(model, full, ids, everything, space, tail)) < 1e-4
        roles = token_roles(tokenizer, len(prompt), ids[len(prompt) :])
        for name, drop in subsets(roles, len(prompt), ids, tokenizer, tail).items():
            table.setdefault(name, []).append(stop_probability(model, full, ids, ~drop, space, tail))
        print(f"seed {problem.uid}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in table.items()), flush=True)
    print("\n| keys dropped | mean P(stop) | chains with P > 0.5 |\n| --- | ---: | ---: |")
    for name, ps in table.items():
        print(f"| {name} | {sum(ps) / len(ps):.3f} | {sum(p > 0.5 for p in ps)}/{len(ps)} |")


if __name__ == "__main__":
    args = sys.argv[1:]
    main(int(args[0]) if args else 8, int(args[1]) if len(args) > 1 else 160, *args[2:3])
