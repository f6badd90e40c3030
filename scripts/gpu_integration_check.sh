#!/usr/bin/env bash
# Integration check of kv_cache_dtype="nvfp4_mixed" on a CUDA GPU with real vLLM:
# scripts/gpu_integration_check.py (LLM() with CUDA graphs, prefix caching, chunked prefill,
# log-probs against a fake-quantized reference), then `vllm serve --kv-cache-dtype nvfp4_mixed`
# on the same tiny model (its calibrated policy file next to it) and one /v1/completions request.
#
#   pip install vllm==0.32.0 && pip install -e .        (once)
#   bash scripts/gpu_integration_check.sh               SERVE=0: the LLM() checks only
#
# Environment: OUT (default out/integration), MODEL_DIR (the tiny model, default
# /tmp/nvfp4-tiny-h128), PORT (8123), LLM_TIMEOUT_S (900), SERVE_TIMEOUT_S (300: start + request),
# SERVE_ARGS (default --enforce-eager: CUDA graphs are covered by the LLM() check),
# VLLM_BUNDLE / VLLM_SITE / PYTHON (see scripts/gpu_env.sh).
# Writes integration_check.json, llm_check.log, serve.log, serve_check.txt, gpu.txt to OUT;
# exit 0 when every check passed.
set -uo pipefail
OUT=${OUT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/out/integration}
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
cd "$REPO"
MODEL_DIR=${MODEL_DIR:-/tmp/nvfp4-tiny-h128}

timeout "${LLM_TIMEOUT_S:-900}" "$PYTHON" scripts/gpu_integration_check.py --model-dir "$MODEL_DIR" \
  --out "$OUT/integration_check.json" 2>&1 | tee "$OUT/llm_check.log" \
  | grep -E "RESULT|Error|Traceback|KV policy|CUDA graph|Using .*backend" | cut -c1-2000
rc_llm=${PIPESTATUS[0]}

rc_serve=skipped
if [ "${SERVE:-1}" != 0 ]; then
  serve_check "$MODEL_DIR" 2>&1 | tee "$OUT/serve_check.txt"
  rc_serve=${PIPESTATUS[0]}
fi
say "llm_check rc=$rc_llm serve_check rc=$rc_serve"
[ "$rc_llm" = 0 ] && { [ "$rc_serve" = 0 ] || [ "$rc_serve" = skipped ]; }
