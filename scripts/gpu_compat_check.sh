#!/usr/bin/env bash
# kv_cache_dtype="nvfp4_mixed" with speculative decoding (EAGLE, draft model, ngram), native KV
# offloading, disaggregated prefill (ExampleConnector) and, on 2 GPUs, pipeline parallel:
# scripts/gpu_compat_check.py (see its docstring for every check).
#
#   pip install vllm==0.33.0 && pip install -e .        (once; offline: VLLM_BUNDLE, see gpu_env.sh)
#   bash scripts/gpu_compat_check.sh                    PHASES=pp on a 2-GPU machine
#
# Environment: OUT (default out/compat), PHASES (default eagle,draft,ngram,offload,pd),
# TIMEOUT_S (570), SPEC_PROMPTS (64: prompts of the speculative phases), VLLM_BUNDLE / VLLM_SITE / PYTHON (see scripts/gpu_env.sh).
# Writes compat_check.json and compat_check.log to OUT; exit 0 when every phase passed.
set -uo pipefail
OUT=${OUT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/out/compat}
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
cd "$REPO"
timeout "${TIMEOUT_S:-570}" "$PYTHON" scripts/gpu_compat_check.py \
  --phases "${PHASES:-eagle,draft,ngram,offload,pd}" --spec-prompts "${SPEC_PROMPTS:-64}" --out "$OUT/compat_check.json" 2>&1 \
  | tee "$OUT/compat_check.log" | grep -E "^PHASE|^RESULT|Traceback|Error" | cut -c1-3000
exit "${PIPESTATUS[0]}"
