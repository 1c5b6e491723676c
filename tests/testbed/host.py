"""A fake Proxmox VE node: a real sshd in its own namespaces, with a faithful `pct`."""

from __future__ import annotations

import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from .container import Container
from .fakepve import state
from .rootfs import cache_dir
from .slots import TestBedError, keygen

if TYPE_CHECKING:
    from .bed import TestBed

HOST_DIRS = {  # path on the fake host -> dir name under the host dir, and its mode
    "/root": ("root", 0o700),
    "/tmp": ("tmp", 0o1777),
    "/var/tmp": ("vartmp", 0o1777),
    "/workspace": ("workspace", 0o755),
    "/usr/local/sbin": ("sbin", 0o755),
}

SSHD_CONFIG = """\
ListenAddress {address}
Port {port}
HostKey {dir}/ssh/ssh_host_ed25519_key
PidFile {dir}/ssh/sshd.pid
AuthorizedKeysFile {authorized_keys}
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
UsePAM no
StrictModes no
UseDNS no
PrintMotd no
PrintLastLog no
MaxStartups 100:30:200
MaxSessions 10
Subsystem sftp internal-sftp
LogLevel VERBOSE
"""

# sh, not python, first: Python's C-locale coercion (PEP 538) would add LC_CTYPE=C.UTF-8 to
# the environment pct hands to containers; pct puts back what the caller really had.
PCT_WRAPPER = """\
#!/bin/sh
# pct of the fake Proxmox node {name} (dflashops test bed)
DFLASHOPS_PCT_LC_CTYPE="${{LC_CTYPE-__unset__}}" exec /usr/bin/python3 -IS {runner} pct {host_json} "$@"
"""


PRIVATE_ROOTS = (Path("/root"), Path("/tmp"), Path("/var/tmp"))


def ro_shares() -> list[str]:
    """Dirs under /root, /tmp or /var/tmp that hosts and ns containers (which get private ones)
    must still see, read-only: pyenv, this test run's venv and checkout (a CI clone may well
    live in /tmp), and the LXC rootfs cache (a `pct start` in a host mounts it as the lower
    layer of the container's overlay)."""
    here = Path(__file__).resolve()
    rootfs_cache = cache_dir()
    rootfs_cache.mkdir(parents=True, exist_ok=True)
    candidates = [Path("/root/.pyenv"), Path(sys.prefix), Path(sys.base_prefix), here.parents[2],
                  rootfs_cache]  # fmt: skip
    found: list[Path] = []
    for path in sorted({p.resolve() for p in candidates if p.is_dir()}, key=lambda p: len(p.parts)):
        hidden = any(root in path.parents for root in PRIVATE_ROOTS)
        if hidden and not any(f in path.parents for f in found):
            found.append(path)
    return [str(p) for p in found]


class Host:
    """Host `name` of the bed: reachable as root@address:port with the bed's client key."""

    def __init__(
        self, bed: TestBed, name: str, index: int, netns: str | None, address: str, port: int
    ):
        self.bed = bed
        self.name = name
        self.index = index
        self.netns = netns
        self.address = address
        self.port = port
        self.dir = bed.dir / "hosts" / name
        self.containers: dict[int, Container] = {}
        self._sshd: subprocess.Popen | None = None
        private = {path: str(self.dir / sub) for path, (sub, _) in HOST_DIRS.items()}
        self.config = state.HostConfig(
            name, str(self.dir), netns, bed.code_dir, private, ro_shares()
        )

    def __repr__(self) -> str:
        return f"<Host {self.name} {self.address}:{self.port}>"

    def __getitem__(self, vmid: int) -> Container:
        return self.containers[vmid]

    # --- setup -------------------------------------------------------------------------
    def create(self) -> None:
        for sub, mode in HOST_DIRS.values():
            (self.dir / sub).mkdir(parents=True)
            (self.dir / sub).chmod(mode)
        for sub in ("ssh", "ct", "lxc", "lock"):
            (self.dir / sub).mkdir()
        key = self.dir / "ssh" / "ssh_host_ed25519_key"
        keygen(key, f"root@{self.name}")
        self.host_key = key.with_suffix(".pub").read_text().split()[:2]
        (self.dir / "sshd_config").write_text(
            SSHD_CONFIG.format(
                address=self.address,
                port=self.port,
                dir=self.dir,
                authorized_keys=self.bed.dir / "client" / "authorized_keys",
            )
        )
        pct = self.dir / "sbin" / "pct"
        runner = shlex.quote(f"{self.bed.code_dir}/run_fakepve.py")
        pct.write_text(
            PCT_WRAPPER.format(name=self.name, runner=runner, host_json=shlex.quote(self.host_json))
        )
        pct.chmod(0o755)
        self.config.save()

    @property
    def host_json(self) -> str:
        return str(self.dir / "host.json")

    def start(self, timeout: float = 15) -> None:
        """Start sshd and wait until it listens (read from its log: no probe traffic)."""
        if self.running:
            return
        log_path = self.dir / "sshd.log"
        argv = self.bed.helper_argv("host", self) + [str(self.dir / "sshd_config")]
        with open(log_path, "ab") as log:
            offset = log.tell()
            self._sshd = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True
            )
        deadline = time.monotonic() + timeout
        while b"Server listening on" not in log_path.read_bytes()[offset:]:
            if self._sshd.poll() is not None or time.monotonic() > deadline:
                text = log_path.read_bytes()[offset:].decode(errors="replace")
                self.stop()
                raise TestBedError(f"sshd of {self.name} did not start:\n{text}")
            time.sleep(0.005)

    @property
    def running(self) -> bool:
        return self._sshd is not None and self._sshd.poll() is None

    @property
    def sshd_pid(self) -> int:
        if not self.running:
            raise TestBedError(f"host {self.name} is stopped")
        return self._sshd.pid

    def stop(self) -> None:
        """Stop sshd (the host goes 'down': connections are refused). Containers keep running."""
        if self._sshd is None:
            return
        if self._sshd.poll() is None:
            self._sshd.send_signal(signal.SIGTERM)
            try:
                self._sshd.wait(5)
            except subprocess.TimeoutExpired:
                self._sshd.kill()
                self._sshd.wait()
        self._sshd = None

    # --- containers --------------------------------------------------------------------
    def add_container(
        self, vmid: int, kind: str = "ns", *, start: bool = True, network: bool = False
    ) -> Container:
        """Define CT `vmid` of kind `ns` or `lxc` on this host (and start it). `network`: an
        eth0 on the host's bridge with a static address of the bed (`ct.address`), as Proxmox
        CTs have; netns mode only."""
        if not isinstance(vmid, int) or not 100 <= vmid <= 999_999_999:
            raise ValueError(f"vmid {vmid!r}: expected an integer 100..999999999")
        if vmid in self.containers:
            raise TestBedError(f"{self.name} already has CT {vmid}")
        if kind == "lxc":
            self.bed.require_lxc()
        net = self.bed.next_container_net() if network else None
        ct = Container(self, vmid, kind, net)
        ct.create()
        self.containers[vmid] = ct
        if start:
            ct.start()
        return ct

    def remove_container(self, vmid: int) -> None:
        self.containers.pop(vmid).destroy()

    def set_faults(
        self, *, corrupt_exec_stdin_at: int | None = None, slow_exec_stdin_after: int | None = None
    ) -> None:
        """Inject faults into this host's pct; no argument clears them.

        corrupt_exec_stdin_at=N: `pct exec` flips the byte at offset N of its stdin.
        slow_exec_stdin_after=N: past offset N, `pct exec` passes its stdin on at 8 MiB/s (a
        slow link, so that a test can act in the middle of a long copy)."""
        faults = {}
        if corrupt_exec_stdin_at is not None:
            faults["corrupt_exec_stdin_at"] = int(corrupt_exec_stdin_at)
        if slow_exec_stdin_after is not None:
            faults["slow_exec_stdin_after"] = int(slow_exec_stdin_after)
        state.write_json(str(self.dir / "faults.json"), faults)

    # --- inspection --------------------------------------------------------------------
    def host_path(self, path: str) -> Path:
        """Where the host's `path` lives on this machine (for its private dirs)."""
        pure = PurePosixPath(path)
        for mount, real in self.config.private.items():
            if pure == PurePosixPath(mount) or PurePosixPath(mount) in pure.parents:
                return Path(real, pure.relative_to(mount))
        return Path(pure)

    @property
    def workspace(self) -> Path:
        return self.host_path("/workspace")

    def command(self, argv: list[str]) -> list[str]:
        """The argv that runs `argv` on this host (its namespaces, not through ssh)."""
        enter = ["nsenter", "-t", str(self.sshd_pid), "-m", "-u"]
        if self.netns:
            enter.append("-n")
        return [
            *enter,
            "--wd=/root",
            "--",
            "/usr/bin/env",
            "-i",
            "HOME=/root",
            "LANG=C.UTF-8",
            "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            *argv,
        ]

    def run(
        self,
        argv: list[str],
        *,
        input: bytes | None = None,
        timeout: float = 60,
        check: bool = False,
    ) -> subprocess.CompletedProcess:
        return subprocess.run(
            self.command(argv), input=input, capture_output=True, timeout=timeout, check=check
        )

    def pct(self, *args: str | int, input: bytes | None = None) -> subprocess.CompletedProcess:
        """Run this host's pct directly (as root on the host, not through ssh)."""
        return self.run(["pct", *map(str, args)], input=input)

    def known_hosts_line(self) -> str:
        where = self.address if self.port == 22 else f"[{self.address}]:{self.port}"
        return f"{where} {' '.join(self.host_key)}\n"

    def tasks_log(self) -> str:
        """The host's task log (`TASK OK` / `TASK ERROR: ...` per push and pull)."""
        path = self.dir / "tasks.log"
        return path.read_text() if path.exists() else ""
