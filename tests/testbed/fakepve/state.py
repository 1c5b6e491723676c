"""On-disk state of a fake Proxmox node: its config, its containers, faults and runtime pids.

Layout under a host dir (written by the pytest side, read by `pct`):
    host.json                 HostConfig
    faults.json               {"corrupt_exec_stdin_at": N} or {}
    ct/<vmid>/ct.json         CtConfig (its existence is "the CT is defined on this node")
    ct/<vmid>/init.json       {"pid": P, "start": T}: the CT's init (running while P has
                              start time T)
    lock/pve-config-<vmid>.lock
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import nsutil

LXC_DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
INIT_NAME = "dflashops-ctinit"


@dataclass
class HostConfig:
    name: str
    dir: str
    netns: str | None
    testbed_dir: str
    private: dict[str, str] = field(default_factory=dict)  # host path -> real dir
    ro_shares: list[str] = field(default_factory=list)  # real paths kept visible read-only

    @property
    def lxcpath(self) -> str:
        return os.path.join(self.dir, "lxc")

    def ct_dir(self, vmid: int) -> str:
        return os.path.join(self.dir, "ct", str(vmid))

    def save(self) -> None:
        write_json(os.path.join(self.dir, "host.json"), asdict(self))

    @classmethod
    def load(cls, path: str) -> HostConfig:
        with open(path) as fh:
            return cls(**json.load(fh))


@dataclass
class CtConfig:
    vmid: int
    kind: str  # "ns" or "lxc"
    hostname: str
    dir: str
    private: dict[str, str] = field(default_factory=dict)  # container path -> real dir

    def save(self) -> None:
        write_json(os.path.join(self.dir, "ct.json"), asdict(self))


def write_json(path: str, data: object) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump(data, fh)
    os.replace(tmp, path)


def read_json(path: str, default: object = None) -> object:
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return default


def load_ct(host: HostConfig, vmid: int) -> CtConfig | None:
    data = read_json(os.path.join(host.ct_dir(vmid), "ct.json"))
    return CtConfig(**data) if isinstance(data, dict) else None


def list_cts(host: HostConfig) -> list[CtConfig]:
    root = Path(host.dir, "ct")
    found = []
    for entry in sorted(root.iterdir() if root.is_dir() else [], key=lambda p: p.name):
        if entry.name.isdigit() and (ct := load_ct(host, int(entry.name))) is not None:
            found.append(ct)
    return sorted(found, key=lambda c: c.vmid)


def faults(host: HostConfig) -> dict:
    data = read_json(os.path.join(host.dir, "faults.json"), {})
    return data if isinstance(data, dict) else {}


def init_pid(ct: CtConfig) -> int | None:
    """The pid (in the initial pid namespace) of the container's init, or None when stopped."""
    info = read_json(os.path.join(ct.dir, "init.json"))
    if not isinstance(info, dict):
        return None
    pid = info.get("pid")
    if not isinstance(pid, int) or nsutil.proc_start_time(pid) != info.get("start"):
        return None
    return pid


def is_running(ct: CtConfig) -> bool:
    return init_pid(ct) is not None


def netns_prefix(host: HostConfig, *, on_host: bool) -> list[str]:
    """argv prefix that runs a command in the host's network namespace (lxc-* need it: their
    command socket is an abstract unix socket, per netns). `on_host`: we are there already."""
    if on_host or host.netns is None:
        return []
    return ["/usr/bin/nsenter", f"--net=/run/netns/{host.netns}", "--"]


def lxc_run(host: HostConfig, argv: list[str], *, on_host: bool, **kwargs):
    return subprocess.run([*netns_prefix(host, on_host=on_host), *argv], **kwargs)
