#!/usr/bin/env bash
# Issue 7 on the offline H200: install the vLLM 0.32.0 bundle, make this repository's vLLM plugin
# discoverable, run scripts/bench_e2e.py inside a hard time budget, print the table last.
#
# usage (repository root on the GPU machine, bundle carried as .gpu-bundle):
#     bash scripts/gpu_bench_e2e.sh [bench_e2e.py arguments ...]
#     e.g.  BUDGET_S=540 bash scripts/gpu_bench_e2e.sh --dtypes fp8,nvfp4-mixed,auto --contexts 32k,8k
#
# Environment:
#   OUT       result folder (default: $OUT of the device tool, else ./e2e-out); gets e2e_h200.json,
#             e2e_records.jsonl (one line per measurement, written as it completes), run.log,
#             workers.log, serve.log
#   BUDGET_S  wall-clock seconds for everything this script does (default 540); the benchmark gets
#             what is left after the install, minus a 30 s margin for its last kill + summary
#   BUNDLE    the bundle folder (default .gpu-bundle), SITE where it is unpacked (/root/vllm-site)
#   PYTHON    interpreter (default python3: the image's, with torch 2.11 + triton 3.6)
#
# The plugin: vLLM finds plugins through importlib.metadata entry points (group
# vllm.general_plugins). The bundle's site has no metadata for vllm-nvfp4 and pip must not touch
# the image, so this script writes a minimal vllm_nvfp4-VERSION.dist-info (METADATA +
# entry_points.txt, taken from setup.py) into a folder on PYTHONPATH next to the repository root.
# Every process vLLM spawns inherits PYTHONPATH, so the engine core and the workers load it too.
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
OUT=${OUT:-$REPO/e2e-out}
BUDGET_S=${BUDGET_S:-540}
BUNDLE=${BUNDLE:-$REPO/.gpu-bundle}
SITE=${SITE:-/root/vllm-site}
PYTHON=${PYTHON:-python3}
META=${META:-/tmp/vllm-nvfp4-meta}
T0=$SECONDS
mkdir -p "$OUT"
exec > >(tee -a "$OUT/run.log") 2>&1
say() { printf '[driver %s +%ss] %s\n' "$(date -u +%H:%M:%S)" "$((SECONDS - T0))" "$*"; }
die() { say "ERROR: $*"; exit 1; }

say "repo $REPO ($(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo '?')), out $OUT, budget ${BUDGET_S}s, $(date -u +%FT%TZ)"
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version,clocks.sm,clocks.mem \
  --format=csv,noheader 2>&1 | sed 's/^/[gpu] /'

# 1) vLLM from the bundle ------------------------------------------------------------------------
[ -f "$BUNDLE/install.sh" ] || die "no bundle at $BUNDLE (carry .gpu-bundle; build it with ../shared/gpu/build_vllm_bundle.sh .gpu-bundle)"
EXPORT_LINE=$(bash "$BUNDLE/install.sh" "$SITE" | tee /dev/stderr | tail -n1) || die "bundle install failed"
eval "$EXPORT_LINE"
say "bundle installed"

# 2) plugin metadata (entry point) ----------------------------------------------------------------
write_plugin_meta() {  # DIR: writes DIR/vllm_nvfp4-VERSION.dist-info from setup.py
  "$PYTHON" - "$REPO/setup.py" "$1" <<'EOF'
import ast, sys
from pathlib import Path
tree, out = ast.parse(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
kw = {k.arg: k.value for k in call.keywords}
version = ast.literal_eval(kw["version"])
eps = ast.literal_eval(kw["entry_points"])  # {group: ["name = module:attr", ...]}
if not eps.get("vllm.general_plugins"):
    sys.exit("setup.py declares no vllm.general_plugins entry point")
d = out / f"vllm_nvfp4-{version}.dist-info"
d.mkdir(parents=True, exist_ok=True)
(d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm-nvfp4\nVersion: {version}\n")
(d / "entry_points.txt").write_text("".join(
    f"[{g}]\n" + "".join(e.strip() + "\n" for e in items) + "\n" for g, items in eps.items()))
(d / "top_level.txt").write_text("vllm_nvfp4\n")
print(d)
EOF
}
rm -rf "$META"
write_plugin_meta "$META" >/dev/null || die "could not write the plugin metadata"
export PYTHONPATH="$REPO:$META${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$PYTHON" - <<'EOF' || die "the vllm.general_plugins entry point is not visible"
from importlib.metadata import PackageNotFoundError, entry_points, version
eps = [e for e in entry_points(group="vllm.general_plugins") if e.name == "nvfp4_mixed"]
assert eps, "nvfp4_mixed entry point missing"
fn = eps[0].load()  # imports vllm_nvfp4.plugin from the repository (vllm is not imported)
try:
    vv = version("vllm")
except PackageNotFoundError:
    vv = "no metadata"
print(f"[driver] plugin entry point: {eps[0].value} -> {fn.__module__} "
      f"(vllm-nvfp4 {version('vllm-nvfp4')}, vllm {vv})")
EOF

# 3) the benchmark, inside what is left of the budget ------------------------------------------------
LEFT=$((BUDGET_S - (SECONDS - T0) - 30))
[ "$LEFT" -gt 120 ] || die "only ${LEFT}s left for the benchmark"
say "bench_e2e.py with --budget-s $LEFT $*"
"$PYTHON" scripts/bench_e2e.py --out "$OUT" --budget-s "$LEFT" "$@"
rc=$?
say "finished, rc $rc; files in $OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
exit $rc
