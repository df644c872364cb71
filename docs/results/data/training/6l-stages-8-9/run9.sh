#!/bin/bash
# Stage 9 of the second model (kara-reasoner-6l): stage 8 continued for 40 minutes with
# --end-weight 30, its only change from stage 8's command. Stage 8 follows reason's
# program to its last statement (teacher-forced first-operand copies 0.92, from 0.46),
# but right after that statement it gives the line that ends the chain (" </think>",
# whose first token is the space) a probability of only 0.02-0.13 on 8 test seeds, so
# its free chains run on past the program. That decision comes once per example, about
# 2 of a batch's 4,096 tokens, hence a weight far above the copies' 4.
set -e
SHAPE="--hidden 192 --layers 6 --heads 8 --kv-heads 2 --head-dim 64"
mkdir -p /tmp/r9
.venv/bin/python tools/train_reasoner.py --out /tmp/r9/stage9 --op shift \
    --init-from /tmp/r8/stage8 --minutes 40 \
    --lr 1e-3 --floor-until 0.02 --drill 0.15 --save-every 10 --log-every 60 --copy-weight 4 --end-weight 30 \
    $SHAPE --families reason,reason,gen-needle,gen-needle,trace,prompt-needle \
    --top-steps 84 --batch-tokens 4096 > /tmp/r9/stage9.log 2>&1
