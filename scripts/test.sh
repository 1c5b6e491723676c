#!/usr/bin/env bash
# Set up everything the tests need on a fresh Debian machine, then run them (the 30 slowest
# listed at the end). `--fast`: only the fast tier (not the tests marked slow: the long
# trainings and end-to-end runs); any other arguments go to pytest.
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
./scripts/setup-dev.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
exec .venv/bin/python -m pytest -q --durations=30 "${args[@]}"
