"""Where a Full-KV chain's stop looks: the attention of the query that writes `</think>`.

For each stored Full-KV chain of a `kvllm eval` folder (the statement grid's, by
default), one Full-KV pass over prompt + chain; the query that predicts `</think>`
splits its attention (averaged over layers and KV heads, GQA groups summed) between the
prompt, the generated keys the protected tail holds (the last W + b) and the generated
keys further back, which a compression round may drop; and the tokens further back it
reads most.

    python tools/stop_attention.py [FOLDER] [N] [W+b]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvllm.assets import model_path
from kvllm.eval.grid import FULL, load_results
from kvllm.eval.oracle import full_attention
from kvllm.eval.tasks import END_THINK


def main(folder: Path, n: int, tail: int) -> None:
    cell = next(c for c in load_results(folder / "results.jsonl").values() if c.method == FULL and c.mode == "free")
    path = model_path("kara-reasoner-6l")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    from kvllm.cli.evaluate import family_difficulty
    from kvllm.cli.options import trained_op
    from kvllm.eval.tasks import make_task

    difficulty = family_difficulty(cell.family, None, None, 0.5, trained_op(path))
    end = tokenizer.convert_tokens_to_ids(END_THINK)
    groups = model.config.num_attention_heads // model.config.num_key_value_heads
    print("| seed | chain tokens | on the prompt | on the last W + b | further back | the further tokens read most |")
    print("| ---: | ---: | ---: | ---: | ---: | --- |")
    for problem in cell.problems[:n]:
        ids = problem["ids"]
        prompt = tokenizer(make_task(cell.family, int(problem["uid"]), difficulty).prompt)["input_ids"]
        k = ids.index(end)
        (attention,) = full_attention(model, [prompt + ids[: k + 1]])
        row = attention[:, :, len(prompt) + k - 1] / groups  # the query predicting </think>: [L, Hkv, T]
        p, far_end = len(prompt), max(len(prompt), len(prompt) + k - tail)
        shares = [row[..., a:b].sum(-1).mean().item() for a, b in ((0, p), (far_end, p + k), (p, far_end))]
        far = row[..., p:far_end].sum((0, 1))
        top = [repr(tokenizer.decode([ids[i]])) for i in far.topk(min(6, len(far))).indices.tolist()]
        print(f"| {problem['uid']} | {k} | {shares[0]:.2f} | {shares[1]:.2f} | {shares[2]:.2f} | {', '.join(top)} |")


if __name__ == "__main__":
    args = sys.argv[1:]
    main(
        Path(args[0]) if args else Path("docs/results/data/accuracy/6l-statements"),
        int(args[1]) if len(args) > 1 else 8,
        int(args[2]) if len(args) > 2 else 160,
    )
