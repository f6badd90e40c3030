#!/usr/bin/env bash
# End-to-end benchmark on a CUDA GPU: python -m benchmarks.e2e with the given arguments.
#
#   pip install vllm==0.32.0 && pip install -e .        (once)
#   bash scripts/gpu_bench_e2e.sh --dtypes fp8,nvfp4-mixed --contexts 32k
#   bash scripts/gpu_bench_e2e.sh --dtypes none --serve fp8,nvfp4-mixed
#
# Environment: MODULE (default benchmarks.e2e; scripts/gpu_serving.sh runs benchmarks.serving
# and its soak through this script), OUT (result folder, default out/e2e), BUDGET_S (optional: wall-clock seconds for
# everything this script does; the benchmark gets what is left minus 30 s for its summary),
# VLLM_BUNDLE / VLLM_SITE / PYTHON (see scripts/gpu_env.sh). The arguments are those of
# `python -m benchmarks.e2e --help`; the output is described in benchmarks/e2e/__init__.py.
set -uo pipefail
T0=$SECONDS
OUT=${OUT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/out/e2e}
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
exec > >(tee -a "$OUT/run.log") 2>&1
cd "$REPO"
BUDGET_ARGS=()
if [ -n "${BUDGET_S:-}" ]; then
  LEFT=$((BUDGET_S - (SECONDS - T0) - 30))
  [ "$LEFT" -gt 120 ] || die "only ${LEFT}s of BUDGET_S=$BUDGET_S left for the run"
  BUDGET_ARGS=(--budget-s "$LEFT")
fi
MODULE=${MODULE:-benchmarks.e2e}
say "python -m $MODULE --out $OUT ${BUDGET_ARGS[*]} $*"
"$PYTHON" -m "$MODULE" --out "$OUT" "${BUDGET_ARGS[@]}" "$@"
rc=$?
say "finished, rc $rc; files in $OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
exit $rc
