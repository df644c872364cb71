#!/bin/bash
# Stages 1 and 2 of the second model: 6 layers, hidden 192, 8 query / 2 KV heads of 64,
# all four families. Run from the repository root.
set -e
SHAPE="--hidden 192 --layers 6 --heads 8 --kv-heads 2 --head-dim 64"
FAM="--families trace,gen-needle,prompt-needle,reason"
.venv/bin/python tools/train_reasoner.py --out /tmp/r2/stage1 --minutes 28 --save-every 4 --log-every 30 \
    $SHAPE $FAM --top-steps 84 --batch-tokens 4096 > /tmp/r2/stage1.log 2>&1
.venv/bin/python tools/train_reasoner.py --out /tmp/r2/stage2 --init-from /tmp/r2/stage1 --minutes 50 \
    --floor-until 0.6 --drill 0.4 --save-every 5 --log-every 30 \
    $SHAPE $FAM --top-steps 84 --batch-tokens 4096 > /tmp/r2/stage2.log 2>&1
