"""Every rank's own files in `<run_dir>/ranks/`: its output and a small heartbeat.

Rank 0's output stays on the console (the launcher sends it to console.log); any other rank
sends its stdout and stderr, at the file-descriptor level, to `ranks/rank_<R>.log`. Each rank
keeps `ranks/rank_<R>.json` ({rank, local_rank, world_size, pid, pid_start, hostname,
node_addr, step, time, status, exit_code}), replaced atomically at start, at each log step and
at exit. On multi-node runs each node has its own run directory, so a node's ranks' files are
on that node. This module imports no torch, so `main` can use it before the heavy imports.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from workload.common.jsonfile import write_json_atomic
from workload.common.layout import RANKS_DIR, rank_name

NODE_ADDR_ENV = "DFLASHOPS_NODE_ADDR"


def env_rank() -> tuple[int, int, int]:
    """(global rank, local rank, world size) from torchrun's environment (0, 0, 1 without)."""
    return (int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0)),
            int(os.environ.get("WORLD_SIZE", 1)))  # fmt: skip


def process_start_ticks(pid: int | str = "self") -> int:
    """Field 22 of /proc/<pid>/stat: when the process started, in clock ticks after boot.
    With the pid it names one process, even after the pid is reused."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[19])  # fields from 3 on follow the ")" of comm


def log_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / RANKS_DIR / rank_name(rank, ".log")


def heartbeat_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / RANKS_DIR / rank_name(rank, ".json")


def redirect_output(run_dir: Path, rank: int) -> Path | None:
    """Send this process's stdout and stderr (file descriptors 1 and 2) to the rank's log,
    appended; rank 0 keeps the console. Returns the log path, or None for rank 0."""
    if rank == 0:
        return None
    path = log_path(run_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    finally:
        os.close(fd)
    print(f"--- rank {rank}, pid {os.getpid()}, {time.strftime('%Y-%m-%d %H:%M:%S')}", flush=True)
    return path


class Heartbeat:
    """`ranks/rank_<R>.json` of this process: who it is and how far it got."""

    def __init__(self, run_dir: Path, rank: int, local_rank: int, world: int) -> None:
        self.path = heartbeat_path(run_dir, rank)
        self.fields: dict[str, Any] = {
            "rank": rank, "local_rank": local_rank, "world_size": world, "pid": os.getpid(),
            "pid_start": process_start_ticks(), "hostname": socket.gethostname(),
            "node_addr": os.environ.get(NODE_ADDR_ENV) or None, "step": 0, "time": None,
            "status": "starting", "exit_code": None,
        }  # fmt: skip

    def update(self, **values: Any) -> None:
        self.fields.update(values, time=time.time())
        write_json_atomic(self.path, self.fields)
