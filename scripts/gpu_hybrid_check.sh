#!/usr/bin/env bash
# Hybrid and sliding-window models with kv_cache_dtype="nvfp4_mixed" on a CUDA GPU with real vLLM:
# scripts/gpu_hybrid_check.py (tiny random-weight gpt-oss, Gemma 3, Qwen3-Next and Mistral-SWA
# models at the real models' head dims: LLM() with CUDA graphs, prefix caching, chunked prefill;
# the JSON is written after each architecture), then `vllm serve --kv-cache-dtype nvfp4_mixed`
# once on the gpt-oss model and one /v1/completions request (eager: CUDA graphs are covered above).
#
#   pip install vllm==0.32.0 && pip install -e .        (once; gpt-oss and Qwen3-Next need vLLM's MoE kernels)
#   bash scripts/gpu_hybrid_check.sh                    ARCHS="gemma3 mistral" SERVE=0: a subset
#
# Environment: OUT (default out/hybrid), ARCHS (default "gpt_oss gemma3 qwen3_next mistral"),
# SERVE (1), CHECK_TIMEOUT (seconds for the LLM() checks, 390), PORT, SERVE_TIMEOUT_S, SERVE_ARGS
# (scripts/serve_check.sh), VLLM_BUNDLE / VLLM_SITE / PYTHON (scripts/gpu_env.sh).
# Writes hybrid_h200.json, hybrid_check.log, serve.log, serve_check.txt, gpu.txt to OUT; exit 0
# when every check passed.
set -uo pipefail
OUT=${OUT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/out/hybrid}
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
source "$(dirname "${BASH_SOURCE[0]}")/serve_check.sh"
cd "$REPO"

# shellcheck disable=SC2086
timeout "${CHECK_TIMEOUT:-390}" "$PYTHON" scripts/gpu_hybrid_check.py --out "$OUT/hybrid_h200.json" \
  --arch ${ARCHS:-gpt_oss gemma3 qwen3_next mistral} 2>&1 | tee "$OUT/hybrid_check.log" \
  | grep -E "RESULT|Error|Traceback|KV policy from|KV-cache layout" | cut -c1-2000
rc_llm=${PIPESTATUS[0]}

rc_serve=skipped
if [ "${SERVE:-1}" != 0 ]; then
  M=$("$PYTHON" -c 'from vllm_nvfp4.testing.hybrid_models import build_tiny_hybrid
print(build_tiny_hybrid("gpt_oss", "/tmp/nvfp4-hybrid-models/gpt_oss", qk_gain=0.5, head_dim=64))')
  serve_check "$M" 2>&1 | tee "$OUT/serve_check.txt"
  rc_serve=${PIPESTATUS[0]}
fi
say "hybrid_check rc=$rc_llm serve_check rc=$rc_serve"
[ "$rc_llm" = 0 ] && { [ "$rc_serve" = 0 ] || [ "$rc_serve" = skipped ]; }
