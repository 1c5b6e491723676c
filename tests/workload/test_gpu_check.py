"""bench/gpu_check.py's fla section off a GPU: the torch code runs, the kernels are skipped."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_cpu_smoke_fla_section_runs_the_torch_code_and_skips_the_kernels(tmp_path):
    out = tmp_path / "smoke.json"
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_check.py"), "--cpu-smoke", "--only", "fla",
         "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    fla = json.loads(out.read_text())["fla"]
    assert "error" not in fla, fla
    assert fla["skipped"].startswith("fla's kernels need a CUDA device")
    assert fla["dtypes"]["float32"]["torch_ms"] > 0
    assert set(fla["kernels"]) >= {"torch_chunk_gated_delta_rule", "causal_conv1d_fn"}
    assert "skipped on cpu" in done.stdout
