#!/usr/bin/env bash
# One device call on the H200: install the vLLM 0.32.0 bundle WITH MoE kernels and this plugin
# (no pip, no network), run scripts/gpu_hybrid_check.py (tiny Gemma 3, gpt-oss, Mistral-SWA and
# Qwen3-Next models at the real models' head dims: LLM with CUDA graphs, prefix caching, chunked
# prefill; the JSON is written after each architecture), then
# `vllm serve --kv-cache-dtype nvfp4_mixed` once on the gpt-oss model + one completion (eager:
# CUDA graphs are covered by the LLM() check).
#   bash scripts/gpu_hybrid_check.sh            (needs .gpu-bundle-moe: KEEP_MOE=1, ../shared/gpu/README.md)
#   ARCHS="gemma3 mistral" SERVE=0 bash scripts/gpu_hybrid_check.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUNDLE=${VLLM_BUNDLE:-.gpu-bundle-moe}
SITE=/tmp/vllm-site
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv | tee "$OUT/gpu.txt"
eval "$(bash "$REPO/$BUNDLE/install.sh" "$SITE" | tail -n1)" || exit 2
DI="$SITE/vllm_nvfp4-0.1.0.dist-info"  # the plugin's entry point, as gpu_integration_check.sh
mkdir -p "$DI"
printf 'Metadata-Version: 2.1\nName: vllm-nvfp4\nVersion: 0.1.0\n' > "$DI/METADATA"
printf '[vllm.general_plugins]\nnvfp4_mixed = vllm_nvfp4.plugin:register\n' > "$DI/entry_points.txt"
export PYTHONPATH="$REPO:$PYTHONPATH"

cd "$REPO"
timeout ${CHECK_TIMEOUT:-390} python3 scripts/gpu_hybrid_check.py --out "$OUT/hybrid_h200.json" --arch ${ARCHS:-gpt_oss gemma3 qwen3_next mistral} \
  2>&1 | tee "$OUT/hybrid_check.log" | grep -E "RESULT|Error|Traceback|KV policy from|KV-cache layout" | cut -c1-2000
rc_llm=${PIPESTATUS[0]}

rc_serve=skipped
if [ "${SERVE:-1}" != 0 ]; then
  M=$(python3 -c 'from vllm_nvfp4.testing.hybrid_models import build_tiny_hybrid; print(build_tiny_hybrid("gpt_oss", "/tmp/nvfp4-hybrid-models/gpt_oss", qk_gain=0.5))')
  LOG="$OUT/serve.log" HEALTH_TIMEOUT=120 SERVE_ARGS="--kv-cache-dtype nvfp4_mixed --enforce-eager" \
    timeout 150 bash "$BUNDLE/serve_check.sh" "$M" 8123 2>&1 | tee "$OUT/serve_check.txt"
  rc_serve=${PIPESTATUS[0]}
  grep -aE "KV policy from|KV-cache layout|KV cache size" "$OUT/serve.log" | head -4 | cut -c1-300
fi
echo "hybrid_check rc=$rc_llm serve_check rc=$rc_serve"
[ "$rc_llm" = 0 ] && { [ "$rc_serve" = 0 ] || [ "$rc_serve" = skipped ]; }
