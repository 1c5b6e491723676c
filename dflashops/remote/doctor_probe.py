"""`dflashops doctor`'s one read of a target (stdlib only, run by the target's python3): the
facts a run needs, as one JSON object on stdout; the operator judges them (runs/readiness/doctor.py).

stdin: {"python": the target's python, "ws": its workspace, "model": the config's target.path
or null, "engines": {name: python}, "torch": whether to import it}. Every command it starts has a deadline."""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys

TORCH = "import json, torch; print(json.dumps([torch.__version__, torch.version.cuda]))"


def call(argv: list[str], timeout: float = 30) -> tuple[int, str]:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return 127, str(exc)
    return done.returncode, (done.stdout or "") + (done.stderr or "")


def space(path: str) -> dict | None:
    while path and not os.path.exists(path):
        path = os.path.dirname(path.rstrip("/")) or "/"
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return {"path": path, "free": st.f_bavail * st.f_frsize, "size": st.f_blocks * st.f_frsize}


def gpus() -> dict:
    found = {"nodes": sorted(glob.glob("/dev/nvidia*")), "smi": shutil.which("nvidia-smi")}
    if not found["smi"]:
        return found
    code, out = call([found["smi"], "--query-gpu=name,driver_version,memory.total",
                      "--format=csv,noheader,nounits"])  # fmt: skip
    found["smi_ok"] = code == 0
    found["smi_error"] = out.strip().splitlines()[-1] if code and out.strip() else None
    if code == 0:
        rows = [[c.strip() for c in line.split(",")] for line in out.strip().splitlines()]
        found["gpus"] = [{"name": r[0], "driver": r[1], "memory_mib": r[2]} for r in rows if r]
        code, out = call([found["smi"]])
        cuda = re.search(r"CUDA Version:\s*([0-9.]+)", out)
        found["driver_cuda"] = cuda.group(1) if cuda else None
    return found


def torch_of(python: str, look: bool) -> dict:
    if not os.path.exists(python) and not shutil.which(python):
        return {"python": False}
    if not look:
        return {"python": True}
    code, out = call([python, "-c", TORCH], timeout=120)
    if code != 0:
        return {"python": True, "torch": None}
    version, cuda = json.loads(out.strip().splitlines()[-1])
    return {"python": True, "torch": version, "cuda": cuda}


def model(path: str | None) -> dict | None:
    if not path:
        return None
    if not os.path.isfile(os.path.join(path, "config.json")):
        return {"path": path, "there": False}
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.path.getsize(os.path.join(root, name))
    return {"path": path, "there": True, "bytes": total}


def main() -> None:
    req = json.loads(sys.stdin.read() or "{}")
    cuda_h = glob.glob("/usr/local/cuda*/include/cuda_runtime.h") + glob.glob(
        "/usr/include/cuda_runtime.h"
    )
    nvcc = shutil.which("nvcc") or next(iter(glob.glob("/usr/local/cuda*/bin/nvcc")), None)
    facts = {
        "python3": sys.version.split()[0],
        "venv": importlib.util.find_spec("ensurepip") is not None,
        "root": os.geteuid() == 0,
        "apt": shutil.which("apt-get") is not None,
        "tmux": shutil.which("tmux"),
        "compiler": shutil.which("g++") or shutil.which("c++"),
        "cuda_headers": cuda_h[0] if cuda_h else None,
        "nvcc": nvcc,
        "libnuma": next(
            iter(glob.glob("/usr/lib/*/libnuma.so.1") + glob.glob("/lib/*/libnuma.so.1")), None
        ),  # fmt: skip
        "disk": space(req.get("ws") or "/"),
        "shm": space("/dev/shm"),
        "gpu": gpus(),
        "target": torch_of(req.get("python") or "python3", req.get("torch", True)),
        "model": model(req.get("model")),
        "engines": {n: os.path.exists(p) for n, p in (req.get("engines") or {}).items()},
    }
    print(json.dumps(facts))


main()
