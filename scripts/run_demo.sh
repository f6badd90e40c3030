#!/usr/bin/env bash
# Install everything (scripts/install.sh) and run the demo: LLM(model=..., kv_cache_dtype=...).
#
# usage: bash scripts/run_demo.sh [demo.py options: --model DIR --kv-cache-dtype DTYPE
#                                  --max-tokens N --prompt TEXT ...]
#
# Without --model it builds a tiny random-weight Llama (+ BPE tokenizer trained on the Python
# stdlib) cached under ~/.cache/vllm-nvfp4. The KV-cache dtype defaults to nvfp4_mixed.
# Environment: VENV (default .venv), VLLM_CPU_KVCACHE_SPACE (GiB, default 2), see install.sh.
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$REPO/scripts/venv_env.sh"
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2}
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} VLLM_NO_USAGE_STATS=${VLLM_NO_USAGE_STATS:-1}
cd "$REPO"
echo "[demo] running scripts/demo.py $*"
exec "$VENV/bin/python" "$REPO/scripts/demo.py" "$@"
