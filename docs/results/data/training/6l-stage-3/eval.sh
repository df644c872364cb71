#!/bin/bash
# The second model's Full-KV bars on held-out (test) seeds, free-running, hf backend.
# Run from the repository root.
M=${1:-/tmp/r3/stage3}
O=${2:-/tmp/r3}
.venv/bin/kvllm eval --model $M --out $O/eval-trace --family trace,gen-needle --steps 48 --n 16 --method kara --retention 1.0 > $O/eval-trace.log 2>&1
.venv/bin/kvllm eval --model $M --out $O/eval-reason --family reason --n 16 --method kara --retention 1.0 > $O/eval-reason.log 2>&1
