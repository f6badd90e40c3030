#!/usr/bin/env bash
# FlashInfer for vLLM's own `--kv-cache-dtype nvfp4` on an offline Hopper machine.
#
# On Hopper, vLLM serves `nvfp4` through FlashInfer's fa2 kernels, JIT-compiled with nvcc. A
# machine with network access needs only `pip install flashinfer-python` (and nvcc + ninja). For
# an offline machine this script packs what the fa2 path uses into one archive, and unpacks it
# there:
#
#   bash scripts/gpu_flashinfer_stage.sh pack OUT_DIR [VERSION]   # with network: OUT_DIR/flashinfer-VERSION-fa2.tar.xz (~19 MB)
#   bash scripts/gpu_flashinfer_stage.sh unpack ARCHIVE [SITE]     # offline GPU machine: SITE (default /tmp/fi-site)
#   export PYTHONPATH=SITE:$PYTHONPATH FLASHINFER_CUDA_ARCH_LIST=9.0 CUDA_HOME=/usr/local/cuda
#
# The archive keeps every Python module of the wheel, its dist-info (vLLM reads the version), the
# headers (include/, cutlass/, cccl/, spdlog/) and the top-level sources of data/csrc/ plus
# nv_internal/ (page, prefill and decode modules); it drops the sources of other kernel families
# (MoE, GDN, fused collectives, ...), which the fa2 attention path never compiles. Its Python
# dependencies must already be importable there: apache-tvm-ffi (in vLLM's wheel set),
# nvidia-ml-py, einops, tabulate, ninja. The first engine start JIT-compiles the kernels (~1 min
# on 16 cores) into ~/.cache/flashinfer, which later starts reuse.
set -euo pipefail
cmd=${1:-}; shift || true
case "$cmd" in
  pack)
    out=${1:?usage: pack OUT_DIR [VERSION]}; ver=${2:-0.7.4}
    mkdir -p "$out"; tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
    python3 -m pip download -q --no-deps --only-binary=:all: -d "$tmp" "flashinfer-python==$ver"
    python3 - "$tmp" "$tmp"/flashinfer_python-*.whl <<'PY'
import sys, zipfile
dest, wheel = sys.argv[1], sys.argv[2]
headers = tuple(f"flashinfer/data/{d}/" for d in ("include", "cutlass", "cccl", "spdlog", "csrc/nv_internal"))
with zipfile.ZipFile(wheel) as z:
    for info in z.infolist():
        f = info.filename
        if f.startswith("flashinfer/data/"):
            keep = f.startswith(headers) or f.count("/") == 2 or (
                f.startswith("flashinfer/data/csrc/") and f.count("/") == 3)
        else:
            keep = f.endswith((".py", ".json", ".txt", ".jinja", ".cuh", ".h")) or ".dist-info/" in f
        if keep:
            z.extract(info, f"{dest}/site")
PY
    tar -C "$tmp/site" -cf - . | xz -T0 -6 > "$out/flashinfer-$ver-fa2.tar.xz"
    ls -l "$out/flashinfer-$ver-fa2.tar.xz" ;;
  unpack)
    archive=${1:?usage: unpack ARCHIVE [SITE]}; site=${2:-/tmp/fi-site}
    mkdir -p "$site"; tar -xJf "$archive" -C "$site"
    command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ] || echo "warning: no nvcc: FlashInfer cannot JIT-compile" >&2
    command -v ninja >/dev/null || echo "warning: no ninja on PATH: FlashInfer cannot JIT-compile" >&2
    echo "export PYTHONPATH=$site\${PYTHONPATH:+:\$PYTHONPATH} FLASHINFER_CUDA_ARCH_LIST=9.0 CUDA_HOME=/usr/local/cuda" ;;
  *) echo "usage: $0 pack OUT_DIR [VERSION] | unpack ARCHIVE [SITE]" >&2; exit 2 ;;
esac
