"""On-disk state of a fake Proxmox node: its config, its containers, faults and runtime pids.

Layout under a host dir (written by the pytest side, read by `pct`):
    host.json                 HostConfig
    faults.json               {"corrupt_exec_stdin_at": N} or {}
    tasks.log                 one `<type> <vmid>: TASK OK|TASK ERROR: ...` line per push/pull
    ct/<vmid>/ct.json         CtConfig (its existence is "the CT is defined on this node")
    ct/<vmid>/init.json       {"pid": P, "start": T}: the CT's init (running while P has
                              start time T)
    lock/pve-config-<vmid>.lock

Imports are kept light on purpose: every `pct` call starts a Python.
"""

from __future__ import annotations

import json
import os

LXC_DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
INIT_NAME = "dflashops-ctinit"


class HostConfig:
    """name, dir, netns (None: no netns), testbed_dir, private (host path -> real dir) and
    ro_shares (real dirs under /root, /tmp, /var/tmp kept visible read-only)."""

    def __init__(self, name: str, dir: str, netns: str | None, testbed_dir: str,
                 private: dict[str, str], ro_shares: list[str]):  # fmt: skip
        self.name = name
        self.dir = dir
        self.netns = netns
        self.testbed_dir = testbed_dir
        self.private = private
        self.ro_shares = ro_shares

    @property
    def lxcpath(self) -> str:
        return os.path.join(self.dir, "lxc")

    def ct_dir(self, vmid: int) -> str:
        return os.path.join(self.dir, "ct", str(vmid))

    def save(self) -> None:
        write_json(os.path.join(self.dir, "host.json"), vars(self))

    @classmethod
    def load(cls, path: str) -> HostConfig:
        with open(path) as fh:
            return cls(**json.load(fh))


class CtConfig:
    """vmid, kind ("ns" or "lxc"), hostname, dir, private (CT path -> real dir) and net
    (None: only `lo`; else {"address": "A.B.C.D/24", "bridge": "vmbr0"} for its eth0)."""

    def __init__(self, vmid: int, kind: str, hostname: str, dir: str, private: dict[str, str],
                 net: dict[str, str] | None = None):  # fmt: skip
        self.vmid = vmid
        self.kind = kind
        self.hostname = hostname
        self.dir = dir
        self.private = private
        self.net = net

    def save(self) -> None:
        write_json(os.path.join(self.dir, "ct.json"), vars(self))


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
    try:
        names = os.listdir(os.path.join(host.dir, "ct"))
    except OSError:
        names = []
    found = [load_ct(host, int(name)) for name in names if name.isdigit()]
    return sorted((ct for ct in found if ct is not None), key=lambda ct: ct.vmid)


def faults(host: HostConfig) -> dict:
    data = read_json(os.path.join(host.dir, "faults.json"), {})
    return data if isinstance(data, dict) else {}


def init_pid(ct: CtConfig) -> int | None:
    """The pid (in the initial pid namespace) of the container's init, or None when stopped."""
    info = read_json(os.path.join(ct.dir, "init.json"))
    if not isinstance(info, dict):
        return None
    pid = info.get("pid")
    if not isinstance(pid, int) or proc_start_time(pid) != info.get("start"):
        return None
    return pid


def is_running(ct: CtConfig) -> bool:
    return init_pid(ct) is not None


def proc_start_time(pid: int, *, proc_fd: int | None = None) -> int | None:
    """The process start time (clock ticks since boot), or None if gone or a zombie.
    `proc_fd`: an open /proc dir to look in instead of /proc."""
    try:
        path = f"{pid}/stat" if proc_fd is not None else f"/proc/{pid}/stat"
        fd = os.open(path, os.O_RDONLY, dir_fd=proc_fd)
        try:
            raw = os.read(fd, 4096)
        finally:
            os.close(fd)
    except OSError:
        return None
    fields = raw[raw.rindex(b")") + 2 :].split()
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


def netns_prefix(host: HostConfig, *, on_host: bool) -> list[str]:
    """argv prefix that runs a command in the host's network namespace (lxc-* need it: their
    command socket is an abstract unix socket, per netns). `on_host`: we are there already."""
    if on_host or host.netns is None:
        return []
    return ["/usr/bin/nsenter", f"--net=/run/netns/{host.netns}", "--"]


def lxc_run(host: HostConfig, argv: list[str], *, on_host: bool, **kwargs):
    import subprocess

    return subprocess.run([*netns_prefix(host, on_host=on_host), *argv], **kwargs)
