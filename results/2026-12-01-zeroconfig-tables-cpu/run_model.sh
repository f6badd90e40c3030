#!/usr/bin/env bash
# One model's table: tune (default budget 0.62) and a calibrated all-FP8 policy on the first Brown
# tokens, then five vLLM engines scored on the last Brown tokens (held out) and passkey prompts.
# usage: [TUNE_ARGS='...'] [CALIB_WINDOW=N (tune's --window)] run_model.sh MODEL_DIRNAME OUT_NAME [extra eval_accuracy.py args]
set -euo pipefail
A=${VLLM_NVFP4_ASSETS:-$HOME/.cache/vllm-nvfp4/assets}
M=$A/$1; B=$A/brown/brown.txt
R=$(cd "$(dirname "$0")" && pwd)/$2; shift 2
mkdir -p "$R/policies"
if [ ! -f "$R/policies/tune.json" ]; then
  nice -n 10 vllm-nvfp4 tune "$M" --data "$B" --dtype float32 --device cpu --report "$R/tune_report" \
      ${TUNE_ARGS:-} > "$R/tune.log" 2>&1
  mv "$M/nvfp4_policy.json" "$R/policies/tune.json"   # flag_only must find no policy next to the model
fi
[ -f "$R/policies/ours_fp8.json" ] || nice -n 10 vllm-nvfp4 calibrate "$M" --data "$B" --k-center \
    --policy '*:fp8' --window ${CALIB_WINDOW:-2048} --windows 1 --dtype float32 --device cpu --out "$R/policies/ours_fp8.json" \
    > "$R/calibrate_fp8.log" 2>&1
VLLM_NVFP4_CACHE=$R/startup_cache nice -n 10 python scripts/eval_accuracy.py "$M" --text "$B" \
    --configs auto,flag_only,mixed_calibrated,ours_fp8,nvfp4_all --policy "$R/policies/tune.json" \
    --fp8-policy "$R/policies/ours_fp8.json" --dtype float32 --out "$R/eval" "$@" > "$R/eval.log" 2>&1
