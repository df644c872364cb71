#!/bin/bash
# Stage 6 of the second model (issue 22): session 14's stage 5b with one change. It
# starts from session 11's stage 3 (which read the prompt at 1.000 on add tasks), not
# from the drill-only stage 5a, so the shift is learned from the drills mixed with the
# tasks and the recall examples from the first step, and the lookups keep training.
# Session 16 ran it for 3 minutes and stopped it, unevaluated, to give the CPU to the
# reference-forced grid (docs/training-attempts.md, "Session 16"): not a result.
set -e
cd /work/main
SHAPE="--hidden 192 --layers 6 --heads 8 --kv-heads 2 --head-dim 64"
mkdir -p /tmp/r6
.venv/bin/python tools/train_reasoner.py --out /tmp/r6/stage6 --op shift \
    --init-from kvllm/assets/kara-reasoner-6l --minutes 60 \
    --lr 2e-3 --floor-until 0.02 --drill 0.3 --save-every 10 --log-every 60 \
    $SHAPE --families trace,gen-needle,prompt-needle,reason --top-steps 84 --batch-tokens 4096 > /tmp/r6/stage6.log 2>&1
