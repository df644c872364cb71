#!/bin/bash
# Stage 3 of the second model (kara-reasoner-6l v1): stage 2 continued on the full
# curriculum. Run from the repository root. Stage 2's checkpoint left the tree when this
# one superseded it; it is at commit 7b6caeb (then in docs/training-attempts/, under the
# folder's old name): `git worktree add /tmp/stage2 7b6caeb` brings it back.
set -e
SHAPE="--hidden 192 --layers 6 --heads 8 --kv-heads 2 --head-dim 64"
FAM="--families trace,gen-needle,prompt-needle,reason"
.venv/bin/python tools/train_reasoner.py --out /tmp/r3/stage3 \
    --init-from docs/results/data/training/6l-stages-1-2/checkpoint --minutes 60 \
    --lr 2e-3 --floor-until 0.02 --drill 0.3 --save-every 10 --log-every 60 \
    $SHAPE $FAM --top-steps 84 --batch-tokens 4096 > /tmp/r3/stage3.log 2>&1
