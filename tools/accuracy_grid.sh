#!/usr/bin/env bash
# The shipped tiny model's accuracy grid (docs/results/accuracy.md), on the held-out test seeds 0-63.
# Resumable: rerun to continue where it stopped. The baselines' knobs are the ones
# tools/dev_sweep.py chose on development seeds (docs/appendix/accuracy-record.md, "Tuning record").
#   tools/accuracy_grid.sh [OUT] [STAGE...]   stages: tf frontier free recall methods23 (default: all)
# methods23 writes to M23 (docs/results/data/accuracy/tiny-trace-more-methods): the further methods, teacher-forced at
# W=128, b=32, at their reference defaults (test/) and at the knobs the development sweep
# chose (tuned/). Only trace: the shipped model was never trained on reason (docs/results/accuracy.md).
set -euo pipefail
OUT=${1:-docs/results/data/accuracy/tiny-trace}
shift || true
STAGES=${*:-tf frontier free recall methods23}
M23=${M23:-docs/results/data/accuracy/tiny-trace-more-methods}
KV=${KV:-.venv/bin/kvllm}
METHODS=adakv,chunkkv,h2o,kara,kara-causal,kara-far,kara-late,kara-topk,pyramidkv,random,rkv,snapkv,streamingllm
ALL=0.05,0.1,0.2,0.3,0.5,1.0

# The development sweep's observation windows were chosen at W=128, b=32 (160 window
# queries); at another W and b each keeps its share of the W + b queries.
declare -A OBS=([snapkv]=96 [chunkkv]=96 [pyramidkv]=128 [adakv]=64 [rkv]=32 [kara-late]=64)
declare -A OTHER=([chunkkv]="chunk_size=2" [rkv]="lam=0.3")
tuned() {  # METHODS W b -> --param flags for the methods among METHODS
  local span=$(($2 + $3)) m
  for m in ${1//,/ }; do
    if [[ -n ${OBS[$m]:-} ]]; then echo "--param $m:obs_window=$((OBS[$m] * span / 160))"; fi
    if [[ -n ${OTHER[$m]:-} ]]; then echo "--param $m:${OTHER[$m]}"; fi
  done
}
E=("$KV" eval --out "$OUT" --n 64 --steps 48 --constants 8)
for stage in $STAGES; do
  case $stage in
    tf)
      # shellcheck disable=SC2046
      "${E[@]}" --family trace --batch-size 32 --teacher-forced --method "$METHODS,oracle" --retention $ALL \
        $(tuned "$METHODS" 128 32) ;;
    frontier)
      for wb in "64 16" "256 64"; do
        read -r w b <<<"$wb"
        # shellcheck disable=SC2046
        "${E[@]}" --family trace --window "$w" --buffer "$b" --batch-size 32 --teacher-forced \
          --method "$METHODS,oracle" --retention 0.05,0.2,0.5 $(tuned "$METHODS" "$w" "$b")
      done ;;
    free)
      # Three retentions: a free cell takes 40-50 s here, so all five would take an hour.
      # shellcheck disable=SC2046
      "${E[@]}" --family trace --batch-size 64 --method "$METHODS" --retention 0.1,0.2,0.5,1.0 \
        $(tuned "$METHODS" 128 32) ;;
    recall)
      m=kara,kara-far,kara-late,snapkv,chunkkv,h2o,pyramidkv
      # shellcheck disable=SC2046
      "${E[@]}" --family gen-needle --batch-size 64 --method $m --retention 0.2,1.0 $(tuned $m 128 32) ;;
    methods23)
      m=knorm,keydiff,tova,lagkv,kara-twoway,noncausal-attn,compactor,expected-attention,kara-vnorm,kara-pool
      m+=,kara-vpool,qfilter,kara
      cal=$M23/test/q_filters.safetensors
      [[ -f $cal ]] || "$KV" calibrate --out "$cal"
      T=("$KV" eval --n 64 --steps 48 --constants 8 --family trace --batch-size 32 --teacher-forced
        --retention 0.05,0.1,0.2,0.3,0.5)
      "${T[@]}" --out "$M23/test" --method "$m" --calibration "$cal"
      "${T[@]}" --out "$M23/test" --method bound,oracle
      # tools/dev_sweep.py's choices (docs/appendix/accuracy-record.md, "Tuning record"), on non-modal fidelity.
      "${T[@]}" --out "$M23/tuned" --method kara-vpool,lagkv,compactor,kara-vnorm,kara-pool \
        --param kara-vpool:pool_kernel=7 --param kara-vpool:rho=0.75 --param kara-vpool:max_gap=4 \
        --param lagkv:lag_size=64 --param compactor:blending=0.0 \
        --param kara-vnorm:rho=0.75 --param kara-vnorm:max_gap=4 \
        --param kara-pool:pool_kernel=7 --param kara-pool:rho=0.75 --param kara-pool:max_gap=4 ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done
