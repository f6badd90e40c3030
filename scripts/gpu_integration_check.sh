#!/usr/bin/env bash
# One device call on the H200: install the vLLM 0.32.0 bundle and this plugin (no pip, no network),
# run scripts/gpu_integration_check.py (LLM with CUDA graphs, prefix caching, chunked prefill),
# then `vllm serve --kv-cache-dtype nvfp4_mixed --enforce-eager` (graphs are covered by the LLM
# check; eager keeps the call inside its time limit) + one completion. Logs and JSON go to $OUT.
#   bash scripts/gpu_integration_check.sh          (needs .gpu-bundle: see ../shared/gpu/README.md)
#   SERVE=0 bash scripts/gpu_integration_check.sh  (the LLM checks only)
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SITE=/tmp/vllm-site
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv | tee "$OUT/gpu.txt"
eval "$(bash "$REPO/.gpu-bundle/install.sh" "$SITE" | tail -n1)" || exit 2

# The plugin without pip: the package from the repo on PYTHONPATH, and a dist-info in the bundle
# site that declares the entry point (vLLM discovers plugins through importlib.metadata).
DI="$SITE/vllm_nvfp4-0.1.0.dist-info"
mkdir -p "$DI"
printf 'Metadata-Version: 2.1\nName: vllm-nvfp4\nVersion: 0.1.0\n' > "$DI/METADATA"
printf '[vllm.general_plugins]\nnvfp4_mixed = vllm_nvfp4.plugin:register\n' > "$DI/entry_points.txt"
export PYTHONPATH="$REPO:$PYTHONPATH"
python3 -c 'import importlib.metadata as m; print([e.name for e in m.entry_points(group="vllm.general_plugins")])'

cd "$REPO"
timeout 330 python3 scripts/gpu_integration_check.py --out "$OUT/integration_h200.json" \
  2>&1 | tee "$OUT/llm_check.log" | grep -E "RESULT|Error|Traceback|KV policy|CUDA graph|Using .*backend" | cut -c1-2000
rc_llm=${PIPESTATUS[0]}

rc_serve=skipped
if [ "${SERVE:-1}" != 0 ]; then
  LOG="$OUT/serve.log" HEALTH_TIMEOUT=120 SERVE_ARGS="--kv-cache-dtype nvfp4_mixed --enforce-eager" \
    timeout 150 bash .gpu-bundle/serve_check.sh /tmp/nvfp4-tiny-h128 8123 2>&1 | tee "$OUT/serve_check.txt"
  rc_serve=${PIPESTATUS[0]}
  grep -aE "KV policy from|nvfp4_mixed" "$OUT/serve.log" | head -3 | cut -c1-200
fi
echo "llm_check rc=$rc_llm serve_check rc=$rc_serve"
[ "$rc_llm" = 0 ] && { [ "$rc_serve" = 0 ] || [ "$rc_serve" = skipped ]; }
