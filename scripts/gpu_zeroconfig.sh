#!/usr/bin/env bash
# Zero-config timings on a CUDA GPU at the Llama-3.1-8B shape (studies/time_zeroconfig.py):
#   1. engine start with kv_cache_dtype=nvfp4_mixed and no policy: start-up calibration off,
#      calibrating (empty cache), cached, REPEATS rounds -> OUT/startup.json (medians; target:
#      <= 10 s added; WARMUP=N: N calibrating starts first, which fill the compile and kernel caches - use 2);
#   2. `vllm-nvfp4 analyze` of random bf16 weights on the GPU, ANALYZE_WINDOWS scored windows
#      (default 2, analyze's; fewer: the time at 2 is extrapolated) -> OUT/analyze.json
#      (target: <= 10 min at 2). Needs ~16 GB of disk in OUT for the weights.
#
#   pip install vllm==0.32.0 && pip install -e ".[calibrate]"    (once; or VLLM_BUNDLE, see gpu_env.sh)
#   bash scripts/gpu_zeroconfig.sh                  STEPS="startup analyze" (default both)
#
# Environment: OUT (default out/zeroconfig), PRESET (llama8b; tiny: a CPU dry run with DEVICE=cpu),
# DEVICE (analyze's, default cuda), LOG_COMPILES (set: a line per Triton kernel compile in each start's log), KINDS (the starts of a round, default "off calibrating cached"), ANALYZE_WINDOWS (2), WARMUP (unset), REPEATS (1), STEPS, VLLM_BUNDLE / VLLM_SITE / PYTHON (see scripts/gpu_env.sh).
# Exit 0 when every step ran.
set -uo pipefail
OUT=${OUT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/out/zeroconfig}
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
cd "$REPO"
rc=0
for step in ${STEPS:-startup analyze}; do
  say "step $step"
  "$PYTHON" -m studies.time_zeroconfig "$step" --out "$OUT" --preset "${PRESET:-llama8b}" \
    --device "${DEVICE:-cuda}" --windows "${ANALYZE_WINDOWS:-2}" ${WARMUP:+--warm-ups $WARMUP} \
    --repeats "${REPEATS:-1}" ${KINDS:+--kinds $KINDS} ${LOG_COMPILES:+--log-compiles} \
    2>&1 | tee "$OUT/$step.log" | grep --line-buffered -E "time_zeroconfig|calibrat|Error|Traceback|added_s|wall_s" | cut -c1-600
  [ "${PIPESTATUS[0]}" -eq 0 ] || { say "step $step FAILED (see $OUT/$step.log)"; rc=1; }
done
rm -rf "$OUT/model"  # the 16 GB of random weights
exit $rc
