# Sourced by run_demo.sh and run_tests.sh: the project venv (VENV, default .venv, made absolute)
# first on PATH (tests call `vllm`, `lm_eval` by name), installed or updated by install.sh.
# Expects REPO (the repository root) to be set.
VENV=${VENV:-$REPO/.venv}
case "$VENV" in /*) ;; *) VENV="$PWD/$VENV" ;; esac  # absolute: the scripts cd later
export VENV
export PATH="$VENV/bin:$PATH" VIRTUAL_ENV="$VENV"
bash "$REPO/scripts/install.sh"
