#!/bin/bash
# Claim (a), free-running, on stage 7 (which meets the trace and gen-needle
# bars and misses reason's: Full KV 0.962 on 16 seeds): reason, the 64 test seeds, r=0.2
# against Full KV, W=128 b=32 P=16, every method at its reference defaults; SnapKV and
# PyramidKV for (b) free-running beside it. Run from the repository root.
M=${1:-/tmp/r7/stage7}
O=${2:-/tmp/r7}
.venv/bin/kvllm eval --model $M --out $O/claim-a --family reason --n 64 --op shift \
    --method kara,snapkv,pyramidkv --retention 0.2,1.0 > $O/claim-a.log 2>&1
