#!/bin/bash
# Stages 11a and 11b of the second model (kara-reasoner-6l), at once on the same H200 in its
# last minutes: stages 10a and 10b (gpu.sh) continued for 2.5 minutes
# with --answer-weight 10, each with its own flags otherwise (11b keeps 10b's
# --shuffle-names 0.5). Both 10s follow reason's program and stop at its end, but
# answer with the right value in 1 (10a) and 6 (10b) of 16 test chains: they write the
# last statement's name and value (trace's and gen-needle's asked variable) where
# reason asks for its first. The answer line is 3 tokens of a 2,000-token example.
# For this call, gpu.sh's two checkpoints were unpacked into $D/stage10a and $D/stage10b
# (untracked, so they travel; not stored: 11a ships as kvllm/assets/kara-reasoner-6l).
MIN=${MIN:-2.5}
export PYTHONPATH=. TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
D=docs/results/data/training/6l-stages-10-11
COMMON="--op shift --minutes $MIN
    --lr 1e-3 --floor-until 0.02 --drill 0.15 --save-every 1 --log-every 20 --copy-weight 4 --end-weight 10
    --answer-weight 10 --hidden 192 --layers 6 --heads 8 --kv-heads 2 --head-dim 64
    --families reason,reason,gen-needle,gen-needle,trace,prompt-needle --top-steps 84
    --batch-tokens 32768 --device cuda --workers 6"
mkdir -p /tmp/g
LIMIT=$(python3 -c "print(int($MIN * 60 + 60))")
timeout $LIMIT python3 tools/train_reasoner.py --out /tmp/g/stage11a --init-from $D/stage10a $COMMON > $OUT/stage11a.log 2>&1 &
timeout $LIMIT python3 tools/train_reasoner.py --out /tmp/g/stage11b --init-from $D/stage10b $COMMON \
    --shuffle-names 0.5 > $OUT/stage11b.log 2>&1 &
wait
for s in stage11a stage11b; do
    tar czf /tmp/g/$s.tgz -C /tmp/g $s && split -b 15m /tmp/g/$s.tgz $OUT/$s.tgz.
done
ls -l $OUT
