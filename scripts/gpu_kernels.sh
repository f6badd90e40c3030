#!/usr/bin/env bash
# One device call on the H200: CUDA tests of the kernels, then the decode/prefill benchmark.
#   bash scripts/gpu_kernels.sh [all|tests|bench] [bench_decode.py args...]
#   bash scripts/gpu_kernels.sh variants [bench_variants.py args...]   # ours only, no peers:
#     BEFORE=<old attention.py> (default benchmarks/_before_attention.py, e.g. from
#     `git show <commit>:vllm_nvfp4/kernels/attention.py`), timed first, then the kernel tests;
#     time limits VARIANTS_TIMEOUT_S (230) and TESTS_TIMEOUT_S (140 for variants, 240 for tests)
# Needs .gpu-bundle (bash ../shared/gpu/build_vllm_bundle.sh .gpu-bundle) for the vLLM peers.
# Logs and the JSON go to $OUT (default /tmp/out).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
what=${1:-all}
shift || true
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used,temperature.gpu \
  --format=csv | tee "$OUT/gpu.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
if [[ $what == all || $what == tests ]]; then
  timeout ${TESTS_TIMEOUT_S:-240} python3 -m pytest -q -x -n 8 -p no:cacheprovider tests/test_kernels.py \
    tests/test_layout.py tests/test_paged_torch.py 2>&1 | tee "$OUT/tests.log" | tail -25
fi
if [[ $what == all || $what == bench ]]; then
  if [[ -f .gpu-bundle/install.sh ]]; then
    eval "$(bash .gpu-bundle/install.sh /tmp/vllm-site | tail -n1)"
  fi
  python3 scripts/bench_decode.py --out "$OUT/decode_h200.json" "$@" 2>&1 | tee "$OUT/bench.log"
fi
if [[ $what == variants ]]; then
  timeout ${VARIANTS_TIMEOUT_S:-230} python3 benchmarks/bench_variants.py --before "${BEFORE:-benchmarks/_before_attention.py}" \
    --before-label "${BEFORE_LABEL:-before}" --out "$OUT/decode_variants_h200.json" "$@" \
    > "$OUT/variants.log" 2>&1
  echo "bench rc $?"; grep -v '^{' "$OUT/variants.log" | grep -v '^\s*$' | head -40 | cut -c1-300
  timeout ${TESTS_TIMEOUT_S:-140} python3 -m pytest -q -x -n 8 -p no:cacheprovider tests/test_kernels.py 2>&1 \
    | tee "$OUT/tests.log" | tail -8
  sed -n '/==== variants/,$p' "$OUT/variants.log"
fi
