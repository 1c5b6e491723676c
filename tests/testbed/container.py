"""A container on a fake host: `ns` (namespaces over this machine's root) or `lxc`."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from .fakepve import launch, state
from .slots import TestBedError

if TYPE_CHECKING:
    from .host import Host

KINDS = ("ns", "lxc")
RUN_ENV = {"PATH": state.LXC_DEFAULT_PATH, "HOME": "/root", "LANG": "C.UTF-8"}


class Container:
    """CT `vmid` on `host`; `pct` on that host sees it exactly as the tests do."""

    def __init__(self, host: Host, vmid: int, kind: str, net: dict[str, str] | None = None):
        if kind not in KINDS:
            raise ValueError(f"container kind {kind!r}: expected one of {KINDS}")
        self.host = host
        self.vmid = vmid
        self.kind = kind
        self.hostname = f"ct{vmid}"
        self.dir = host.dir / "ct" / str(vmid)
        private = {"/workspace": str(self.dir / "workspace")}
        if kind == "ns":
            private = {"/root": str(self.dir / "root"), "/tmp": str(self.dir / "tmp"), **private}
        self.config = state.CtConfig(vmid, kind, self.hostname, str(self.dir), private, net)

    @property
    def address(self) -> str | None:
        """Its IPv4 address on the host's bridge (None: no network, only `lo`)."""
        return self.config.net["address"].split("/")[0] if self.config.net else None

    def __repr__(self) -> str:
        state_word = "running" if self.running else "stopped"
        return f"<Container {self.host.name}/{self.vmid} {self.kind} {state_word}>"

    def create(self) -> None:
        self.dir.mkdir(parents=True)
        self._make_private_dirs()
        if self.kind == "lxc":
            lxc_dir = Path(self.host.config.lxcpath, str(self.vmid))
            lxc_dir.mkdir(parents=True, exist_ok=True)
            cgroup = f"{self.host.bed.slot.prefix}-{self.host.name}-{self.vmid}"
            bed = self.host.bed
            text = launch.lxc_config(self.config, str(bed.rootfs), bed.code_dir, cgroup)
            (lxc_dir / "config").write_text(text)
        self.config.save()

    def _make_private_dirs(self) -> None:
        (self.dir / "workspace").mkdir(exist_ok=True)
        if self.kind == "ns":
            (self.dir / "root").mkdir(mode=0o700, exist_ok=True)
            (self.dir / "tmp").mkdir(exist_ok=True)
            (self.dir / "tmp").chmod(0o1777)
        else:
            (self.dir / "overlay" / "delta").mkdir(parents=True, exist_ok=True)

    @property
    def pid(self) -> int | None:
        """The init's pid on this machine, None when stopped."""
        return state.init_pid(self.config)

    @property
    def running(self) -> bool:
        return self.pid is not None

    def start(self) -> None:
        self._helper("ct-start")

    def stop(self) -> None:
        self._helper("ct-stop")

    def processes(self) -> list[int]:
        """Every process in the container's pid namespace (its init first)."""
        init = self.pid
        if init is None:
            return []
        ns = os.readlink(f"/proc/{init}/ns/pid")
        found = [init]
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and int(entry.name) != init:
                with contextlib.suppress(OSError):
                    if os.readlink(entry / "ns" / "pid") == ns:
                        found.append(int(entry.name))
        return found

    def freeze(self) -> None:
        """Every process inside stops where it is (as `pct suspend` or a cgroup freeze does):
        the host and its sshd go on answering, nothing inside moves."""
        for pid in self.processes():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)

    def thaw(self) -> None:
        for pid in self.processes():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    def _helper(self, command: str) -> None:
        argv = [*self.host.bed.helper_argv(command, self.host), str(self.vmid)]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise TestBedError(f"{command} {self.host.name}/{self.vmid}: {proc.stderr.strip()}")

    def reset(self) -> None:
        """Stop, forget everything written inside (workspace, /root, /tmp, rootfs), start."""
        self.stop()
        for name in ("workspace", "root", "tmp", "overlay"):
            shutil.rmtree(self.dir / name, ignore_errors=True)
        self._make_private_dirs()
        self.start()

    def destroy(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
        shutil.rmtree(Path(self.host.config.lxcpath, str(self.vmid)), ignore_errors=True)

    def host_path(self, path: str) -> Path:
        """Where the container's `path` lives on this machine (for assertions)."""
        pure = PurePosixPath(path)
        if not pure.is_absolute():
            raise ValueError(f"{path!r}: expected an absolute path inside the container")
        for mount, real in self.config.private.items():
            if pure == PurePosixPath(mount) or PurePosixPath(mount) in pure.parents:
                return Path(real, pure.relative_to(mount))
        pid = self.pid
        if pid is not None:
            return Path(f"/proc/{pid}/root", pure.relative_to("/"))
        if self.kind == "ns":
            return Path(pure)
        delta = self.dir / "overlay" / "delta" / pure.relative_to("/")
        return delta if delta.exists() else self.host.bed.rootfs / pure.relative_to("/")

    def command(self, argv: list[str], *, env: dict[str, str] | None = None) -> list[str]:
        """The argv that runs `argv` inside this container, from this machine."""
        pid = self.pid
        if pid is None:
            raise TestBedError(f"container {self.host.name}/{self.vmid} is not running")
        full_env = {**RUN_ENV, **(env or {})}
        if self.kind == "lxc":
            sets = [f"--set-var={k}={v}" for k, v in full_env.items()]
            attach = ["lxc-attach", "-P", self.host.config.lxcpath, "-n", str(self.vmid)]
            return [
                *state.netns_prefix(self.host.config, on_host=False),
                *attach,
                "--clear-env",
                *sets,
                "--",
                *argv,
            ]
        ns = ["nsenter", "-t", str(pid), "-m", "-u", "-i", "-n", "-p", "-r", "--wd=/root"]
        sets = [f"{k}={v}" for k, v in full_env.items()]
        return [*ns, "--", "/usr/bin/env", "-i", *sets, *argv]

    def run(
        self,
        argv: list[str],
        *,
        input: bytes | None = None,
        check: bool = False,
        timeout: float = 60,
        env: dict[str, str] | None = None,
    ) -> subprocess.CompletedProcess:
        """Run argv inside the container directly (no ssh, no pct): for setup and inspection.

        Runs as root in /root with PATH, HOME=/root and LANG=C.UTF-8 (plus `env`)."""
        return subprocess.run(
            self.command(argv, env=env),
            input=input,
            capture_output=True,
            check=check,
            timeout=timeout,
            cwd="/root",
        )
