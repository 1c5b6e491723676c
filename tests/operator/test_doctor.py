"""`doctor` on a real LXC container of the test bed (issue 25, item 1): with tmux and
python3-venv removed, its workspace full and no GPU (the bed has none), each problem is one
line and the exit is not 0; `setup` then installs what it can inside the container and doctor
passes for the CPU config; a GPU config is refused truthfully ("no GPU")."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.operator.cli import Ran, dflashops


def lines_of(ran: Ran, state: str) -> dict[str, str]:
    """{check name: its line} of the lines in state `state` (ok, missing, wrong, skip)."""
    found = {}
    for line in ran.out.splitlines():
        head, _, rest = line.partition(" ")
        if head == state:
            found[rest.strip().split(":")[0]] = line
    return found


@pytest.mark.testbed
@pytest.mark.lxc
def test_doctor_names_each_problem_and_setup_fixes_what_it_can(
    testbed, make_container, tmp_path: Path
):
    ct = make_container("pve1", "lxc")
    inv = testbed.write_inventory(
        tmp_path / "hosts.yaml", {"ct": ct}, extra_defaults={"python": "/root/venv/bin/python"}
    )

    def cli(*args: str) -> Ran:
        return dflashops(*args, inventory=inv, home=tmp_path, timeout=600)

    removed = ct.run(["dpkg", "-r", "tmux", "python3-venv", "python3.11-venv"])
    assert removed.returncode == 0, removed
    full = ct.run(["sh", "-c", "mount -t tmpfs -o size=1m tmpfs /workspace && "
                   "dd if=/dev/zero of=/workspace/fill bs=64k 2>/dev/null; true"])  # fmt: skip
    assert full.returncode == 0, full

    sick = cli("doctor", "ct")
    print(f"\n$ dflashops doctor ct\n{sick.out}")
    assert sick.code == 1, sick.err
    missing = lines_of(sick, "missing")
    assert set(missing) == {"tmux", "python3-venv", "disk"}, sick.out
    assert "dflashops setup installs tmux" in missing["tmux"]
    assert "dflashops setup installs python3-venv" in missing["python3-venv"]
    assert missing["disk"].startswith("missing  disk: 0 B free at /workspace, 1.0 GiB wanted")
    assert "no GPU: no /dev/nvidia0 in the target (not needed" in lines_of(sick, "skip")["GPU"]
    assert sick.out.splitlines()[-1] == "ct: NOT ready for tiny"

    gpu = cli("doctor", "ct", "--config", "qwen36-27b")
    assert gpu.code == 1
    assert lines_of(gpu, "missing")["GPU"].startswith(
        "missing  GPU: no GPU: no /dev/nvidia0 in the target (needed: "
    ), gpu.out
    assert "  lxc.mount.entry: /dev/nvidia0 dev/nvidia0 none bind,optional,create=file" in gpu.out
    assert "NCCL wants >= 1.0 GiB" in lines_of(gpu, "wrong")["/dev/shm"], gpu.out  # LXC's default
    assert (
        "  lxc.mount.entry: tmpfs dev/shm tmpfs rw,nosuid,nodev,size=16G,create=dir 0 0" in gpu.out
    )
    assert f"pct resize {ct.vmid} rootfs +100G" in lines_of(gpu, "missing")["disk"]

    assert ct.run(["umount", "/workspace"]).returncode == 0  # the user frees space
    setup = cli("setup", "ct", "--no-install")
    assert setup.code == 0, setup.err
    assert "ct: apt-get install tmux" in setup.err and "ct: creating venv /root/venv" in setup.err
    assert "libnuma1 not installed" in setup.err  # the bed's containers reach no mirror

    well = cli("doctor", "ct")
    print(f"$ dflashops setup ct --no-install\n{setup.err}$ dflashops doctor ct\n{well.out}")
    assert well.code == 0, well.out + well.err
    assert not lines_of(well, "missing") and not lines_of(well, "wrong"), well.out
    assert {"tmux", "python3-venv", "disk", "python"} <= set(lines_of(well, "ok")), well.out
    assert well.out.splitlines()[-1] == "ct: ready for tiny"


# What doctor_probe.py read in a real container with one H200 (driver 580.159.04, CUDA 13.0,
# torch 2.11.0+cu130), recorded on the project's GPU machine: the GPU lines judged from it.
H200_FACTS = Path(__file__).with_name("h200_facts.json")


def gpu_lines(gpus: int, **torch: str) -> list[str]:
    import json

    from dflashops.inventory import Target
    from dflashops.runs.readiness.doctor import judge

    facts = json.loads(H200_FACTS.read_text())
    facts["target"].update(torch)
    box = Target(name="gpubox", kind="local", workspace="/tmp", python="python3", gpus=gpus)
    return [c.line() for c in judge(box, facts, "/workspace/hf/Qwen3.6-27B")]


def test_a_gpu_container_as_recorded_passes_and_a_wrong_count_or_cuda_is_named():
    ready = gpu_lines(1)
    assert "ok       nvidia-smi: 1 GPU(s), NVIDIA H200, driver 580.159.04 (CUDA 13.0)" in ready
    assert "ok       torch CUDA: torch 2.11.0+cu130 for CUDA 13.0 <= driver's 13.0" in ready
    assert not [line for line in ready if line.startswith(("missing", "wrong"))], ready
    assert ("wrong    GPU count: hosts.yaml says gpus: 8, the container shows 1: set gpus: 1 "
            "for gpubox, or pass the others through") in gpu_lines(8)  # fmt: skip
    newer = gpu_lines(1, torch="2.13.0+cu132", cuda="13.2")
    assert ("wrong    torch CUDA: torch 2.13.0+cu132 is built for CUDA 13.2, the driver supports "
            "up to 13.0: install torch for an older CUDA (dflashops setup TARGET --torch-index "
            "https://download.pytorch.org/whl/cu130, or the newest cuXYZ not above it), or update "
            "the host's driver") in newer  # fmt: skip
    cpu = gpu_lines(1, torch="2.13.0+cpu", cuda=None)
    assert any(
        line.startswith("wrong    torch CUDA: torch 2.13.0+cpu is a CPU build") for line in cpu
    )
