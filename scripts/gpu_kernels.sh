#!/usr/bin/env bash
# Kernels on a CUDA GPU: their CUDA tests, then the decode/prefill benchmark.
#
#   pip install vllm==0.32.0 && pip install -e .[test]  (once; vLLM only for the peer kernels)
#   bash scripts/gpu_kernels.sh [all|tests|bench] [benchmarks/bench_decode.py arguments ...]
#   bash scripts/gpu_kernels.sh variants [benchmarks/bench_variants.py arguments ...]
#
# variants: our kernels only, against BEFORE (an older attention.py, default
# benchmarks/_before_attention.py, e.g. from `git show COMMIT:vllm_nvfp4/kernels/attention.py`,
# labelled BEFORE_LABEL), then the kernel tests (TESTS=0: timing only).
# Environment: OUT (default out/kernels), TESTS_TIMEOUT_S (900), TEST_WORKERS (pytest-xdist
# workers, default one per core), VARIANTS_TIMEOUT_S (900),
# VLLM_BUNDLE / VLLM_SITE / PYTHON (see scripts/gpu_env.sh). Logs and JSON go to OUT.
set -uo pipefail
OUT=${OUT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/out/kernels}
REQUIRE_VLLM=0 source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
cd "$REPO"
what=${1:-all}
shift || true
XDIST=()
# the tests are bound by Triton compiles on a fresh machine (H200: ~110 tests in 480 s with 8
# workers and an empty cache): one worker per core
"$PYTHON" -c 'import xdist' 2>/dev/null && XDIST=(-n "${TEST_WORKERS:-$(nproc)}")
kernel_tests() {  # TEST FILES...
  timeout "${TESTS_TIMEOUT_S:-900}" "$PYTHON" -m pytest -q -x "${XDIST[@]}" -p no:cacheprovider "$@" 2>&1 \
    | tee "$OUT/tests.log" | tail -25
}
case $what in
  all|tests|bench) ;;
  variants)
    timeout "${VARIANTS_TIMEOUT_S:-900}" "$PYTHON" benchmarks/bench_variants.py \
      --before "${BEFORE:-benchmarks/_before_attention.py}" --before-label "${BEFORE_LABEL:-before}" \
      --out "$OUT/decode_variants.json" "$@" > "$OUT/variants.log" 2>&1
    say "bench_variants rc $?"
    [ "${TESTS:-1}" = 0 ] || kernel_tests tests/test_kernels.py
    sed -n '/==== variants/,$p' "$OUT/variants.log"
    exit 0 ;;
  *) die "unknown mode $what (all, tests, bench, variants)" ;;
esac
if [[ $what == all || $what == tests ]]; then
  kernel_tests tests/test_kernels.py tests/test_layout.py tests/test_paged_torch.py
fi
if [[ $what == all || $what == bench ]]; then
  "$PYTHON" benchmarks/bench_decode.py --out "$OUT/decode.json" "$@" 2>&1 | tee "$OUT/bench.log"
fi
