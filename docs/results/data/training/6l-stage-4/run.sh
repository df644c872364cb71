#!/bin/bash
# Stage 4 of the second model: stage 3 continued, alone on the CPU, with gen-needle and
# reason weighted twice (the two families whose bars stage 3 missed). Its output,
# /tmp/r4/stage4, is not stored: it is worse than stage 3 (docs/appendix/training-record.md,
# "Stage 4"). Run from the repository root.
set -e
SHAPE="--hidden 192 --layers 6 --heads 8 --kv-heads 2 --head-dim 64"
FAM="--families trace,gen-needle,gen-needle,prompt-needle,reason,reason"
.venv/bin/python tools/train_reasoner.py --out /tmp/r4/stage4 \
    --init-from docs/results/data/training/6l-stage-3/checkpoint --minutes 55 \
    --lr 2e-3 --floor-until 0.02 --drill 0.2 --save-every 10 --log-every 60 \
    $SHAPE $FAM --top-steps 84 --batch-tokens 4096 > /tmp/r4/stage4.log 2>&1
