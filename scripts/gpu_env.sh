# Sourced by scripts/gpu_*.sh: makes vLLM and this plugin importable, then says which are used;
# defines serve_check (below).
#
# Environment:
#   VLLM_BUNDLE  optional: an offline vLLM bundle folder (a folder with an install.sh that unpacks
#                vLLM into a site folder and prints an `export ...` line as its last line). When
#                set, it is unpacked into VLLM_SITE (default /tmp/vllm-site) and used; otherwise
#                the vllm that PYTHON imports is used (`pip install vllm==0.32.0`).
#   PYTHON       interpreter (default python3)
#   OUT          result folder (made here)
#   REQUIRE_VLLM 1 (default): stop when vllm is not importable; 0: carry on without it
# The plugin: `pip install -e .` declares its entry point. Where vllm-nvfp4 is not installed (a
# bundle without pip), scripts/plugin_dist_info.py writes a dist-info declaring it into
# NVFP4_META (default /tmp/vllm-nvfp4-meta), which goes on PYTHONPATH with the repository.
# shellcheck shell=bash

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
say() { printf '[%s %s] %s\n' "$(basename "$0" .sh)" "$(date -u +%H:%M:%S)" "$*"; }
die() { say "ERROR: $*"; exit 2; }

if [ -n "${VLLM_BUNDLE:-}" ]; then
  [ -f "$VLLM_BUNDLE/install.sh" ] || die "VLLM_BUNDLE=$VLLM_BUNDLE has no install.sh"
  EXPORT_LINE=$(bash "$VLLM_BUNDLE/install.sh" "${VLLM_SITE:-/tmp/vllm-site}" | tail -n1) \
    || die "bash $VLLM_BUNDLE/install.sh failed"
  case $EXPORT_LINE in export\ *) eval "$EXPORT_LINE" ;; *) die "install.sh printed no export line" ;; esac
  say "vLLM from the bundle $VLLM_BUNDLE"
fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"

plugin_visible() {
  "$PYTHON" -c 'import sys; from importlib.metadata import entry_points
sys.exit(not any(e.name == "nvfp4_mixed" for e in entry_points(group="vllm.general_plugins")))'
}
if ! plugin_visible; then
  NVFP4_META=${NVFP4_META:-/tmp/vllm-nvfp4-meta}
  rm -rf "$NVFP4_META"
  "$PYTHON" "$REPO/scripts/plugin_dist_info.py" "$NVFP4_META" >/dev/null || die "plugin_dist_info.py failed"
  export PYTHONPATH="$PYTHONPATH:$NVFP4_META"
  plugin_visible || die "the vllm.general_plugins entry point nvfp4_mixed is not visible"
  say "plugin entry point from $NVFP4_META (vllm-nvfp4 is not pip-installed)"
fi
"$PYTHON" - "${REQUIRE_VLLM:-1}" <<'PY' \
  || die "vllm is not importable: pip install vllm==0.32.0 (or set VLLM_BUNDLE)"
import importlib.util, platform, sys
from importlib.metadata import PackageNotFoundError, version
def v(name):
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"
if importlib.util.find_spec("vllm") is None and sys.argv[1] != "0":
    sys.exit(1)
print(f"[env] python {platform.python_version()}, vllm {v('vllm')}, torch {v('torch')}, "
      f"triton {v('triton')}, vllm-nvfp4 {v('vllm-nvfp4')}")
PY
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version,clocks.sm,clocks.mem \
  --format=csv 2>&1 | tee "$OUT/gpu.txt" | sed 's/^/[gpu] /'
say "repo $REPO at $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo '?'), out $OUT"

# `serve_check MODEL [ARG...]` (scripts/gpu_integration_check.sh, gpu_hybrid_check.sh) starts
# `vllm serve MODEL --kv-cache-dtype nvfp4_mixed ARG...` in its own process group, waits for /health,
# sends one /v1/completions request, stops the server; status 0 when a completion came back.
# Environment: PORT (8123), SERVE_TIMEOUT_S (300: start + request), SERVE_ARGS (default
# --enforce-eager), SERVE_LOG (the server's output, default $OUT/serve.log).
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
