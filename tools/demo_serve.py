"""Demo: start `kvllm serve` on a model, ask one chat question through the openai client,
print the answer and the compression statistics, and stop the server.

Usage: python tools/demo_serve.py [MODEL_DIR]   (default: the shipped model)
"""

from __future__ import annotations

import os
import re
import sys
import time

import httpx
import openai
from transformers import AutoTokenizer

from kvllm.assets import model_path
from kvllm.eval.tasks import THINK, Difficulty, make_task
from kvllm.vllm.launch import start_server, stop, wait_healthy

PORT = 8765


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else str(model_path())
    flags = ["--kv-retention", "0.2", "--kv-window", "128", "--dtype", "float32", "--max-model-len", "4096"]
    flags += ["--gpu-memory-utilization", "0.3", "--enforce-eager"]
    if not AutoTokenizer.from_pretrained(model).chat_template:
        # A chat turn is a task prompt; the template appends the thinking marker.
        flags += ["--chat-template", "{% for m in messages %}{{ m['content'] }}{% endfor %}\n " + THINK]
    server, base = start_server(model, PORT, flags, env=dict(os.environ))
    try:
        up = wait_healthy(server, base, timeout=600)
        print(f"server up in {up:.0f} s")
        # The shipped model reads values back but cannot add: the needle is what it can answer.
        task = make_task("prompt-needle", 7, Difficulty(constants=8, steps=30))
        question = task.prompt.removesuffix(THINK).rstrip()
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none")
        t0 = time.monotonic()
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": question}], max_tokens=1200, temperature=0.0
        )
        elapsed = time.monotonic() - t0
        text = reply.choices[0].message.content
        print("question:", question.splitlines()[0], f"({len(question.splitlines()) - 1} program lines)")
        print("answer tail:", text.strip().splitlines()[-1], f"(expected {task.answer})")
        stats = reply.model_extra["kv_transfer_params"]["kvllm"]
        print(f"{reply.usage.completion_tokens} tokens in {elapsed:.1f} s; compression: {stats}")
        metrics = httpx.get(f"{base}/metrics", timeout=10).text
        # Counters (_total) move with every round; the gauges are what running requests hold now.
        print("\n".join(line for line in metrics.splitlines() if re.match(r"^kvllm:\w+ ", line)))
    finally:
        stop(server)


if __name__ == "__main__":
    main()
