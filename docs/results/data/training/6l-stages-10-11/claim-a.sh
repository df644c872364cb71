#!/bin/bash
# Claim (a), free-running, on the shipped kara-reasoner-6l v2 (stage 11a, which
# meets the three Full-KV bars): reason, the 64 test seeds, r=0.2 against Full KV,
# W=128 b=32 P=16, Kara and the paper's four baselines at their reference defaults
# (claim (b) free-running beside it). The tasks' operator comes from the model
# (training.json: shift). Resumable. Run from the repository root.
.venv/bin/kvllm eval --model kara-reasoner-6l --out docs/results/data/accuracy/6l-own-chains --family reason --n 64 \
    --method kara,snapkv,pyramidkv,adakv,chunkkv --retention 0.2,1.0
