"""The bed's own network: a bridge dfotbN with 10.77.(100+N).1/24, one netns per host.

Host i (1-based) is 10.77.(100+N).(10+i) on its bridge `vmbr0`, whose port `eth0` is a veth
whose other end dfotbNv<i> is a port of the bed's bridge (as a Proxmox node's vmbr0 bridges its
NIC). Containers with a network get 10.77.(100+N).(100..249) on an `eth0` bridged to their
host's vmbr0, so containers on different hosts reach each other as on a real LAN. No default
route anywhere: hosts and containers reach each other and the bridge address, nothing else.
10.77.(100+N).250 is never assigned: the "unreachable host" address.
"""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

from .slots import Slot, TestBedError

UNUSED_HOST = 250
FIRST_CT, LAST_CT = 100, 249
HOST_BRIDGE = "vmbr0"


def _run(args: list[str], stdin: str | None = None) -> None:
    proc = subprocess.run(args, input=stdin, capture_output=True, text=True)
    if proc.returncode != 0:
        raise TestBedError(f"{' '.join(args)} failed: {proc.stderr.strip()}\n{stdin or ''}")


def bridge_mac(slot: Slot, index: int) -> str:
    """A fixed address for a bridge (index 0: the bed's, i: host i's vmbr0). Left to itself a
    Linux bridge takes the lowest MAC among its ports, so a container's veth joining or leaving
    would change its host's MAC and leave every ARP cache pointing at the old one for up to a
    minute (connections to the host then get no answer). Proxmox pins vmbr0's too."""
    return f"02:df:{slot.index:02x}:00:00:{index:02x}"


def create_bridge(slot: Slot) -> None:
    bridge = slot.prefix
    gateway = slot.subnet[1]
    _run(
        ["ip", "-batch", "-"],
        f"link add {bridge} address {bridge_mac(slot, 0)} type bridge\n"
        f"addr add {gateway}/24 dev {bridge}\n"
        f"link set {bridge} up\n",
    )
    # An address nobody owns fails after ARP gives up: make that ~1 s, not 3 s.
    neigh = Path(f"/proc/sys/net/ipv4/neigh/{bridge}")
    (neigh / "mcast_solicit").write_text("2")
    (neigh / "retrans_time_ms").write_text("500")


def add_host(slot: Slot, index: int, name: str) -> tuple[str, str]:
    """Create the host's netns wired to the bridge; returns (netns name, address)."""
    netns = f"{slot.prefix}-{name}"
    veth = f"{slot.prefix}v{index}"
    address = str(slot.subnet[10 + index])
    _run(
        ["ip", "-batch", "-"],
        f"netns add {netns}\n"
        f"link add {veth} type veth peer name eth0 netns {netns}\n"
        f"link set {veth} master {slot.prefix} up\n",
    )
    _run(
        ["ip", "-n", netns, "-batch", "-"],
        f"link add {HOST_BRIDGE} address {bridge_mac(slot, index)} type bridge\n"
        f"link set eth0 master {HOST_BRIDGE}\n"
        f"addr add {address}/24 dev {HOST_BRIDGE}\n"
        f"link set eth0 up\nlink set {HOST_BRIDGE} up\nlink set lo up\n",
    )
    return netns, address


def container_address(slot: Slot, index: int) -> str:
    """The `index`-th (0-based) container address of the bed, with its prefix length."""
    if not 0 <= index <= LAST_CT - FIRST_CT:
        raise TestBedError(f"no container address left (index {index})")
    return f"{slot.subnet[FIRST_CT + index]}/24"


def unused_address(slot: Slot) -> str:
    return str(slot.subnet[UNUSED_HOST])


def netns_available() -> bool:
    """Can this process make links and network namespaces (root with CAP_NET_ADMIN)?"""
    name = f"dfotbp{os.getpid() % 100000}"
    probe = subprocess.run(["ip", "link", "add", name, "type", "bridge"], capture_output=True)
    if probe.returncode != 0:
        return False
    subprocess.run(["ip", "link", "del", name], capture_output=True)
    return Path("/run/netns").is_dir() or _can_make_run_netns()


def _can_make_run_netns() -> bool:
    try:
        Path("/run/netns").mkdir(parents=True, exist_ok=True)
        return True
    except OSError:
        return False


def free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
