"""TestBed: fake Proxmox nodes (real sshd + faithful pct) with containers, for tests.

    with TestBed(("pve1", "pve2")) as tb:
        tb["pve1"].add_container(201)
        tb.write_inventory(path, {"ct201": ("pve1", 201)})

Needs root. Network mode `netns` (each host in its own network namespace on the bed's bridge,
port 22) or, where that is impossible, `loopback` (127.0.0.1, one port per host).
$DFLASHOPS_TESTBED_NET=auto|netns|loopback chooses; `tb.mode` says which is active.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from . import inventory, network, rootfs, slots
from .host import Host
from .slots import TestBedError

CODE_DIR = str(Path(__file__).resolve().parent)


class LxcUnavailable(TestBedError):
    """LXC containers can't be had here (the reason is the message)."""


class TestBed:
    """Hosts by name (`tb["pve1"]`), each with containers by vmid (`tb["pve1"][201]`)."""

    __test__ = False

    def __init__(
        self,
        hosts: tuple[str, ...] | list[str] = ("pve1", "pve2"),
        *,
        lxc: str | None = None,
        net: str | None = None,
    ):
        self.lxc_mode = lxc or rootfs.lxc_mode()
        self._net = (net or os.environ.get("DFLASHOPS_TESTBED_NET", "auto")).lower()
        if self._net not in ("auto", "netns", "loopback"):
            raise TestBedError(f"network mode {self._net!r}: expected auto, netns or loopback")
        self._initial_hosts = list(hosts)
        self.hosts: dict[str, Host] = {}
        self.mode = ""
        self.slot: slots.Slot | None = None
        self.code_dir = CODE_DIR
        self.start_seconds = 0.0
        self._lxc_error: str | None = None
        self._rootfs: Path | None = None
        self._refused: socket.socket | None = None
        self._container_nets = 0

    def __enter__(self) -> TestBed:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    # --- lifecycle ---------------------------------------------------------------------
    def start(self) -> TestBed:
        if os.geteuid() != 0:
            raise TestBedError("the test bed needs root (namespaces, sshd, LXC)")
        started = time.monotonic()
        want_netns = self._net in ("auto", "netns")
        self.mode = "netns" if want_netns and network.netns_available() else "loopback"
        if self._net == "netns" and self.mode != "netns":
            raise TestBedError("DFLASHOPS_TESTBED_NET=netns but network namespaces are unavailable")
        self.slot = slots.acquire(need_subnet=self.mode == "netns")
        try:
            self._prepare()
            if self.lxc_mode == "require":
                self.require_lxc()
            for name in self._initial_hosts:
                self.add_host(name)
        except BaseException:
            self.close()
            raise
        self.start_seconds = time.monotonic() - started
        return self

    @property
    def dir(self) -> Path:
        if self.slot is None:
            raise TestBedError("the test bed is not started")
        return self.slot.dir

    def _prepare(self) -> None:
        for path in (Path("/workspace"), Path("/run/sshd")):
            path.mkdir(mode=0o755, exist_ok=True)  # mount points / sshd privsep dir
        client = self.dir / "client"
        client.mkdir(mode=0o700)
        slots.keygen(client / "id_ed25519", "dflashops-testbed")
        (client / "authorized_keys").write_text((client / "id_ed25519.pub").read_text())
        if self.mode == "netns":
            network.create_bridge(self.slot)
        else:
            self._refused = socket.socket()
            self._refused.bind(("127.0.0.1", 0))  # bound, never listening: connections refused

    def close(self) -> None:
        """Stop everything the bed started and remove its dirs, namespaces and links."""
        for host in self.hosts.values():
            host.stop()
        if self.slot is not None:
            self.slot.release()
        if self._refused is not None:
            self._refused.close()
            self._refused = None

    def add_host(self, name: str) -> Host:
        """Start one more fake host (hostname `name`)."""
        if name in self.hosts:
            raise TestBedError(f"host {name} exists already")
        index = len(self.hosts) + 1
        if self.mode == "netns":
            netns, address = network.add_host(self.slot, index, name)
            host = Host(self, name, index, netns, address, 22)
        else:
            host = Host(self, name, index, None, "127.0.0.1", network.free_loopback_port())
        host.create()
        self.hosts[name] = host
        host.start()
        self.write_known_hosts(self.known_hosts_path)
        return host

    def next_container_net(self) -> dict[str, str]:
        """A new container network config: a free bed address on the host's bridge."""
        if self.mode != "netns":
            raise TestBedError("container networks need netns mode (DFLASHOPS_TESTBED_NET)")
        address = network.container_address(self.slot, self._container_nets)
        self._container_nets += 1
        return {"address": address, "bridge": network.HOST_BRIDGE}

    def helper_argv(self, command: str, host: Host) -> list[str]:
        return ["/usr/bin/python3", "-IS", f"{CODE_DIR}/run_fakepve.py", command, host.host_json]

    # --- LXC ---------------------------------------------------------------------------
    def require_lxc(self) -> None:
        """Raise LxcUnavailable (TestBedError in `require` mode) unless LXC containers work."""
        if self._rootfs is not None:
            return
        if self._lxc_error is None:
            if self.lxc_mode == "0":
                self._lxc_error = "LXC tier disabled (DFLASHOPS_TESTBED_LXC=0)"
            else:
                try:
                    self._rootfs = rootfs.ensure_rootfs()
                    return
                except TestBedError as err:
                    self._lxc_error = f"LXC tier unavailable: {err}"
        if self.lxc_mode == "require":
            raise TestBedError(f"{self._lxc_error} (DFLASHOPS_TESTBED_LXC=require)")
        raise LxcUnavailable(self._lxc_error)

    @property
    def lxc_available(self) -> bool:
        try:
            self.require_lxc()
        except LxcUnavailable:
            return False
        return True

    @property
    def lxc_reason(self) -> str:
        """Why LXC is unavailable ('' when it is available)."""
        return "" if self.lxc_available else str(self._lxc_error)

    @property
    def rootfs(self) -> Path:
        self.require_lxc()
        return self._rootfs

    # --- what tests hand to dflashops --------------------------------------------------
    @property
    def client_key(self) -> Path:
        """The private key every fake host accepts for root."""
        return self.dir / "client" / "id_ed25519"

    @property
    def known_hosts_path(self) -> Path:
        """A known_hosts file pinning every host of the bed (kept up to date)."""
        return self.dir / "client" / "known_hosts"

    def unused_endpoint(self) -> tuple[str, int]:
        """(address, port) on the bed's own network where nothing answers.

        netns mode: an address on the bridge no host owns (connect fails with
        EHOSTUNREACH after about a second). loopback mode: a refused port."""
        if self.mode == "netns":
            return network.unused_address(self.slot), 22
        return "127.0.0.1", self._refused.getsockname()[1]

    def unused_address(self) -> str:
        return self.unused_endpoint()[0]

    def known_hosts_line(self, host: str | Host) -> str:
        return self._host(host).known_hosts_line()

    def write_known_hosts(self, path: str | Path, hosts=None) -> Path:
        """Write known_hosts lines for `hosts` (names or Hosts; default all) to `path`."""
        chosen = self.hosts.values() if hosts is None else [self._host(h) for h in hosts]
        path = Path(path)
        path.write_text("".join(h.known_hosts_line() for h in chosen))
        return path

    def write_inventory(
        self,
        path: str | Path,
        targets: dict,
        *,
        pin_keys: bool = True,
        extra_defaults: dict | None = None,
        extra_hosts: dict | None = None,
    ) -> Path:
        """Write a contract-format hosts.yaml; see inventory.write_inventory."""
        return inventory.write_inventory(
            self,
            Path(path),
            targets,
            pin_keys=pin_keys,
            extra_defaults=extra_defaults,
            extra_hosts=extra_hosts,
        )

    def _host(self, host: str | Host) -> Host:
        return host if isinstance(host, Host) else self.hosts[host]

    # --- talking to hosts (paramiko, pinned keys, RejectPolicy) --------------------------
    def ssh(self, host: str | Host, **kwargs):
        from . import sshclient

        return sshclient.connect(self, self._host(host), **kwargs)

    def ssh_run(self, host: str | Host, command: str | list[str], *, stdin=None, timeout=120):
        """Run `command` (a string, or an argv joined with shlex.join) on a host over ssh;
        returns SSHResult(rc, stdout, stderr). `stdin`: bytes or a file path."""
        from . import sshclient

        with self.ssh(host) as client:
            return sshclient.run(client, command, stdin=stdin, timeout=timeout)


@contextmanager
def running(containers: dict[str, list[int] | tuple[int, ...]]) -> Iterator[TestBed]:
    """A bed with these hosts, each with these ns containers, taken down afterwards."""
    bed = TestBed(tuple(containers)).start()
    try:
        for host, vmids in containers.items():
            for vmid in vmids:
                bed[host].add_container(vmid, "ns")
        yield bed
    finally:
        bed.close()
