#!/usr/bin/env bash
# Set up everything the tests need on a fresh Debian machine, then run them (the 30 slowest
# listed at the end). `--fast`: only the fast tier (not the tests marked slow: the long
# trainings and end-to-end runs); any other arguments go to pytest (`-n 0`: one process).
# Tests run in $DFLASHOPS_TEST_WORKERS (default 2) pytest-xdist workers, a file to a worker
# (its module fixtures made once), each worker with its own test bed: much of the suite waits
# on sshd, containers and deadlines, so two keep two cores busy (three let tests with 1-3 s
# deadlines miss them under load: DFLASHOPS_TEST_WORKERS=3 where the cores are free).
set -euo pipefail
cd "$(dirname "$0")/.."
args=()
for arg in "$@"; do
  if [ "$arg" = "--fast" ]; then
    args+=(-m "not slow")
  else
    args+=("$arg")
  fi
done
./scripts/install-system.sh
# The vLLM environment is made beside the first tests (those that need it wait for it: see
# tests/engines.py), not before them; a build still under way when this ends is stopped.
export DFLASHOPS_SETUP_VLLM=background
stop_vllm_build() {
  if [ ! -e .dflashops/setup-vllm.status ] && pid=$(cat .dflashops/setup-vllm.pid 2>/dev/null); then
    kill -- "-$pid" 2>/dev/null || true
  fi
  if [ -e .dflashops/setup-vllm.log ]; then
    echo "test: the vLLM environment: $(tail -n 1 .dflashops/setup-vllm.log)" >&2
  fi
}
trap stop_vllm_build EXIT
./scripts/setup-dev.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# --no-loadscope-reorder: files in tests/conftest.py's order (longest first), not xdist's own
# (most tests first), which left long files to the end
.venv/bin/python -m pytest -q --durations=30 -n "${DFLASHOPS_TEST_WORKERS:-2}" \
  --dist loadfile --no-loadscope-reorder "${args[@]}"
