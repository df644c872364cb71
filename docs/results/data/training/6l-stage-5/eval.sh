#!/bin/bash
# The second model's Full-KV bars on held-out (test) seeds, free-running, hf backend, with the
# shift operator the stage was trained on. Run from the repository root.
M=${1:-/tmp/r5/stage5b}
O=${2:-/tmp/r5}
.venv/bin/kvllm eval --model $M --out $O/eval-trace --family trace,gen-needle --steps 48 --n 16 --method kara --retention 1.0 --op shift > $O/eval-trace.log 2>&1
.venv/bin/kvllm eval --model $M --out $O/eval-reason --family reason --n 16 --method kara --retention 1.0 --op shift > $O/eval-reason.log 2>&1
