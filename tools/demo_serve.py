"""Demo: start `kvllm serve` on a model (compiled, vLLM's default), ask one held-out reason task through the openai
client twice, with compression off for that request (``{"kvllm": {"off": true}}``) and
with the server's Kara, grade each chain, print it with its compression statistics, and
stop the server.

Usage: python tools/demo_serve.py [MODEL]   (default: the shipped kara-reasoner-6l)
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import httpx
import openai
from transformers import AutoTokenizer

from kvllm.assets import model_path
from kvllm.cli.options import trained_op
from kvllm.eval.statements import grade, program
from kvllm.eval.tasks import CHAT_TEMPLATE, THINK, Difficulty, make_task
from kvllm.vllm.launch import start_server, stop, wait_healthy

PORT = 8765


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else str(model_path("kara-reasoner-6l"))
    # vLLM's default compile mode, as `kvllm serve` runs without --enforce-eager: the
    # server compiles the model before it answers.
    flags = ["--kv-retention", "0.2", "--kv-window", "128", "--dtype", "float32", "--max-model-len", "4096"]
    flags += ["--gpu-memory-utilization", "0.3"]
    if not AutoTokenizer.from_pretrained(model).chat_template:
        # A chat turn is a task prompt; the template appends the thinking marker.
        flags += ["--chat-template", CHAT_TEMPLATE]
    server, base = start_server(model, PORT, flags, env=dict(os.environ))
    try:
        up = wait_healthy(server, base, timeout=600)
        print(f"server up in {up:.0f} s")
        # A held-out reason task of 30 steps, on the operator the model was trained on.
        task = make_task("reason", 7, Difficulty(constants=8, steps=30, op=trained_op(Path(model))))
        question = task.prompt.removesuffix(THINK).rstrip()
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none")
        print("question:", question.splitlines()[0], f"({len(question.splitlines()) - 1} program lines)")
        prog = program(task.prompt)
        for label, settings in (("Full KV (this request's compression off)", {"off": True}), ("Kara, r=0.2", None)):
            t0 = time.monotonic()
            reply = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": question}], max_tokens=1200, temperature=0.0,
                extra_body=None if settings is None else {"kvllm": settings},
            )  # fmt: skip
            elapsed = time.monotonic() - t0
            g = grade(prog, reply.choices[0].message.content)
            ending = "stopped at the program's end" if g.stopped else "did not stop at the program's end"
            print(f"{label}: {g.right} of {g.statements} statements right, {g.extra} extra; {ending}; ", end="")
            print(f"answer {'right' if g.answered else 'wrong'} (expected {prog.answer})")
            stats = (reply.model_extra.get("kv_transfer_params") or {}).get("kvllm")
            print(f"  {reply.usage.completion_tokens} tokens in {elapsed:.1f} s; compression: {stats}")
        metrics = httpx.get(f"{base}/metrics", timeout=10).text
        # Counters (_total) move with every round; the gauges are what running requests hold now.
        print("\n".join(line for line in metrics.splitlines() if re.match(r"^kvllm:\w+ ", line)))
    finally:
        stop(server)


if __name__ == "__main__":
    main()
