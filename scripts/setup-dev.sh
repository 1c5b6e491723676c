#!/usr/bin/env bash
# Make .venv with the operator, the workload (CPU torch) and the test tools. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  echo "setup-dev: creating $VENV" >&2
  "$PY" -m venv "$VENV"
fi
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
# torch first, pinned: a plain requirement would pull a multi-GB CUDA build. Where pip has no
# local CPU build, TORCH_INDEX (e.g. a CPU wheel index) says where to get one.
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  pip install ${TORCH_INDEX:+--index-url "$TORCH_INDEX"} torch==2.13.0
fi
# never the gpu extra here: causal-conv1d does not build without CUDA (README, GPU targets)
pip install -e ".[train,dev]"
# z-lab's reference drafter and decode loop, used by the tests as an outside reference.
"$VENV/bin/python" -c "import dflash" 2>/dev/null || pip install --no-deps dflash==0.1.0
# A CUDA build of torch brings triton, and with triton transformers picks fla's GPU-only kernels.
if "$VENV/bin/python" -c "import triton" 2>/dev/null; then
  echo "setup-dev: removing triton (it breaks CPU runs of hybrid models)" >&2
  pip uninstall -y triton
fi
