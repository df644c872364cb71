#!/bin/bash
# Stages 10a and 10b of the second model (kara-reasoner-6l), both at once on one H200 GPU, in one
# call of at most 15 minutes (the machine's start included). Both continue stage 7
# (stage 8's checkpoint was lost) with stage 8's --copy-weight 4 and an --end-weight of
# 10, on 32,768-token batches (stage 8: 4,096) made by 6 worker processes each, in bf16
# autocast. They differ in one flag: 10b permutes the names of half its task examples
# (--shuffle-names 0.5), so that the next statement's name must be read from the
# prompt's next line (which, after the last statement, is the thinking marker) rather
# than taken as the next name of NAMES; stages 7 and 8 never stopped at the program's
# end (docs/appendix/training-record.md, "Stages 8 and 9"). Logs and checkpoints go to
# $OUT, the checkpoints as split tarballs (files of at most 16 MiB came back from the
# machine; a checkpoint is 16.1 MiB). Run from the repository root.
: "${OUT:?set OUT to the folder for the logs and checkpoints}"
MIN=${MIN:-7.5}
export PYTHONPATH=. TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
COMMON="--op shift --init-from docs/results/data/training/6l-stage-7/checkpoint --minutes $MIN
    --lr 1e-3 --floor-until 0.02 --drill 0.15 --save-every 2 --log-every 20 --copy-weight 4 --end-weight 10
    --hidden 192 --layers 6 --heads 8 --kv-heads 2 --head-dim 64
    --families reason,reason,gen-needle,gen-needle,trace,prompt-needle --top-steps 84
    --batch-tokens 32768 --device cuda --workers 6"
mkdir -p /tmp/g
LIMIT=$(python3 -c "print(int($MIN * 60 + 90))")
timeout $LIMIT python3 tools/train_reasoner.py --out /tmp/g/stage10a $COMMON > $OUT/stage10a.log 2>&1 &
timeout $LIMIT python3 tools/train_reasoner.py --out /tmp/g/stage10b $COMMON --shuffle-names 0.5 > $OUT/stage10b.log 2>&1 &
sleep 60; nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader; uptime
wait
for s in stage10a stage10b; do
    tail -4 $OUT/$s.log | head -2
    tar czf /tmp/g/$s.tgz -C /tmp/g $s && split -b 15m /tmp/g/$s.tgz $OUT/$s.tgz.
done
ls -l $OUT
