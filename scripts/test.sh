#!/usr/bin/env bash
# Set up everything the tests need on a fresh Debian machine, then run them.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-system.sh
./scripts/setup-dev.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
exec .venv/bin/python -m pytest -q "$@"
