"""`doctor`: is a target ready to run a config? One read (remote/doctor_probe.py), then one
verdict per requirement: ok / missing / wrong, with what to do, and who can do it (`setup`
inside the container, or the Proxmox host's owner, with the `pct set`/config lines)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from dflashops import engine_envs, remote
from dflashops.errors import OpsError
from dflashops.inventory import ENGINES, Target
from dflashops.render import human_bytes
from dflashops.targets.base import Machine

GIB = 1 << 30
CPU_MODEL_MAX = 2 * GIB  # a target model this small trains on a CPU (the tiny config)
DISK_FLOOR = 60 * GIB  # free disk for a model not there yet (a 27B model in bf16 is 54 GB)
DISK_FLOOR_CPU = 1 * GIB  # a CPU run: the tiny model, its checkpoints and data
DISK_SLACK = 10 * GIB  # beside a model already there: checkpoints, token stores, logs
SHM_FLOOR = 1 * GIB  # NCCL's buffers between the GPUs of one node (LXC's default is 64 MiB)
APT = {"tmux": "tmux", "venv": "python3-venv", "libnuma": "libnuma1"}


@dataclass
class Check:
    name: str
    state: str  # ok | missing | wrong | skip (does not count: not needed here)
    text: str
    fix: str = ""
    package: str | None = None  # what `setup` installs with apt inside the container
    host_fix: list[str] = field(default_factory=list)  # lines for the Proxmox host's owner

    @property
    def failed(self) -> bool:
        return self.state in ("missing", "wrong")

    def line(self) -> str:
        fix = f": {self.fix}" if self.fix and self.failed else ""
        return f"{self.state:<8} {self.name}: {self.text}{fix}"


def read(machine: Machine, model: str | None, *, torch: bool = True) -> dict[str, Any]:
    """The facts of the target in one round trip (`torch`: import it in the target's python,
    for its CUDA version)."""
    target = machine.target
    request = {
        "python": target.python,
        "ws": target.workspace,
        "model": model,
        "engines": {name: engine_envs.python_of(target, name) for name in ENGINES},
        "torch": torch,
    }
    result = remote.run(machine, "doctor_probe.py", stdin=json.dumps(request).encode(),
                        what="the doctor's probe")  # fmt: skip
    if machine.dry_run:
        return {}
    try:
        return json.loads(result.stdout)
    except ValueError:
        raise OpsError(f"{target.name}: the doctor's probe printed no JSON") from None


def needs_gpu(model_path: str | None, facts: dict[str, Any]) -> tuple[bool, str]:
    """Whether the config needs a GPU, and why: a target model over 2 GiB (or one not there
    to size) does; a small one there, or none named (the tiny config), runs on a CPU."""
    found = facts.get("model")
    if not model_path:
        return False, "the config names no target model (a CPU run, as the tiny config)"
    if found and found.get("there") and found.get("bytes", 0) <= CPU_MODEL_MAX:
        return False, f"its target model is {human_bytes(found['bytes'])} (a CPU run)"
    if found and found.get("there"):
        return True, f"its target model is {human_bytes(found['bytes'])}"
    return True, f"its target model {model_path} (not there yet) is not one a CPU trains"


def judge(target: Target, facts: dict[str, Any], model: str | None) -> list[Check]:
    gpu, why = needs_gpu(model, facts)
    checks = [
        *gpu_checks(target, facts, gpu, why),
        python_check(target, facts),
        venv_check(facts),
        present(facts, "tmux", "tmux", "runs live in its sessions"),
        disk_check(target, facts, gpu, model),
        shm_check(target, facts, gpu),
        build_check(facts, gpu),
        numa_check(facts, gpu),
        engine_check(facts),
    ]
    return checks


# ---------------------------------------------------------------- GPUs


def host_gpu_lines(target: Target) -> list[str]:
    where = f"/etc/pve/lxc/{target.vmid}.conf" if target.vmid else "the container's config"
    return [
        f"on the Proxmox host, add to {where}, then `pct reboot {target.vmid or 'VMID'}`:",
        "  lxc.cgroup2.devices.allow: c 195:* rwm",
        "  lxc.cgroup2.devices.allow: c 509:* rwm   # nvidia-uvm: its major in `ls -l /dev/nvidia-uvm`",  # noqa: E501
        *(
            f"  lxc.mount.entry: /dev/{n} dev/{n} none bind,optional,create=file"
            for n in ("nvidia0", "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")
        ),  # fmt: skip
        "  (one nvidiaN line per GPU; then in the container the host's driver version without "
        "its kernel module: NVIDIA-Linux-x86_64-VERSION.run --no-kernel-module)",
    ]


def gpu_checks(target: Target, facts: dict[str, Any], gpu: bool, why: str) -> list[Check]:
    found = facts.get("gpu") or {}
    nodes = [n for n in found.get("nodes") or [] if n[len("/dev/nvidia") :].isdigit()]
    listed = found.get("gpus") or []
    state = "missing" if gpu else "skip"
    need = f"needed: {why}" if gpu else f"not needed: {why}"
    if not nodes:
        return [Check("GPU", state, f"no GPU: no /dev/nvidia0 in the target ({need})",
                      "the Proxmox host's owner passes the GPUs through (setup prints the lines)",
                      host_fix=host_gpu_lines(target) if gpu else [])]  # fmt: skip
    checks = [Check("GPU devices", "ok", " ".join(nodes))]
    if not found.get("smi"):
        checks.append(Check("nvidia-smi", "missing" if gpu else "skip", "not in the container",
                            "install the host's driver version there without its kernel module "
                            "(NVIDIA-Linux-x86_64-VERSION.run --no-kernel-module)"))  # fmt: skip
        return checks
    if not found.get("smi_ok"):
        checks.append(Check("nvidia-smi", "wrong" if gpu else "skip",
                            f"fails: {found.get('smi_error')}",
                            "the container's driver libraries must be the host's version"))  # fmt: skip
        return checks
    driver = listed[0]["driver"] if listed else "?"
    checks.append(Check("nvidia-smi", "ok", f"{len(listed)} GPU(s), {listed[0]['name'] if listed else '?'}, "
                        f"driver {driver} (CUDA {found.get('driver_cuda')})"))  # fmt: skip
    if target.gpus is not None and target.gpus != len(listed):
        checks.append(Check("GPU count", "wrong", f"hosts.yaml says gpus: {target.gpus}, the "
                            f"container shows {len(listed)}",
                            f"set gpus: {len(listed)} for {target.name}, or pass the others through"))  # fmt: skip
    checks.append(torch_cuda(facts, found.get("driver_cuda")))
    return checks


def version_tuple(text: str | None) -> tuple[int, ...]:
    try:
        return tuple(int(p) for p in (text or "").split(".")[:2])
    except ValueError:
        return ()


def torch_cuda(facts: dict[str, Any], driver_cuda: str | None) -> Check:
    t = facts.get("target") or {}
    if not t.get("torch"):
        return Check(
            "torch CUDA", "skip", "no torch in the target's python yet (setup installs it)"
        )
    if not t.get("cuda"):
        return Check("torch CUDA", "wrong", f"torch {t['torch']} is a CPU build",
                     "install the CUDA build (dflashops setup TARGET --torch-index "
                     "https://download.pytorch.org/whl/cuXYZ)")  # fmt: skip
    if version_tuple(t["cuda"]) > version_tuple(driver_cuda):
        cu = "cu" + "".join(str(driver_cuda).split(".")[:2])
        return Check("torch CUDA", "wrong", f"torch {t['torch']} is built for CUDA {t['cuda']}, the "
                     f"driver supports up to {driver_cuda}",
                     "install torch for an older CUDA (dflashops setup TARGET --torch-index "
                     f"https://download.pytorch.org/whl/{cu}, or the newest cuXYZ not above it), "
                     "or update the host's driver")  # fmt: skip
    return Check(
        "torch CUDA", "ok", f"torch {t['torch']} for CUDA {t['cuda']} <= driver's {driver_cuda}"
    )


# ---------------------------------------------------------------- the container's software


def python_check(target: Target, facts: dict[str, Any]) -> Check:
    t = facts.get("target") or {}
    if t.get("python"):
        return Check("python", "ok", f"python3 {facts.get('python3')}; {target.python} there")
    return Check("python", "ok", f"python3 {facts.get('python3')}; {target.python} not made yet "
                 "(dflashops setup makes it)")  # fmt: skip


def venv_check(facts: dict[str, Any]) -> Check:
    if facts.get("venv"):
        return Check("python3-venv", "ok", "python3 -m venv works")
    return Check("python3-venv", "missing", "python3 has no venv (ensurepip)",
                 "dflashops setup installs python3-venv", package="python3-venv")  # fmt: skip


def present(facts: dict[str, Any], key: str, name: str, why: str) -> Check:
    if facts.get(key):
        return Check(name, "ok", str(facts[key]))
    return Check(name, "missing", f"not installed ({why})", f"dflashops setup installs {APT[key]}",
                 package=APT[key])  # fmt: skip


def disk_check(target: Target, facts: dict[str, Any], gpu: bool, model_path: str | None) -> Check:
    disk = facts.get("disk") or {}
    free = disk.get("free", 0)
    found = facts.get("model") or {}
    if found.get("there"):
        need, why = DISK_SLACK if gpu else DISK_FLOOR_CPU, "checkpoints and data beside the model"
    elif gpu:
        need, why = DISK_FLOOR, f"the model {model_path} is not there yet (a 27B model is 54 GB)"
    else:
        need, why = DISK_FLOOR_CPU, "a CPU run's model, checkpoints and data"
    text = f"{human_bytes(free)} free at {disk.get('path')}, {human_bytes(need)} wanted ({why})"
    if free >= need:
        return Check("disk", "ok", text)
    grow = f"pct resize {target.vmid} rootfs +100G" if target.vmid else "grow its disk"
    return Check("disk", "missing", text, f"free space there, or on the Proxmox host: {grow}")


def shm_check(target: Target, facts: dict[str, Any], gpu: bool) -> Check:
    size = (facts.get("shm") or {}).get("size", 0)
    text = f"/dev/shm is {human_bytes(size)}"
    if size >= SHM_FLOOR:
        return Check("/dev/shm", "ok", text)
    if not gpu:
        return Check("/dev/shm", "skip", f"{text} (small for NCCL; only GPU runs use it)")
    fix = "the Proxmox host's owner mounts a larger one (setup prints the line)"
    line = "  lxc.mount.entry: tmpfs dev/shm tmpfs rw,nosuid,nodev,size=16G,create=dir 0 0"
    where = f"/etc/pve/lxc/{target.vmid}.conf" if target.vmid else "the container's config"
    return Check("/dev/shm", "wrong", f"{text}, NCCL wants >= {human_bytes(SHM_FLOOR)}", fix,
                 host_fix=[f"on the Proxmox host, add to {where}:", line])  # fmt: skip


def build_check(facts: dict[str, Any], gpu: bool) -> Check:
    have = [facts.get("compiler"), facts.get("cuda_headers")]
    if all(have):
        return Check("compiler + CUDA headers", "ok", " and ".join(str(h) for h in have))
    lacking = ", ".join(n for n, h in zip(("a C++ compiler", "CUDA headers"), have, strict=True)
                        if not h)  # fmt: skip
    return Check("compiler + CUDA headers", "missing" if gpu else "skip",
                 f"lacks {lacking} (causal-conv1d builds against them on GPU targets)",
                 "apt-get install build-essential and the CUDA toolkit of torch's CUDA")  # fmt: skip


def numa_check(facts: dict[str, Any], gpu: bool) -> Check:
    if facts.get("libnuma"):
        return Check("libnuma1", "ok", str(facts["libnuma"]))
    return Check("libnuma1", "missing" if gpu else "skip", "not installed (vLLM needs it)",
                 "dflashops setup installs libnuma1", package="libnuma1")  # fmt: skip


def engine_check(facts: dict[str, Any]) -> Check:
    have = [n for n, ok in (facts.get("engines") or {}).items() if ok]
    if have:
        return Check("engines", "ok", ", ".join(have))
    return Check("engines", "skip", "no vLLM environment (eval --engine sim needs none; "
                 "dflashops setup TARGET --engine vllm makes one)")  # fmt: skip
