#!/bin/bash
# Stage 8 of the second model (kara-reasoner-6l): stage 7 continued for 60 minutes
# with --copy-weight 4, its only change from stage 7's command. Teacher-forced on 8 test
# seeds, stage 7 copied a reason statement's first operand name from the prompt right
# only 0.46 of the time (the second 0.98; trace: 0.78 and 0.98), so its free chains left
# the program within the first 20 statements and, off it, ran past the program's last
# statement instead of stopping. (It predicts </think> with probability 1.00 where the
# target has it, which seemed to say it knew where to stop; but that token always follows
# the end line's first token, a space, and the space is the decision: see run9.sh.) A
# weight of 4 on the copied names and </think> (about 3 of a statement line's 18 tokens)
# makes them a bit under half the loss.
# Stage 8 ran at e535041, where the copies included the </think> token; from 8e48a44 on
# they do not (that token always follows the end line's space, --end-weight's mark).
set -e
SHAPE="--hidden 192 --layers 6 --heads 8 --kv-heads 2 --head-dim 64"
mkdir -p /tmp/r8
.venv/bin/python tools/train_reasoner.py --out /tmp/r8/stage8 --op shift \
    --init-from docs/results/data/training/6l-stage-7/checkpoint --minutes 60 \
    --lr 1e-3 --floor-until 0.02 --drill 0.15 --save-every 10 --log-every 60 --copy-weight 4 \
    $SHAPE --families reason,reason,gen-needle,gen-needle,trace,prompt-needle \
    --top-steps 84 --batch-tokens 4096 > /tmp/r8/stage8.log 2>&1
