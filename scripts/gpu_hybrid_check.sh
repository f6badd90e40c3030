#!/usr/bin/env bash
# Hybrid and sliding-window models with kv_cache_dtype="nvfp4_mixed" on a CUDA GPU with real vLLM:
# scripts/gpu_hybrid_check.py (tiny random-weight gpt-oss, Gemma 3, Qwen3-Next and Mistral-SWA
# models at the real models' head dims: LLM() with CUDA graphs, prefix caching, chunked prefill;
# the JSON is written after each architecture), then `vllm serve --kv-cache-dtype nvfp4_mixed`
# on each model of SERVE_ARCHS and one /v1/completions request each (eager: CUDA graphs are
# covered above).
#
#   pip install vllm==0.32.0 && pip install -e .        (once; gpt-oss and Qwen3-Next need vLLM's MoE kernels)
#   bash scripts/gpu_hybrid_check.sh                    ARCHS="gemma3 mistral" SERVE=0: a subset
#   ARCHS=none SERVE_ARCHS="gemma3 gpt_oss mistral qwen3_next" bash scripts/gpu_hybrid_check.sh
#                                                       only `vllm serve`, each family (also on CPU)
#   CHECK_ARGS=--startup-calibration SERVE=0 bash scripts/gpu_hybrid_check.sh
#                                                       no policy file: the engine calibrates at start-up
#   CHECK_ARGS="--k-perm --dtype float32" SERVE=0 bash scripts/gpu_hybrid_check.sh
#                                                       K channels stored in a random order (k_perm)
#
# Environment: OUT (default out/hybrid), ARCHS (default "gpt_oss gemma3 qwen3_next mistral";
# also gemma3_swa_mix: Gemma 3 with sliding layers of mixed formats; none: skip the LLM()
# checks), SERVE (1), SERVE_ARCHS (default gpt_oss), CHECK_TIMEOUT (seconds for the LLM()
# checks, 390), CHECK_ARGS (more gpu_hybrid_check.py arguments, e.g. --dtype float32), PORT, SERVE_TIMEOUT_S, SERVE_ARGS (serve_check in scripts/gpu_env.sh),
# VLLM_BUNDLE / VLLM_SITE / PYTHON (scripts/gpu_env.sh). Without a CUDA GPU the served models
# keep their CPU head dims (vllm_nvfp4.testing.hybrid_models).
# Writes hybrid_h200.json, hybrid_check.log, serve_<arch>.log, serve_check.txt, gpu.txt to OUT;
# exit 0 when every check passed.
set -uo pipefail
OUT=${OUT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/out/hybrid}
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
cd "$REPO"

rc_llm=skipped
if [ "${ARCHS:-}" != none ]; then
  # shellcheck disable=SC2086
  timeout "${CHECK_TIMEOUT:-390}" "$PYTHON" scripts/gpu_hybrid_check.py --out "$OUT/hybrid_h200.json" \
    --arch ${ARCHS:-gpt_oss gemma3 qwen3_next mistral} ${CHECK_ARGS:-} 2>&1 | tee "$OUT/hybrid_check.log" \
    | grep -E "RESULT|Error|Traceback|KV policy in force|KV-cache layout" | cut -c1-2000
  rc_llm=${PIPESTATUS[0]}
fi

rc_serve=skipped
if [ "${SERVE:-1}" != 0 ]; then
  rc_serve=0
  : > "$OUT/serve_check.txt"
  for arch in ${SERVE_ARCHS:-gpt_oss}; do
    M=$("$PYTHON" - "$arch" <<'PY'
import sys
import torch
from vllm_nvfp4.testing.hybrid_models import GPU_HEAD_DIMS, build_tiny_hybrid
arch = sys.argv[1]
cuda = torch.cuda.is_available()
dim = GPU_HEAD_DIMS[arch] if cuda else None
print(build_tiny_hybrid(arch, f"/tmp/nvfp4-hybrid-models/serve-{arch}", qk_gain=0.5, head_dim=dim))
PY
) || { say "serve: could not build the $arch model"; rc_serve=1; continue; }
    EXTRA=()  # Gated DeltaNet: vLLM's CPU build runs it in bf16; on CUDA its Triton prefill
    if [ "$arch" = qwen3_next ]; then
      EXTRA=(--dtype bfloat16)
      "$PYTHON" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' \
        && EXTRA+=(--additional-config '{"gdn_prefill_backend": "triton"}')
    fi
    say "serve: $arch ($M) ${EXTRA[*]}" | tee -a "$OUT/serve_check.txt"
    SERVE_LOG="$OUT/serve_$arch.log" \
    serve_check "$M" "${EXTRA[@]}" 2>&1 | tee -a "$OUT/serve_check.txt"
    [ "${PIPESTATUS[0]}" = 0 ] || rc_serve=1
  done
fi
say "hybrid_check rc=$rc_llm serve_check rc=$rc_serve"
{ [ "$rc_llm" = 0 ] || [ "$rc_llm" = skipped ]; } && { [ "$rc_serve" = 0 ] || [ "$rc_serve" = skipped ]; }
