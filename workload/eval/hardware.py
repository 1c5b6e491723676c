"""What a serving benchmark ran on, kept in its fingerprint: tokens/s, TTFT and speedup are figures
of the machine as much as of the drafter, so two results on other hardware are not differenced.

On a GPU: the model (the visible devices', each once), their count, the driver (nvidia-smi) and
the CUDA the serving engine's torch was built for (the vLLM client reports it); on a CPU: "gpu":
None, the CPU's model and the cores this process may use.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from pathlib import Path

SMI_TIMEOUT_S = 10.0


def hardware(gpu: bool) -> dict:
    """{"device": "gpu", "gpu", "gpu_count", "driver", "cuda": None (filled from the engine)} or
    {"device": "cpu", "gpu": None, "cpu", "cpu_count"}."""
    if not gpu:
        return {"device": "cpu", "gpu": None, "cpu": cpu_model(), "cpu_count": cpu_count()}
    import torch

    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {"device": "gpu", "gpu": ", ".join(dict.fromkeys(names)), "gpu_count": len(names),
            "driver": gpu_driver(), "cuda": None}  # fmt: skip


def with_cuda(found: dict, cuda: str | None) -> dict:
    """The machine as one engine environment served on it: on a GPU, that environment's CUDA."""
    return {**found, "cuda": cuda} if found.get("device") == "gpu" else found


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def gpu_driver() -> str | None:
    """The NVIDIA driver's version, None where nvidia-smi cannot say."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        done = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=SMI_TIMEOUT_S)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = done.stdout.split()
    return lines[0] if done.returncode == 0 and lines else None
