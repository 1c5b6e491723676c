"""Shared by the operator benchmarks: a test bed, an inventory, and timing helpers."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.testbed import running as bed  # noqa: E402, F401 (re-exported for the benches)


def dflashops_argv(inventory: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "dflashops.cli", "--inventory", str(inventory), *args]


def openssh_argv(tb, host: str, *remote: str, options: tuple[str, ...] = ()) -> list[str]:
    h = tb[host]
    return [
        "ssh",
        *options,
        "-T",
        "-p",
        str(h.port),
        "-i",
        str(tb.client_key),
        "-o",
        "IdentitiesOnly=yes",
        "-o",
        f"UserKnownHostsFile={tb.known_hosts_path}",
        "-o",
        "StrictHostKeyChecking=yes",
        "-o",
        "BatchMode=yes",
        f"root@{h.address}",
        *remote,
    ]


def timed(argv: list[str], *, stdin=None, env=None) -> float:
    start = time.perf_counter()
    subprocess.run(
        argv, stdin=stdin, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, check=True, env=env
    )
    return time.perf_counter() - start


def home_env(tmp: Path) -> dict[str, str]:
    """A private HOME, and our CLI's bytecode cached as an installed package has it (under
    `tmp`): a machine that sets PYTHONDONTWRITEBYTECODE would otherwise compile every module
    at every command, a cost no installed copy pays. The first command fills the cache."""
    home = tmp / "home"
    home.mkdir(exist_ok=True)
    env = dict(os.environ, HOME=str(home), PYTHONPYCACHEPREFIX=str(tmp / "pycache"))
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    subprocess.run([sys.executable, "-m", "dflashops.cli", "--help"], env=env, check=True,
                   stdout=subprocess.DEVNULL)  # fmt: skip
    return env


def compare(label: str, ours: list[float], base: list[float], *, lower_is_better=True) -> None:
    mo, mb = statistics.median(ours), statistics.median(base)
    ratio = mo / mb if lower_is_better else mb / mo
    print(f"{label:<44} ours {mo:8.3f}  baseline {mb:8.3f}  ratio {ratio:5.2f}x")
