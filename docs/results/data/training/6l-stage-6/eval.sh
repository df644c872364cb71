#!/bin/bash
# The second model's Full-KV bars on held-out (test) seeds, free-running, hf backend, with the
# shift operator stage 6 was trained on (stage 5's eval.sh, for stage 6). Run from the
# repository root.
M=${1:-/tmp/r6/stage6}
O=${2:-/tmp/r6}
.venv/bin/kvllm eval --model $M --out $O/eval-trace --family trace,gen-needle --steps 48 --n 16 --method kara --retention 1.0 --op shift > $O/eval-trace.log 2>&1
.venv/bin/kvllm eval --model $M --out $O/eval-reason --family reason --n 16 --method kara --retention 1.0 --op shift > $O/eval-reason.log 2>&1
