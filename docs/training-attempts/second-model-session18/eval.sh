#!/bin/bash
# Issue 22's Full-KV bars on held-out (test) seeds, free-running, hf backend, with the
# shift operator (session 17's eval.sh, for stage 7).
cd /work/main
M=${1:-/tmp/r7/stage7}
O=${2:-/tmp/r7}
.venv/bin/kvllm eval --model $M --out $O/eval-trace --family trace,gen-needle --steps 48 --n 16 --method kara --retention 1.0 --op shift > $O/eval-trace.log 2>&1
.venv/bin/kvllm eval --model $M --out $O/eval-reason --family reason --n 16 --method kara --retention 1.0 --op shift > $O/eval-reason.log 2>&1
