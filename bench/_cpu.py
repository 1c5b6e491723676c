"""CPU time of everything a benchmark starts (our CLI, ssh, sshd, pct, the container's
processes), from a cgroup-v1 cpuacct group the benchmark moves itself into before the test bed
starts. On a machine shared with other work, wall-clock ratios swing with the load; CPU seconds
per GB do not, and say what throughput an idle machine would give. None where the cgroup
cannot be made (no cgroup v1 cpuacct, not root)."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path("/sys/fs/cgroup/cpuacct")


class CpuMeter:
    def __init__(self) -> None:
        self.group: Path | None = None
        try:
            group = ROOT / f"dflashops-bench-{os.getpid()}"
            group.mkdir()
            (group / "cgroup.procs").write_text(str(os.getpid()))
            self.group = group
        except OSError:
            self.group = None

    def seconds(self) -> float | None:
        """CPU seconds used so far by this process and everything it started since."""
        if self.group is None:
            return None
        return int((self.group / "cpuacct.usage").read_text()) / 1e9

    def close(self) -> None:
        if self.group is None:
            return
        try:
            (ROOT / "cgroup.procs").write_text(str(os.getpid()))
            self.group.rmdir()
        except OSError:
            pass  # a process of the bed still lingers; the empty group goes with the next boot
