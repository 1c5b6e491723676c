"""Put in front of every helper program (stdlib only): what several of them need.

Processes are recognised by pid and start time (field 22 of /proc/PID/stat, clock ticks since
boot), never by a name: after a container restart another process can have the pid.
"""

import fcntl
import json
import os
import subprocess

from dflashops.remote.layout import NODE_FILE


def proc_start(pid):
    """The start time of `pid`; None when it is gone (or a zombie)."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            raw = f.read()
    except (OSError, ValueError, TypeError):
        return None
    fields = raw[raw.rindex(b")") + 2 :].split()
    return None if fields[0] in (b"Z", b"X") else int(fields[19])


def same_process(pid, start):
    """True when `pid` still is the process that started at `start`; None for no pid. Records
    written before start times were kept: a process whose command line says workload.train."""
    if not isinstance(pid, int) or pid <= 0:
        return None
    now = proc_start(pid)
    if now is None:
        return False
    if isinstance(start, int):
        return now == start
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"workload.train" in f.read()
    except OSError:
        return False


def job_alive(session, job_dir, state_file=None):
    """True while a job lives: its tmux session on our server (-L dflashops), or its launcher
    (node.json's pid and start) or, given `state_file`, the process that file names (pid,
    pid_start)."""
    try:
        argv = ["tmux", "-L", "dflashops", "has-session", "-t", "=" + session]
        if subprocess.run(argv, capture_output=True).returncode == 0:
            return True
    except OSError:
        pass
    launcher = read_json(os.path.join(job_dir, NODE_FILE)).get("launcher") or {}
    named = [(launcher.get("pid"), launcher.get("start"))]
    if state_file is not None:
        state = read_json(os.path.join(job_dir, state_file))
        named.append((state.get("pid"), state.get("pid_start")))
    return any(pid is not None and start is not None and proc_start(pid) == start
               for pid, start in named)  # fmt: skip


def machine_id():
    """This machine (its boot) and pid namespace: where a pid means this process."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return ""


def flock_now(fd):
    """`fd`, holding an exclusive flock taken at once; None (`fd` closed) while another holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def read_json(path):
    """A JSON object from `path`, {} when it is missing, unreadable or not an object."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_json(path, data):
    """`data` to `path`, atomically (a temporary file of this process, then a rename)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)
