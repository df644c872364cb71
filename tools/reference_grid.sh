#!/usr/bin/env bash
# The side-by-side grid: both models x both families, reference-forced (kvllm eval
# --reference-forced: each task's own chain of thought forced through every cache), every
# method at its reference defaults, on the held-out test seeds 0-63. Resumable: rerun to
# continue where it stopped; a rerun on the stored cells runs none.
#   tools/reference_grid.sh [OUT] [STAGE...]   stages: r02 tuned reason trace frontier bound (default: all, in that order)
# Models, both shipped: tiny = kara-reasoner-tiny (4 layers, head_dim 32, 6/2 heads); 6l =
# kara-reasoner-6l, the second model (6 layers, head_dim 64, 8/2 heads; its card).
# The tiny model was never trained on reason: its reason cell is Full KV alone, to show it
# (docs/guide/evaluation.md, "The reason family").
set -euo pipefail
OUT=${1:-docs/results/data/accuracy/reference-forced}
shift || true
STAGES=${*:-r02 tuned reason trace frontier bound}
KV=${KV:-.venv/bin/kvllm}
SIXL=kara-reasoner-6l
METHODS=kara,kara-causal,kara-topk,snapkv,pyramidkv,adakv,chunkkv,h2o,streamingllm,rkv,kara-vpool,noncausal-attn
# At the other retentions: Kara, its two ablations and the paper's four baselines (claims
# (b) and (c)); the oracle only at r=0.2, where its Full-KV pass took 7 minutes on reason.
CLAIMS=kara,kara-causal,kara-topk,snapkv,pyramidkv,adakv,chunkkv
FRONTIER=kara,kara-topk,snapkv,pyramidkv,adakv,chunkkv
# The second model's development sweep (docs/results/data/accuracy/reference-forced/6l-dev-sweep.md: tools/dev_sweep.py
# --variants second-model --batch-size 8, 32 development seeds, r=0.2, on kara-reasoner-6l v2),
# each method's best non-modal variant (Kara's rho=0.75 ties rho=0.75 max_gap=4; the first listed).
TUNED="--param kara:rho=0.75 --param snapkv:obs_window=64 --param chunkkv:chunk_size=2
  --param pyramidkv:obs_window=64 --param adakv:obs_window=64"
# Trace as in tools/accuracy_grid.sh (48 steps, 8 constants); reason at its defaults (84, 6).
TRACE=(--family trace --steps 48 --constants 8)
REASON=(--family reason)
run() {  # MODEL_DIR LABEL FAMILY_FLAGS... -- EVAL_FLAGS...
  local model=$1 label=$2 fam=() ; shift 2
  while [[ $1 != -- ]]; do fam+=("$1"); shift; done; shift
  "$KV" eval --model "$model" --out "$OUT/$label" --n 64 --batch-size 8 --reference-forced "${fam[@]}" "$@"
}
for stage in $STAGES; do
  case $stage in
    r02)  # every column at r=0.2 first: the side-by-side table
      run "$SIXL" 6l "${REASON[@]}" -- --method "$METHODS,oracle" --retention 0.2,1.0
      run "$SIXL" 6l "${TRACE[@]}" -- --method "$METHODS,oracle" --retention 0.2,1.0
      run kara-reasoner-tiny tiny "${TRACE[@]}" -- --method "$METHODS,oracle" --retention 0.2,1.0
      run kara-reasoner-tiny tiny "${REASON[@]}" -- --method kara --retention 1.0 ;;
    tuned)  # tools/dev_sweep.py's choices on the second model's development seeds (docs/results/accuracy.md)
      "$KV" eval --model "$SIXL" --out "$OUT/6l-tuned" --n 64 --batch-size 8 --reference-forced "${REASON[@]}" \
        --method kara,snapkv,pyramidkv,adakv,chunkkv --retention 0.2,0.05,0.1,0.3,0.5 $TUNED ;;
    reason)  # the realistic family at the other retentions, the lower first
      for r in 0.1,0.3 0.05,0.5; do run "$SIXL" 6l "${REASON[@]}" -- --method "$CLAIMS" --retention $r; done ;;
    trace)
      for r in 0.1,0.3 0.05,0.5; do
        run "$SIXL" 6l "${TRACE[@]}" -- --method "$CLAIMS" --retention $r
        run kara-reasoner-tiny tiny "${TRACE[@]}" -- --method "$CLAIMS" --retention $r
      done ;;
    frontier)  # the second model over W/b (the accuracy-memory frontier), reason first; no oracle
      # (7 minutes a cell on reason), and kara-causal only at W=128, b=32 (claim (c))
      for fam in REASON TRACE; do
        for wb in "64 16" "256 64"; do
          read -r w b <<<"$wb"
          if [[ $fam == REASON ]]; then flags=("${REASON[@]}"); else flags=("${TRACE[@]}"); fi
          run "$SIXL" 6l "${flags[@]}" -- --window "$w" --buffer "$b" --method "$FRONTIER" --retention 0.05,0.2,0.5
        done
      done ;;
    bound)  # the reachable bound (the grammar, not the future) beside the oracle, and the
      # learned kara-retain with the model's shipped file, on the realistic column at r=0.2
      run "$SIXL" 6l "${REASON[@]}" -- --method bound,kara-retain --retention 0.2 \
        --calibration kvllm/assets/kara-reasoner-6l/calibration/kara-retain.safetensors ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done
