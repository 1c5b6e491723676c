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


def test_round_tf32_keeps_ten_mantissa_bits_rounding_to_even():
    import torch

    sys.path.insert(0, str(REPO))
    from bench.gpu_fc_precision import round_tf32

    ulp = 2.0**-10
    x = torch.tensor([1 + ulp, 1 + ulp / 2, 1 + 3 * ulp / 2, 1 + ulp / 4, -(1 + 3 * ulp / 4)])
    assert round_tf32(x).tolist() == [1 + ulp, 1.0, 1 + 2 * ulp, 1.0, -(1 + ulp)]


@pytest.mark.slow
def test_cpu_smoke_of_the_27b_drafter_step_and_the_fc_precision(tmp_path):
    """The trainer's steps at the 27B template's drafter settings (tiny on CPU) with the
    plan's peak beside them, and the fc in each precision against float64: bf16 loses the
    training noise (outside the bar), fp32 does not, and the check names its decision."""
    out = tmp_path / "smoke.json"
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_check.py"), "--cpu-smoke", "--only",
         "drafter_27b,fc_precision", "--out", str(out)],
        capture_output=True, text=True, timeout=400, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    doc = json.loads(out.read_text())
    step, fc = doc["drafter_27b"], doc["fc_precision"]
    assert "error" not in step and "error" not in fc, (step, fc)
    assert step["first_step_s"] > 0 and step["step_ms"] > 0 and step["plan_gib"] > 0
    assert step["new_graphs_after_the_first_step"] == 0
    assert fc["shape"]["taps"] == 5 and fc["shape"]["hidden"] == 5120
    rows = fc["results"]
    assert set(rows) == {"fp32", "tf32_emulated", "bf16"}  # no TF32 off CUDA
    assert rows["fp32"]["within_bar"] and not rows["bf16"]["within_bar"]
    assert rows["bf16"]["errors"]["noise_rms"] > fc["bar"]["noise_rms"]
    errs = [rows[m]["errors"]["out_rms"] for m in ("fp32", "tf32_emulated", "bf16")]
    assert errs == sorted(errs) and 1e-3 < errs[2] < 2.0**-8
    assert fc["decision"] in ("fp32", "tf32")
    assert "fc decision:" in done.stdout and "against the plan's" in done.stdout
