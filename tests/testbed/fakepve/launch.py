"""Starting and stopping fake hosts (sshd) and their containers (ns or lxc).

A host: network namespace (when there is one) + new mount and uts namespaces, where
/root, /tmp, /var/tmp, /workspace and /usr/local/sbin are bind-mounted to per-host dirs;
then it becomes `sshd -D`.

An ns container: new mount, pid, uts, ipc and network namespaces over the machine's own root,
with private /root, /tmp, /workspace and /dev/shm; pid 1 is ctinit.reap_forever().
An lxc container: `lxc-start` of a config written by lxc_config(), in the host's netns.
A container with a `net` config gets what Proxmox gives it: a veth pair whose host end
`veth<vmid>i0` is a port of the host's bridge (vmbr0) and whose other end is the container's
`eth0`, with a static address.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

from . import ctinit, nsutil, state

NS_FLAGS = (
    nsutil.CLONE_NEWNS
    | nsutil.CLONE_NEWUTS
    | nsutil.CLONE_NEWIPC
    | nsutil.CLONE_NEWNET
    | nsutil.CLONE_NEWPID
)


class StartError(RuntimeError):
    pass


def host_exec_sshd(host: state.HostConfig, sshd_config: str) -> None:
    """Become the fake host's sshd (never returns)."""
    if host.netns:
        nsutil.setns(f"/run/netns/{host.netns}", nsutil.CLONE_NEWNET)
    nsutil.unshare(nsutil.CLONE_NEWNS | nsutil.CLONE_NEWUTS)
    nsutil.make_rprivate("/")
    # copies of other beds' netns mounts here would keep those namespaces (and veths) alive
    nsutil.umount_lazy("/run/netns")
    nsutil.sethostname(host.name)
    mount_private(host.private, host.ro_shares)
    os.execv("/usr/sbin/sshd", ["/usr/sbin/sshd", "-D", "-e", "-f", sshd_config])


def mount_private(private: dict[str, str], ro_shares: list[str]) -> None:
    """Private dirs over /root, /tmp, ...; shares under them stay visible there, read-only."""
    for share in ro_shares:
        for mount, real in private.items():
            if share.startswith(mount + "/") and os.path.isdir(share):
                target = os.path.join(real, share[len(mount) + 1 :])
                os.makedirs(target, exist_ok=True)
                nsutil.bind(share, target, readonly=True)
    for path, real in private.items():
        os.makedirs(path, exist_ok=True)
        nsutil.bind(real, path)


def start_container(host: state.HostConfig, ct: state.CtConfig, *, from_host: bool) -> None:
    """Start the CT in a child process (starting leaves the starter in the CT's namespaces),
    then, from our own namespaces, give it its network."""
    read, write = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(read)
        code, message = 0, b""
        try:
            if ct.kind == "lxc":
                start_lxc(host, ct, on_host=from_host)
            else:
                start_ns(host, ct, from_host=from_host)
        except BaseException as err:  # noqa: BLE001 (reported through the pipe)
            code, message = 1, str(err).encode()
        finally:
            os.write(write, message)
            sys.stdout.flush()
            os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        message = pipe.read().decode(errors="replace")
    _, status = os.waitpid(child, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise StartError(message or f"startup for container '{ct.vmid}' failed")
    if ct.net:
        plumb_network(host, ct, on_host=from_host)


def plumb_network(host: state.HostConfig, ct: state.CtConfig, *, on_host: bool) -> None:
    """veth<vmid>i0 on the host's bridge, its peer the CT's eth0 with the CT's address."""
    pid = state.init_pid(ct)
    veth = f"veth{ct.vmid}i0"
    net = ct.net
    in_host = [] if on_host or host.netns is None else ["-n", host.netns]
    steps = [
        ["ip", *in_host, "link", "add", veth, "type", "veth", "peer", "name", "eth0",
         "netns", str(pid)],
        ["ip", *in_host, "link", "set", veth, "master", net["bridge"], "up"],
        ["nsenter", "-t", str(pid), "-n", "ip", "addr", "add", net["address"], "dev", "eth0"],
        ["nsenter", "-t", str(pid), "-n", "ip", "link", "set", "eth0", "up"],
    ]  # fmt: skip
    for argv in steps:
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode != 0:
            raise StartError(f"network of CT {ct.vmid}: {' '.join(argv)}: {done.stderr.strip()}")


def start_ns(host: state.HostConfig, ct: state.CtConfig, *, from_host: bool) -> None:
    """Make the container's namespaces in this process, fork its init, record it.

    Call it from a process that exits soon after: this process is left in the new mount ns.
    """
    _remove(ct.dir, "init.json")
    nsutil.unshare(NS_FLAGS)
    nsutil.make_rprivate("/")
    nsutil.umount_lazy("/run/netns")
    if from_host:
        for path in reversed(list(host.private)):
            nsutil.umount_lazy(path)
    nsutil.sethostname(ct.hostname)
    nsutil.loopback_up()
    mount_private(ct.private, host.ro_shares)
    if os.path.isdir("/dev/shm"):
        nsutil.mount("tmpfs", "/dev/shm", "tmpfs", nsutil.MS_NOSUID | nsutil.MS_NODEV, "mode=1777")
    # The child mounts its own /proc over ours (same mount ns): keep a handle on this one.
    old_proc = os.open("/proc", os.O_RDONLY | os.O_DIRECTORY)
    child = os.fork()
    if child == 0:
        _become_init()
    start = state.proc_start_time(child, proc_fd=old_proc)
    if start is None:
        raise StartError(f"container init {child} died at once")
    state.write_json(os.path.join(ct.dir, "init.json"), {"pid": child, "start": start})


def _become_init() -> None:
    try:
        os.setsid()
        nsutil.mount("proc", "/proc", "proc", nsutil.MS_NOSUID | nsutil.MS_NODEV | nsutil.MS_NOEXEC)
        os.chdir("/root")
        null = os.open("/dev/null", os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.closerange(3, 65536)
        ctinit.reap_forever()
    finally:
        os._exit(1)


def start_lxc(host: state.HostConfig, ct: state.CtConfig, *, on_host: bool) -> None:
    _remove(ct.dir, "init.json")
    name = ["-P", host.lxcpath, "-n", str(ct.vmid)]
    proc = state.lxc_run(
        host,
        ["/usr/bin/lxc-start", *name],
        on_host=on_host,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    info = state.lxc_run(
        host, ["/usr/bin/lxc-info", *name, "-pH"], on_host=on_host, capture_output=True
    )
    pid = info.stdout.strip()
    if proc.returncode != 0 or not pid.isdigit():
        raise StartError(
            f"startup for container '{ct.vmid}' failed\n"
            + proc.stderr.decode(errors="replace")
            + _log_errors(os.path.join(ct.dir, "lxc.log"))
        )
    start = state.proc_start_time(int(pid))
    if start is None:
        raise StartError(f"container init {pid} died at once")
    state.write_json(os.path.join(ct.dir, "init.json"), {"pid": int(pid), "start": start})


def _log_errors(path: str) -> str:
    try:
        with open(path, errors="replace") as fh:
            return "".join(line for line in fh if " ERROR " in line)[-4000:]
    except OSError:
        return ""


def stop_container(host: state.HostConfig, ct: state.CtConfig, *, from_host: bool) -> None:
    pid = state.init_pid(ct)
    if ct.kind == "lxc":
        argv = ["/usr/bin/lxc-stop", "-P", host.lxcpath, "-n", str(ct.vmid), "-k"]
        state.lxc_run(host, argv, on_host=from_host, capture_output=True, timeout=30)
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while state.proc_start_time(pid) is not None and time.monotonic() < deadline:
            time.sleep(0.005)
    _remove(ct.dir, "init.json")


def _remove(directory: str, *names: str) -> None:
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(directory, name))


CGROUP_PARENT = "dflashops-testbed"


def lxc_config(ct: state.CtConfig, rootfs: str, testbed_dir: str, cgroup: str) -> str:
    """The LXC config of a privileged, network-less CT whose rootfs is an overlay of `rootfs`.

    `cgroup`: a name unique on this machine; its cgroups are CGROUP_PARENT/<cgroup>[.monitor]
    (LXC's default lxc.payload.<vmid> would collide between hosts and beds, and leak)."""
    init = os.path.join(testbed_dir, "fakepve", "ctinit.py")
    lines = [
        f"lxc.cgroup.dir.container = {CGROUP_PARENT}/{cgroup}",
        f"lxc.cgroup.dir.monitor = {CGROUP_PARENT}/{cgroup}.monitor",
        f"lxc.uts.name = {ct.hostname}",
        f"lxc.rootfs.path = overlay:{rootfs}:{ct.dir}/overlay/delta",
        "lxc.net.0.type = empty",
        "lxc.apparmor.profile = unconfined",
        "lxc.include = /usr/share/lxc/config/common.conf",
        "lxc.tty.max = 0",
        "lxc.console.path = none",
        f"lxc.mount.entry = {ct.private['/workspace']} workspace none bind,create=dir 0 0",
        f"lxc.mount.entry = {init} usr/sbin/{state.INIT_NAME} none bind,ro,create=file 0 0",
        f"lxc.init.cmd = /usr/bin/python3 /usr/sbin/{state.INIT_NAME} {ct.dir}",
        f"lxc.log.file = {ct.dir}/lxc.log",
        "lxc.log.level = WARN",
    ]
    return "\n".join(lines) + "\n"
