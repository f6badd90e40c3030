# Sourced by scripts/gpu_*.sh after gpu_env.sh: `serve_check MODEL [ARG...]` starts
# `vllm serve MODEL --kv-cache-dtype nvfp4_mixed ARG...` in its own process group, waits for /health,
# sends one /v1/completions request, stops the server; status 0 when a completion came back.
# Environment: PORT (8123), SERVE_TIMEOUT_S (300: start + request), SERVE_ARGS (default
# --enforce-eager), SERVE_LOG (the server's output, default $OUT/serve.log).
# shellcheck shell=bash
PORT=${PORT:-8123}

http() {  # URL [JSON-BODY]: GET, or POST with a body; prints the response body
  "$PYTHON" - "$@" <<'PY'
import sys, urllib.request as u
body = sys.argv[2].encode() if len(sys.argv) > 2 else None
req = u.Request(sys.argv[1], body, {"Content-Type": "application/json"})
sys.stdout.write(u.urlopen(req, timeout=120 if body else 2).read().decode())
PY
}

serve_check() {  # MODEL [ARG...]: vllm serve MODEL ARG... in its own process group, /health,
  # one completion, stop it
  local model=$1 t0=$SECONDS wait=${SERVE_TIMEOUT_S:-300} ok=0 rc=1 pid resp log=${SERVE_LOG:-$OUT/serve.log}
  # shellcheck disable=SC2086
  setsid "$PYTHON" -m vllm.entrypoints.cli.main serve "$model" --port "$PORT" --max-model-len 4096 \
    --gpu-memory-utilization 0.5 --kv-cache-dtype nvfp4_mixed ${SERVE_ARGS---enforce-eager} "${@:2}" \
    > "$log" 2>&1 &
  pid=$!
  while [ $((SECONDS - t0)) -lt "$wait" ] && kill -0 "$pid" 2>/dev/null; do
    if http "http://127.0.0.1:$PORT/health" >/dev/null 2>&1; then ok=1; break; fi
    sleep 1
  done
  if [ $ok = 1 ]; then
    say "serve: /health answered after $((SECONDS - t0))s"
    resp=$(http "http://127.0.0.1:$PORT/v1/completions" \
      "{\"model\": \"$model\", \"prompt\": \"def add(a, b):\", \"max_tokens\": 32, \"temperature\": 0}") \
      && case $resp in *'"choices"'*'"text"'*) rc=0 ;; esac
    say "serve: completion: ${resp:0:400}"
  else
    if kill -0 "$pid" 2>/dev/null; then say "serve: no /health within ${wait}s (see $log)"
    else say "serve: the server exited (see $log)"; fi
  fi
  grep -aE "KV policy in force|Using .* backend|Error|Traceback" "$log" | head -5 | cut -c1-300
  kill -TERM -- "-$pid" 2>/dev/null
  for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
  kill -KILL -- "-$pid" 2>/dev/null
  wait "$pid" 2>/dev/null
  return $rc
}
