#!/usr/bin/env bash
# Integration check of kv_cache_dtype="nvfp4_mixed" on a CUDA GPU with real vLLM:
# scripts/gpu_integration_check.py (LLM() with CUDA graphs, prefix caching, chunked prefill,
# log-probs against a fake-quantized reference), then `vllm serve --kv-cache-dtype nvfp4_mixed`
# on the same tiny model (its calibrated policy file next to it) and one /v1/completions request.
#
#   pip install vllm==0.32.0 && pip install -e .        (once)
#   bash scripts/gpu_integration_check.sh               SERVE=0: the LLM() checks only
#
# Environment: OUT (default out/integration), MODEL_DIR (the tiny model, default
# /tmp/nvfp4-tiny-h128), PORT (8123), LLM_TIMEOUT_S (900), SERVE_TIMEOUT_S (300: start + request),
# SERVE_ARGS (default --enforce-eager: CUDA graphs are covered by the LLM() check),
# VLLM_BUNDLE / VLLM_SITE / PYTHON (see scripts/gpu_env.sh).
# Writes integration_check.json, llm_check.log, serve.log, serve_check.txt, gpu.txt to OUT;
# exit 0 when every check passed.
set -uo pipefail
OUT=${OUT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/out/integration}
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
cd "$REPO"
MODEL_DIR=${MODEL_DIR:-/tmp/nvfp4-tiny-h128}
PORT=${PORT:-8123}

timeout "${LLM_TIMEOUT_S:-900}" "$PYTHON" scripts/gpu_integration_check.py --model-dir "$MODEL_DIR" \
  --out "$OUT/integration_check.json" 2>&1 | tee "$OUT/llm_check.log" \
  | grep -E "RESULT|Error|Traceback|KV policy|CUDA graph|Using .*backend" | cut -c1-2000
rc_llm=${PIPESTATUS[0]}

http() {  # URL [JSON-BODY]: GET, or POST with a body; prints the response body
  "$PYTHON" - "$@" <<'PY'
import sys, urllib.request as u
body = sys.argv[2].encode() if len(sys.argv) > 2 else None
req = u.Request(sys.argv[1], body, {"Content-Type": "application/json"})
sys.stdout.write(u.urlopen(req, timeout=120 if body else 2).read().decode())
PY
}

serve_check() {  # vllm serve in its own process group, /health, one completion, stop the group
  local t0=$SECONDS wait=${SERVE_TIMEOUT_S:-300} ok=0 rc=1 pid resp
  # shellcheck disable=SC2086
  setsid "$PYTHON" -m vllm.entrypoints.cli.main serve "$MODEL_DIR" --port "$PORT" --max-model-len 4096 \
    --gpu-memory-utilization 0.5 --kv-cache-dtype nvfp4_mixed ${SERVE_ARGS---enforce-eager} \
    > "$OUT/serve.log" 2>&1 &
  pid=$!
  while [ $((SECONDS - t0)) -lt "$wait" ] && kill -0 "$pid" 2>/dev/null; do
    if http "http://127.0.0.1:$PORT/health" >/dev/null 2>&1; then ok=1; break; fi
    sleep 1
  done
  if [ $ok = 1 ]; then
    say "serve: /health answered after $((SECONDS - t0))s"
    resp=$(http "http://127.0.0.1:$PORT/v1/completions" \
      "{\"model\": \"$MODEL_DIR\", \"prompt\": \"def add(a, b):\", \"max_tokens\": 32, \"temperature\": 0}") \
      && case $resp in *'"choices"'*'"text"'*) rc=0 ;; esac
    say "serve: completion: ${resp:0:400}"
  else
    if kill -0 "$pid" 2>/dev/null; then say "serve: no /health within ${wait}s (see serve.log)"
    else say "serve: the server exited (see serve.log)"; fi
  fi
  grep -aE "KV policy from|Using .* backend|Error|Traceback" "$OUT/serve.log" | head -5 | cut -c1-300
  kill -TERM -- "-$pid" 2>/dev/null
  for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
  kill -KILL -- "-$pid" 2>/dev/null
  wait "$pid" 2>/dev/null
  return $rc
}

rc_serve=skipped
if [ "${SERVE:-1}" != 0 ]; then
  serve_check 2>&1 | tee "$OUT/serve_check.txt"
  rc_serve=${PIPESTATUS[0]}
fi
say "llm_check rc=$rc_llm serve_check rc=$rc_serve"
[ "$rc_llm" = 0 ] && { [ "$rc_serve" = 0 ] || [ "$rc_serve" = skipped ]; }
