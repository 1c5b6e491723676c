"""A faithful `pct` for the fake Proxmox nodes (pve-container's src/PVE/CLI/pct.pm).

Reproduced on purpose, including the dangerous parts:
- options are parsed with Getopt::Long permute: `pct exec 201 ls -la` is a parse error;
- errors are Perl `die`s: message on stderr, exit 255;
- `exec` runs argv without a shell, with PATH forced to /sbin:/bin:/usr/sbin:/usr/bin and
  SSL_CERT_FILE/SSL_CERT_DIR removed (`--keep-env 0`: what `lxc-attach --clear-env` leaves);
- `push`/`pull` failures inside the worker print the error on stderr and still EXIT 0
  (the CLI has no $upid_exit formatter for them); `pull` creates its destination first.
"""

from __future__ import annotations

import _signal  # not `signal`: its enums cost milliseconds, and every pct call pays them
import os
import sys
import time

from . import perlopts, state
from .perlopts import VMID, ParamError, Prop

PCT_PM = "/usr/share/perl5/PVE/CLI/pct.pm"
SIGPIPE, SIGXFSZ = 13, 25  # Python ignores them; exec'd programs must not inherit that
OWNER = {"user": Prop("string"), "group": Prop("string"), "perms": Prop("string")}
COMMANDS = {
    "exec": (
        ["vmid", "extra-args"],
        {"vmid": VMID, "keep-env": Prop("boolean"), "extra-args": Prop("array")},
    ),
    "push": (
        ["vmid", "file", "destination"],
        {
            "vmid": VMID,
            "file": Prop("string", False),
            "destination": Prop("string", False),
            **OWNER,
        },
    ),
    "pull": (
        ["vmid", "path", "destination"],
        {
            "vmid": VMID,
            "path": Prop("string", False),
            "destination": Prop("string", False),
            **OWNER,
        },
    ),
    "status": (["vmid"], {"vmid": VMID, "verbose": Prop("boolean")}),
    "config": (["vmid"], {"vmid": VMID, "current": Prop("boolean"), "snapshot": Prop("string")}),
    "start": (["vmid"], {"vmid": VMID, "skiplock": Prop("boolean"), "debug": Prop("boolean")}),
    "stop": (["vmid"], {"vmid": VMID, "skiplock": Prop("boolean"), "timeout": Prop("integer")}),
    "list": ([], {}),
}


class Die(Exception):
    """A Perl `die`: the text is printed as is (add the newline yourself)."""


def usage(cmd: str) -> str:
    names, props = COMMANDS[cmd]
    args = " ".join(f"[<{n}>]" if n == "extra-args" else f"<{n}>" for n in names)
    options = " [OPTIONS]" if set(props) - set(names) else ""
    return f"pct {cmd} {args}{options}".replace("  ", " ").rstrip()


def main(host_json: str, argv: list[str]) -> int:
    restore_lc_ctype()
    os.environ["PATH"] = "/sbin:/bin:/usr/sbin:/usr/bin"  # run_cli_handler does this first
    host = state.HostConfig.load(host_json)
    if not argv:
        sys.stderr.write("ERROR: no command specified\n")
        return 255
    cmd, args = argv[0], argv[1:]
    if cmd not in COMMANDS:
        sys.stderr.write(f"ERROR: unknown command 'pct {cmd}'\n")
        return 255
    try:
        names, props = COMMANDS[cmd]
        opts = perlopts.get_options(props, args, names)
        return HANDLERS[cmd](host, opts)
    except ParamError as err:
        sys.stderr.write(perlopts.format_param_error(err, usage(cmd)))
    except Die as err:
        sys.stderr.write(str(err))
    except RuntimeError as err:  # launch.StartError
        sys.stderr.write(f"{err}\n")
    sys.stderr.flush()
    return 255


def restore_lc_ctype() -> None:
    """Undo Python's C-locale coercion of LC_CTYPE (the sh wrapper saved the caller's value)."""
    saved = os.environ.pop("DFLASHOPS_PCT_LC_CTYPE", None)
    if saved == "__unset__":
        os.environ.pop("LC_CTYPE", None)
    elif saved is not None:
        os.environ["LC_CTYPE"] = saved


def load_config(host: state.HostConfig, vmid: int) -> state.CtConfig:
    ct = state.load_ct(host, vmid)
    if ct is None:
        raise Die(f"Configuration file 'nodes/{host.name}/lxc/{vmid}.conf' does not exist\n")
    return ct


def perl_die(msg: str, line: int) -> Die:
    """A die message without a trailing newline gets Perl's location appended."""
    return Die(f"{msg} at {PCT_PM} line {line}.\n")


def cmd_status(host: state.HostConfig, opts: dict) -> int:
    ct = load_config(host, opts["vmid"])
    pid = state.init_pid(ct)
    status = "running" if pid else "stopped"
    if not opts.get("verbose"):
        print(f"status: {status}")
        return 0
    info = {"name": ct.hostname, "status": status, "type": "lxc", "vmid": ct.vmid}
    if pid:
        info["pid"] = pid
    for key in sorted(info):
        print(f"{key}: {info[key]}")
    return 0


def cmd_config(host: state.HostConfig, opts: dict) -> int:
    """Sorted `key: value` lines, as `pct config` prints them."""
    ct = load_config(host, opts["vmid"])
    config = {
        "arch": "amd64",
        "cores": 2,
        "hostname": ct.hostname,
        "memory": 2048,
        "ostype": "debian",
        "rootfs": f"local:{ct.vmid}/vm-{ct.vmid}-disk-0.raw,size=8G",
        "swap": 512,
    }
    if ct.net:
        config["net0"] = (
            f"name=eth0,bridge={ct.net['bridge']},firewall=1,ip={ct.net['address']},type=veth"
        )
    for key in sorted(config):
        print(f"{key}: {config[key]}")
    return 0


def cmd_list(host: state.HostConfig, opts: dict) -> int:
    cts = state.list_cts(host)
    if cts:
        row = "%-10s %-10s %-12s %-20s"
        print(row % ("VMID", "Status", "Lock", "Name"))
        for ct in cts:
            status = "running" if state.is_running(ct) else "stopped"
            print(row % (ct.vmid, status, "", ct.hostname))
    return 0


def cmd_start(host: state.HostConfig, opts: dict) -> int:
    ct = load_config(host, opts["vmid"])
    if state.is_running(ct):
        raise Die(f"CT {ct.vmid} already running\n")
    from . import launch

    launch.start_container(host, ct, from_host=True)
    return 0


def cmd_stop(host: state.HostConfig, opts: dict) -> int:
    ct = load_config(host, opts["vmid"])
    if not state.is_running(ct):
        raise Die(f"CT {ct.vmid} not running\n")
    from . import launch

    launch.stop_container(host, ct, from_host=True)
    return 0


def cmd_exec(host: state.HostConfig, opts: dict) -> int:
    vmid = opts["vmid"]
    ct = load_config(host, vmid)
    pid = state.init_pid(ct)
    if pid is None:
        raise Die(f"container '{vmid}' not running!\n")
    argv = opts["extra-args"]
    if not argv:
        raise perl_die("missing command", 252)
    keep_env = opts.get("keep-env", 1)
    env = dict(os.environ)
    env.pop("SSL_CERT_FILE", None)
    env.pop("SSL_CERT_DIR", None)
    faults = state.faults(host)
    corrupt_at = faults.get("corrupt_exec_stdin_at")
    slow_after = faults.get("slow_exec_stdin_after")
    if ct.kind == "lxc":
        flag = "--keep-env" if keep_env else "--clear-env"
        cmd = ["/usr/bin/lxc-attach", "-P", host.lxcpath, "-n", str(vmid), flag, "--", *argv]
        if corrupt_at is None and slow_after is None:
            sys.stdout.flush()
            _signal.signal(SIGPIPE, _signal.SIG_DFL)
            _signal.signal(SIGXFSZ, _signal.SIG_DFL)
            os.execve(cmd[0], cmd, env)  # pct itself execs lxc-attach
    else:
        env = {**env, "container": "lxc"} if keep_env else attach_clear_env()
        cmd = [*ns_enter(pid), "--", *argv]
    return run_attached(cmd, env, corrupt_at, slow_after)


def attach_clear_env() -> dict[str, str]:
    """What `lxc-attach --clear-env` (LXC 5.0.2) leaves: its default PATH and container=lxc."""
    return {"PATH": state.LXC_DEFAULT_PATH, "container": "lxc"}


def ns_enter(pid: int) -> list[str]:
    """nsenter into every namespace of an ns container, keeping the caller's cwd if it exists
    there (as lxc-attach does), else /."""
    cwd = os.getcwd()
    if not os.path.isdir(f"/proc/{pid}/root{cwd}"):
        cwd = "/"
    return ["/usr/bin/nsenter", "-t", str(pid), "-m", "-u", "-i", "-n", "-p", "-r", f"--wd={cwd}"]


def run_attached(
    cmd: list[str], env: dict[str, str], corrupt_at: int | None, slow_after: int | None = None
) -> int:
    """Run the attached command with our stdio; exit code as lxc-attach reports it."""
    sigdef = (SIGPIPE, SIGXFSZ)
    if corrupt_at is None and slow_after is None:
        pid = os.posix_spawn(cmd[0], cmd, env, setsigdef=sigdef)
    else:
        read_end, write_end = os.pipe()
        actions = [(os.POSIX_SPAWN_DUP2, read_end, 0), (os.POSIX_SPAWN_CLOSE, write_end)]
        pid = os.posix_spawn(cmd[0], cmd, env, file_actions=actions, setsigdef=sigdef)
        os.close(read_end)
        pump_faulty(write_end, corrupt_at, slow_after)
    _signal.signal(_signal.SIGINT, _signal.SIG_IGN)
    rc = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    return 128 - rc if rc < 0 else rc


SLOW_BYTES_PER_S = 8 << 20


def pump_faulty(write_end: int, corrupt_at: int | None, slow_after: int | None) -> None:
    """Copy our stdin to the pipe, flipping the byte at `corrupt_at` and, past `slow_after`,
    at SLOW_BYTES_PER_S (the injected faults)."""
    pos = 0
    try:
        while chunk := os.read(0, 1 << 20):
            if corrupt_at is not None and pos <= corrupt_at < pos + len(chunk):
                data = bytearray(chunk)
                data[corrupt_at - pos] ^= 0xFF
                chunk = bytes(data)
            if slow_after is not None and pos + len(chunk) > slow_after:
                time.sleep(len(chunk) / SLOW_BYTES_PER_S)
            view = memoryview(chunk)
            while view:
                view = view[os.write(write_end, view) :]
            pos += len(chunk)
    except BrokenPipeError:
        pass
    finally:
        os.close(write_end)


def lock_config(host: state.HostConfig, vmid: int) -> int:
    """PVE::LXC::Config->lock_config: flock with a 10 s timeout; returns the held fd."""
    import fcntl
    import time

    lock_dir = os.path.join(host.dir, "lock")
    os.makedirs(lock_dir, exist_ok=True)
    fd = os.open(os.path.join(lock_dir, f"pve-config-{vmid}.lock"), os.O_RDWR | os.O_CREAT, 0o644)
    deadline = time.monotonic() + 10
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() > deadline:
                msg = f"can't lock file '/run/lock/lxc/pve-config-{vmid}.lock' - got timeout\n"
                raise Die(msg) from None
            time.sleep(0.05)


def cmd_push(host: state.HostConfig, opts: dict) -> int:
    vmid = opts["vmid"]
    lock_config(host, vmid)
    pid = state.init_pid(ct) if (ct := state.load_ct(host, vmid)) else None
    if pid is None:
        raise Die("can only push files to a running CT\n")
    load_config(host, vmid)
    owner = owner_opts(opts)

    def realcmd() -> None:
        try:
            src = os.open(opts["file"], os.O_RDONLY)
        except OSError:
            raise Die(f"failed to open {opts['file']} for reading\n") from None
        enter_mount_ns(pid)
        dst = create_file(opts["destination"], *owner)
        copy_fd(src, dst)

    return fork_worker(host, "push_file", vmid, realcmd)


def cmd_pull(host: state.HostConfig, opts: dict) -> int:
    vmid = opts["vmid"]
    lock_config(host, vmid)
    pid = state.init_pid(ct) if (ct := state.load_ct(host, vmid)) else None
    if pid is None:
        raise perl_die("can only pull files from a running VM", 657)
    owner = owner_opts(opts)

    def realcmd() -> None:
        dst = create_file(opts["destination"], *owner)  # on the host, before entering the CT
        enter_mount_ns(pid)
        try:
            src = os.open(opts["path"], os.O_RDONLY)
        except OSError as err:
            raise Die(f"failed to open {opts['path']}: {err.strerror}\n") from None
        copy_fd(src, dst)

    return fork_worker(host, "pull_file", vmid, realcmd)


def owner_opts(opts: dict) -> tuple[str | None, str | None, str | None]:
    perms = opts.get("perms")
    if perms is not None and not perms.startswith("0"):
        perms = "0" + perms  # "assume octal as default"
    return perms, opts.get("user"), opts.get("group")


def enter_mount_ns(pid: int) -> None:
    from . import nsutil

    try:
        nsutil.setns(f"/proc/{pid}/ns/mnt", nsutil.CLONE_NEWNS)
    except OSError:
        raise Die("failed to enter the container's mount namespace\n") from None
    os.chdir("/")


def create_file(path: str, perms: str | None, user: str | None, group: str | None) -> int:
    """pct.pm create_file: O_EXCL first (new file: mode 0666 & ~umask), else truncate and
    keep the old mode unless --perms; no directories are ever made."""
    uid = _resolve(user, "uid")
    gid = _resolve(group, "gid")
    mode = _strtoul(perms) if perms is not None else None
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0)
        if mode is None:
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask
    except OSError:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        except OSError as err:
            raise Die(f"failed to create file: {path}: {err.strerror}\n") from None
    if mode is not None:
        os.fchmod(fd, mode)
    if uid is not None or gid is not None:
        st = os.fstat(fd)
        try:
            os.fchown(fd, st.st_uid if uid is None else uid, st.st_gid if gid is None else gid)
        except OSError as err:
            raise Die(f"failed to change file owner: {err.strerror}\n") from None
    return fd


def _resolve(name: str | None, kind: str) -> int | None:
    if name is None:
        return None
    if name.isdigit():
        return int(name)
    import grp
    import pwd

    try:
        return pwd.getpwnam(name).pw_uid if kind == "uid" else grp.getgrnam(name).gr_gid
    except KeyError:
        raise Die(f"failed to get {kind} for: {name}\n") from None


def _strtoul(text: str) -> int:
    """POSIX::strtoul($perms, 0): 0x.. hex, 0.. octal; anything unparsed is an error."""
    try:
        if text.lower().startswith("0x"):
            return int(text[2:], 16)
        return int(text, 8)
    except ValueError:
        raise Die(f"invalid mode: '{text}'\n") from None


def copy_fd(src: int, dst: int) -> None:
    """File::Copy::copy; like pct, the result is not checked."""
    try:
        while os.sendfile(dst, src, None, 1 << 24) > 0:
            pass
    except OSError:
        pass


def fork_worker(host: state.HostConfig, dtype: str, vmid: int, realcmd) -> int:
    """RPCEnvironment::fork_worker in CLI (sync) mode: a worker process runs `realcmd`; its
    error is printed on stderr (one line, no prefix) and the task log (tasks.log in the host
    dir) says `TASK ERROR: ...`; the exit code stays 0."""
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(read_end)
        message = b""
        try:
            realcmd()
        except Die as err:
            message = str(err).rstrip("\n").replace("\n", " ").encode()
        except Exception as err:  # a Perl die without a newline would do the same
            message = str(err).encode()
        os.write(write_end, message)
        os._exit(0)
    os.close(write_end)
    chunks = []
    while chunk := os.read(read_end, 65536):
        chunks.append(chunk)
    os.waitpid(child, 0)
    error = b"".join(chunks).decode(errors="replace")
    if error:
        sys.stderr.write(error + "\n")
    result = f"TASK ERROR: {error}" if error else "TASK OK"
    with open(os.path.join(host.dir, "tasks.log"), "a") as log:
        log.write(f"{dtype} {vmid}: {result}\n")
    return 0


HANDLERS = {
    "exec": cmd_exec,
    "push": cmd_push,
    "pull": cmd_pull,
    "status": cmd_status,
    "config": cmd_config,
    "list": cmd_list,
    "start": cmd_start,
    "stop": cmd_stop,
}
