"""Copies that do not collide, resume, clean up and fail clearly (issue 9, items 3 and 6), on
the fake Proxmox bed: real sshd, a faithful pct, ns containers, the real command line."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.operator.cli import dflashops

pytestmark = pytest.mark.testbed


@pytest.fixture
def home(tmp_path) -> Path:
    path = tmp_path / "home"
    path.mkdir()
    return path


@pytest.fixture
def inventory(testbed, tmp_path, home) -> Path:
    return testbed.write_inventory(
        tmp_path / "hosts.yaml", {"ct201": ("pve1", 201), "ct301": ("pve2", 301)}
    )


def start(*args: str, inventory: Path, home: Path) -> subprocess.Popen:
    """`dflashops ARGS...` started in the background, as a user's second terminal would."""
    env = {**os.environ, "HOME": str(home)}
    env.pop("DFLASHOPS_INVENTORY", None)
    argv = [sys.executable, "-m", "dflashops.cli", "--inventory", str(inventory), *args]
    return subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )


def finished(proc: subprocess.Popen, timeout: float = 120) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---------------------------------------------------------------- item 3: no collisions


def test_two_pushes_into_one_directory_at_once_both_succeed_with_whole_files(
    inventory, home, testbed, tmp_path
):
    trees = {}
    for who in ("a", "b"):
        tree = tmp_path / who
        tree.mkdir()
        for i in range(12):
            (tree / f"f{i}.bin").write_bytes(os.urandom(256 << 10))
        (tree / "big.bin").write_bytes(os.urandom(8 << 20))
        trees[who] = {p.name: sha(p) for p in tree.iterdir()}
    procs = [
        start("push", "ct201", str(tmp_path / who), "/workspace/shared", inventory=inventory,
              home=home)
        for who in ("a", "b")
    ]  # fmt: skip
    results = [finished(p) for p in procs]
    for code, _out, err in results:
        assert code == 0, err
    landed = testbed["pve1"][201].host_path("/workspace/shared")
    names = sorted(p.name for p in landed.iterdir())
    assert names == sorted(trees["a"]), names  # no temporary file left behind
    for name in names:  # each file whole: one push's version or the other's, never a mix
        assert sha(landed / name) in (trees["a"][name], trees["b"][name]), name
