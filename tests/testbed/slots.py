"""Slots: several test beds (parallel pytest runs) on one machine, and cleanup after crashes.

Slot N owns the dir $DFLASHOPS_TESTBED_DIR/slotN (default /var/lib/dflashops-testbed), the
links and network namespaces named dfotbN*, and the subnet 10.77.(100+N).0/24. A slot is
held with a flock on slotN.lock for the bed's lifetime; a slot whose lock is free but whose
dir, netns or links still exist was left by a crashed run and is cleaned before reuse.
Cleaning kills every process whose command line names the slot dir or that lives in one of
the slot's network namespaces, deletes the namespaces and links, then the dir.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from .fakepve import nsutil, state
from .fakepve.launch import CGROUP_PARENT

MAX_SLOTS = 32


class TestBedError(RuntimeError):
    """The test bed could not be set up."""

    __test__ = False


def base_dir() -> Path:
    return Path(os.environ.get("DFLASHOPS_TESTBED_DIR", "/var/lib/dflashops-testbed"))


@dataclass
class Slot:
    index: int
    dir: Path
    lock_fd: int

    @property
    def prefix(self) -> str:
        return f"dfotb{self.index}"

    @property
    def subnet(self) -> ipaddress.IPv4Network:
        return subnet_of(self.index)

    def release(self) -> None:
        if self.lock_fd < 0:
            return
        clean(self.index)
        os.close(self.lock_fd)
        self.lock_fd = -1


def subnet_of(index: int) -> ipaddress.IPv4Network:
    return ipaddress.IPv4Network(f"10.77.{100 + index}.0/24")


def acquire(*, need_subnet: bool) -> Slot:
    """Lock the first usable slot; clean every stale slot met on the way."""
    base = base_dir()
    base.mkdir(parents=True, exist_ok=True)
    mine: Slot | None = None
    links, netns = _all_links(), _all_netns()
    for index in range(MAX_SLOTS):
        fd = os.open(base / f"slot{index}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        if _leftovers(index, links, netns):
            clean(index)
        if mine is None and (not need_subnet or _subnet_free(subnet_of(index))):
            mine = Slot(index, base / f"slot{index}", fd)
        else:
            os.close(fd)
    if mine is None:
        raise TestBedError(f"no free test bed slot under {base} (all {MAX_SLOTS} busy)")
    mine.dir.mkdir(mode=0o755)
    return mine


def _leftovers(index: int, links: list[str], netns: list[str]) -> bool:
    prefix = f"dfotb{index}"
    return (
        (base_dir() / f"slot{index}").exists()
        or any(_is_netns_of(prefix, name) for name in netns)
        or any(_is_link_of(prefix, name) for name in links)
    )


def _subnet_free(subnet: ipaddress.IPv4Network) -> bool:
    """True when no address or route of this machine overlaps the subnet."""
    out = _ip(["-o", "-4", "addr", "show"]) + _ip(["-4", "route", "show", "table", "all"])
    for word in out.split():
        try:
            net = ipaddress.IPv4Network(word, strict=False)
        except ValueError:
            continue
        if net.overlaps(subnet) and net.prefixlen > 0:
            return False
    return True


def _ip(args: list[str]) -> str:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    return proc.stdout


def _all_netns() -> list[str]:
    try:
        return os.listdir("/run/netns")
    except OSError:
        return []


def _all_links() -> list[str]:
    names = []
    for line in _ip(["-o", "link", "show"]).splitlines():
        parts = line.split(":", 2)
        if len(parts) > 1:
            names.append(parts[1].strip().split("@")[0])
    return names


def _is_netns_of(prefix: str, name: str) -> bool:
    return name.startswith(prefix + "-")


def _is_link_of(prefix: str, name: str) -> bool:
    """The bridge `dfotbN` and its veths `dfotbNv<i>`."""
    return name == prefix or (name.startswith(prefix + "v") and name[len(prefix) + 1 :].isdigit())


def _netns_names(prefix: str) -> list[str]:
    return [name for name in _all_netns() if _is_netns_of(prefix, name)]


def _link_names(prefix: str) -> list[str]:
    return [name for name in _all_links() if _is_link_of(prefix, name)]


def clean(index: int) -> None:
    prefix = f"dfotb{index}"
    slot_dir = base_dir() / f"slot{index}"
    netns = _netns_names(prefix)
    kill_processes(str(slot_dir) + "/", netns)
    for name in netns:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    for name in _link_names(prefix):
        subprocess.run(["ip", "link", "del", name], capture_output=True)
    _unmount_under(str(slot_dir) + "/")
    _remove_cgroups(prefix + "-")
    shutil.rmtree(slot_dir, ignore_errors=True)


def kill_processes(marker: str, netns: list[str]) -> None:
    """SIGKILL processes whose argv mentions `marker` or that live in one of `netns`."""
    inodes = set()
    for name in netns:
        with contextlib.suppress(OSError):
            inodes.add(os.stat(f"/run/netns/{name}").st_ino)
    spared = _ancestors()
    victims = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in spared:
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if marker.encode() in cmdline or nsutil.ns_inode(entry, "net") in inodes:
            victims.append(int(entry))
    for pid in victims:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while any(state.proc_start_time(p) is not None for p in victims):
        if time.monotonic() > deadline:
            raise TestBedError(f"processes {victims} survived SIGKILL")
        time.sleep(0.01)


def _ancestors() -> set[int]:
    pids, pid = set(), os.getpid()
    while pid > 1:
        pids.add(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_bytes()
        except OSError:
            break
        pid = int(stat[stat.rindex(b")") + 2 :].split()[1])
    return pids


def _remove_cgroups(name_prefix: str) -> None:
    """rmdir the slot's LXC cgroups (CGROUP_PARENT/<prefix>-...) in every hierarchy."""
    roots = [Path("/sys/fs/cgroup"), *Path("/sys/fs/cgroup").glob("*")]
    for parent in (root / CGROUP_PARENT for root in roots):
        for top in parent.glob(name_prefix + "*") if parent.is_dir() else []:
            for path in sorted(top.rglob("*"), key=lambda p: len(p.parts), reverse=True) + [top]:
                if path.is_dir():
                    _rmdir_retrying(path)


def _rmdir_retrying(path: Path) -> None:
    for _ in range(50):
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:  # EBUSY while the last tasks exit
            time.sleep(0.02)


def _unmount_under(prefix: str) -> None:
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].encode().decode("unicode_escape")
        if point.startswith(prefix):
            points.append(point)
    for point in sorted(points, key=len, reverse=True):
        nsutil.umount_lazy(point)


def keygen(path, comment: str) -> None:
    """A new ed25519 key pair at `path` (and `path`.pub), without a passphrase."""
    cmd = ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)]
    subprocess.run(cmd, check=True, capture_output=True)
