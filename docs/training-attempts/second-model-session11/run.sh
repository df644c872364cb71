#!/bin/bash
# Stage 3 of the second model: continue session 10's stage 2 on the full curriculum.
# Its --init-from checkpoint is docs/training-attempts/second-model-session10/checkpoint as
# of commit 7b6caeb (removed from the tree since: this stage's checkpoint supersedes it);
# `git worktree add /tmp/s10 7b6caeb` brings it back.
set -e
cd /work/main
SHAPE="--hidden 192 --layers 6 --heads 8 --kv-heads 2 --head-dim 64"
FAM="--families trace,gen-needle,prompt-needle,reason"
.venv/bin/python tools/train_reasoner.py --out /tmp/r3/stage3 \
    --init-from docs/training-attempts/second-model-session10/checkpoint --minutes 60 \
    --lr 2e-3 --floor-until 0.02 --drill 0.3 --save-every 10 --log-every 60 \
    $SHAPE $FAM --top-steps 84 --batch-tokens 4096 > /tmp/r3/stage3.log 2>&1
