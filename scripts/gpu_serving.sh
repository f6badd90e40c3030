#!/usr/bin/env bash
# Serving benchmark and correctness soak on a CUDA GPU:
#   bench ARGS  ->  python -m benchmarks.serving ARGS      (vllm bench serve against vllm serve)
#   soak ARGS   ->  python -m benchmarks.serving.soak ARGS (greedy outputs under KV pressure)
#
#   pip install vllm==0.32.0 && pip install -e .        (once)
#
# The H200 plan, one command per call of at most 10 minutes (engine start 60-100 s each; the
# estimates assume the Llama-3.1-8B shape; OUT is kept between calls, --prior-records merges them):
#
#   S1 chat fp8, concurrency 16/64/128 (~6 min):
#     OUT=out/serving BUDGET_S=560 bash scripts/gpu_serving.sh bench --configs fp8 --workloads chat --chat-concurrency 16,64,128
#   S2 chat nvfp4-mixed, the same (~6 min):
#     OUT=out/serving BUDGET_S=560 bash scripts/gpu_serving.sh bench --configs nvfp4-mixed --workloads chat --chat-concurrency 16,64,128 --prior-records out/serving/serving_records.jsonl
#   S3 / S4 chat at concurrency 256 (~7 min each): as S1 / S2 with --chat-concurrency 256
#   S5 shared prefixes 8k / 16k at concurrency 64 / 128, both configurations (~9 min):
#     OUT=out/serving BUDGET_S=560 bash scripts/gpu_serving.sh bench --configs fp8,nvfp4-mixed --workloads prefix --prior-records out/serving/serving_records.jsonl
#   S6-S9 highest rate with p99 TPOT <= 50 ms (3 probes of ~2.5 min per call; run each twice, the
#   second call resumes the bisection from the first's probes):
#     OUT=out/serving BUDGET_S=560 bash scripts/gpu_serving.sh bench --configs fp8 --workloads rate --max-probes 3 --prior-records out/serving/serving_records.jsonl
#     (then --configs nvfp4-mixed the same way)
#   S10 vLLM's own nvfp4 on FlashInfer, where the build has it (~6 min):
#     OUT=out/serving BUDGET_S=560 bash scripts/gpu_serving.sh bench --configs nvfp4 --workloads chat --chat-concurrency 16,64,128 --prior-records out/serving/serving_records.jsonl
#   K1 soak, 1000 requests, both configurations (one engine each for the pressure and alone
#   passes, one for ngram speculation; resumable: a pass cut off continues on the next call with
#   the same OUT; the small weight-less Llama keeps it within one call):
#     OUT=out/soak BUDGET_S=560 bash scripts/gpu_serving.sh soak --configs nvfp4-mixed,fp8 --preset small
# Cost growth to 128k is benchmarks.e2e (scripts/gpu_bench_e2e.sh; plan in benchmarks/README.md).
#
# Environment: OUT (result folder, default out/serving), BUDGET_S (optional: wall-clock seconds
# for everything this script does; the run gets what is left minus 30 s for its summary),
# VLLM_BUNDLE / VLLM_SITE / PYTHON (see scripts/gpu_env.sh).
set -uo pipefail
MODE=${1:-}
case $MODE in
  bench) MODULE=benchmarks.serving ;;
  soak) MODULE=benchmarks.serving.soak ;;
  *) echo "usage: bash scripts/gpu_serving.sh bench|soak [ARGS]  (ARGS: python -m benchmarks.serving[.soak] --help)" >&2
     exit 2 ;;
esac
shift
OUT=${OUT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/out/serving} MODULE=$MODULE \
  exec bash "$(dirname "${BASH_SOURCE[0]}")/gpu_bench_e2e.sh" "$@"
