"""Checkpoints in bed containers, and copies of them cut short and looked at (pull-ckpt)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

from tests.operator.cli import finished
from tests.operator.rundirs import make_run


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


SHARDS = ["model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors"]
BIG = "model-00003-of-00003.safetensors"


def checkpoint(ct, run: str, step: int, sizes: dict[str, int]) -> Path:
    """A run on `ct` whose checkpoints/step_STEP holds files of these sizes and its manifest."""
    runs = ct.host_path("/workspace/runs")
    if not (runs / run).exists():
        make_run(ct.host_path("/workspace"), run)
    path = runs / run / "checkpoints" / f"step_{step}"
    path.mkdir(parents=True)
    for name, size in sizes.items():
        (path / name).write_bytes(os.urandom(size))
    lines = [f"{sha(path / n)}  {n}\n" for n in sorted(sizes)]
    (path / "MANIFEST.sha256").write_text("".join(lines))
    return path


def big_checkpoint(ct, run: str = "big", step: int = 4) -> Path:
    sizes = {"config.json": 300, SHARDS[0]: 4 << 20, SHARDS[1]: 4 << 20, BIG: 96 << 20}
    return checkpoint(ct, run, step, sizes)


def hashes(path: Path) -> dict[str, str]:
    return {p.name: sha(p) for p in sorted(path.iterdir())}


def wait_for(what, timeout: float = 60, every: float = 0.02):
    deadline = time.monotonic() + timeout
    while not (found := what()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(every)
    return found


def verified_names(partial: Path) -> list[str]:
    marker = partial / ".dflashops-verified"
    lines = marker.read_text().splitlines() if marker.exists() else []
    return [json.loads(line)["name"] for line in lines if line.endswith("}")]


def stop_mid_transfer(proc: subprocess.Popen, partial: Path, stop) -> tuple[int, str, float]:
    """Once the two small shards verified there (the 96 MiB one still to come), `stop` it;
    (exit code, stderr, seconds from the fault to the command's end)."""
    wait_for(lambda: SHARDS[1] in verified_names(partial))
    assert BIG not in verified_names(partial)
    started = time.monotonic()
    stop()
    code, _out, err = finished(proc)
    return code, err, time.monotonic() - started


def left_on_disk(ckpts: Path) -> list[str]:
    """Every path under ckpts/RUN, once no receiver is writing there any more."""
    wait_for(lambda: not list(ckpts.rglob(".dfo-*.part")), timeout=30)
    return sorted(str(p.relative_to(ckpts)) for p in ckpts.rglob("*"))


def cut_link(host) -> None:
    """The link to `host` is cut: every sshd process serving a connection dies (the listener
    stays, so the next command connects again)."""
    children = Path(f"/proc/{host.sshd_pid}/task/{host.sshd_pid}/children").read_text().split()
    for pid in children:
        os.kill(int(pid), signal.SIGKILL)
