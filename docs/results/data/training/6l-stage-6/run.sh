#!/bin/bash
# Stage 6 of the second model (kara-reasoner-6l): stage 5b's command started from stage 3
# (kara-reasoner-6l v1, which reads the prompt at 1.000 on add tasks) instead of the
# drill-only 5a, so the shift operator is learned from drills mixed with the tasks and the
# recall examples from the first step, and the lookups keep training. Prepared for 60
# minutes, run for 45: what the CPU had left beside the reference-forced grid.
# Run from the repository root.
set -e
SHAPE="--hidden 192 --layers 6 --heads 8 --kv-heads 2 --head-dim 64"
mkdir -p /tmp/r6
.venv/bin/python tools/train_reasoner.py --out /tmp/r6/stage6 --op shift \
    --init-from kvllm/assets/kara-reasoner-6l --minutes 45 \
    --lr 2e-3 --floor-until 0.02 --drill 0.3 --save-every 10 --log-every 60 \
    $SHAPE --families trace,gen-needle,prompt-needle,reason --top-steps 84 --batch-tokens 4096 > /tmp/r6/stage6.log 2>&1
