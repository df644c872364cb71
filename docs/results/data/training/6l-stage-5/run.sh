#!/bin/bash
# Stage 5 of the second model (kara-reasoner-6l), on the shift operator (kvllm.eval.tasks.OPS):
# the same programs, with results a model that cannot add can compute.
#   5a (the probe): drills only, from stage 3, 4 minutes, then 6 more.
#   5b: the four families with the shift, from 5a.
# Run from the repository root.
set -e
SHAPE="--hidden 192 --layers 6 --heads 8 --kv-heads 2 --head-dim 64"
mkdir -p /tmp/r5
[ -d /tmp/probe/shift ] || .venv/bin/python tools/train_reasoner.py --out /tmp/probe/shift --op shift \
    --init-from docs/results/data/training/6l-stage-3/checkpoint --minutes 4 \
    --lr 2e-3 --warmup 20 --drill 1.0 --recall 0 --log-every 30 \
    $SHAPE --families trace --top-steps 84 --batch-tokens 1024 > /tmp/r5/stage5a-probe.log 2>&1
.venv/bin/python tools/train_reasoner.py --out /tmp/r5/stage5a --op shift \
    --init-from /tmp/probe/shift --minutes 6 \
    --lr 2e-3 --warmup 20 --drill 1.0 --recall 0 --log-every 30 \
    $SHAPE --families trace --top-steps 84 --batch-tokens 1024 > /tmp/r5/stage5a.log 2>&1
.venv/bin/python tools/train_reasoner.py --out /tmp/r5/stage5b --op shift \
    --init-from /tmp/r5/stage5a --minutes 50 \
    --lr 2e-3 --floor-until 0.02 --drill 0.3 --save-every 10 --log-every 60 \
    $SHAPE --families trace,gen-needle,prompt-needle,reason --top-steps 84 --batch-tokens 4096 > /tmp/r5/stage5b.log 2>&1
