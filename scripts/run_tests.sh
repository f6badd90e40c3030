#!/usr/bin/env bash
# Install everything (scripts/install.sh) and run the test suite.
#
# usage: bash scripts/run_tests.sh [extra pytest args, e.g. -x -k smoke tests/test_formats.py]
#
# Environment: VENV (default .venv), VLLM_CPU_KVCACHE_SPACE (GiB, default 1),
#              PYTEST_TIMEOUT (seconds per test, default 600), PYTEST_WORKERS (pytest-xdist
#              processes, default 2; 0 runs in this process: use it with -x or pdb), see install.sh.
# GPU-marked tests skip without CUDA. Exit status: pytest's (5 = no tests collected = failure).
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
T0=$SECONDS
VENV=${VENV:-$REPO/.venv}
case "$VENV" in /*) ;; *) VENV="$PWD/$VENV" ;; esac  # absolute: the script cds later
export VENV PATH="$VENV/bin:$PATH" VIRTUAL_ENV="$VENV"  # tests call `vllm`, `lm_eval` by name
bash "$REPO/scripts/install.sh"
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} TRANSFORMERS_OFFLINE=${TRANSFORMERS_OFFLINE:-1}
export VLLM_NO_USAGE_STATS=${VLLM_NO_USAGE_STATS:-1}
cd "$REPO"
echo "[tests $(date -u +%H:%M:%S)] pytest (${PYTEST_WORKERS:-2} workers, timeout ${PYTEST_TIMEOUT:-600}s per test)"
rc=0
"$VENV/bin/python" -m pytest -q -ra --durations=15 --timeout="${PYTEST_TIMEOUT:-600}" \
  -n "${PYTEST_WORKERS:-2}" "$@" || rc=$?
echo "[tests $(date -u +%H:%M:%S)] pytest exit status $rc; total $((SECONDS - T0)) s (install included)"
exit $rc
