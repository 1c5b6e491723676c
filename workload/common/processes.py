"""Processes (no torch): whether one still lives (the sweeps of temporary files that only a dead
writer leaves behind ask it), and the engine groups an evaluator starts.

An engine (a vLLM server, the offline engine program, the benchmark client) starts as the leader
of its own session, so that its process group, which holds what it starts in turn (vLLM's
engine core and workers), is stopped as one without stopping us. The kernel tells the leader
SIGTERM when the thread that started it ends, however it ends (PR_SET_PDEATHSIG: a SIGKILL or
SIGHUP of the evaluator). Where the job that runs us names a directory ($DFLASHOPS_ENGINE_DIR,
set by remote/evaljob.py and follow_eval.py), each group is recorded there (PGID.json) while it
lives: `stop --kill` and the target's evaluation lock end what a dead evaluator left behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

ENGINE_DIR_ENV = "DFLASHOPS_ENGINE_DIR"  # where a job wants its engine groups recorded
GONE_WAIT_S = 60.0  # for a killed group's last process (a GPU's memory freed on its exit)


def pid_alive(pid: int) -> bool:
    """True while `pid` exists (another user's process included)."""
    return _exists(os.kill, pid)


def proc_start(pid: int) -> int | None:
    """The start time of `pid` (clock ticks since boot; a pid can be reused, this pair not);
    None when it is gone or a zombie."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    fields = raw[raw.rindex(b")") + 2 :].split()
    return None if fields[0] in (b"Z", b"X") else int(fields[19])


def group_alive(pgid: int) -> bool:
    """True while any process of group `pgid` lives."""
    return _exists(os.killpg, pgid)


def _exists(send: Any, target: int) -> bool:
    try:
        send(target, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# PR_SET_PDEATHSIG set by the child itself, then exec (kept across it): no preexec_fn, which
# is not safe where we run threads (the output readers)
DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None).prctl(1, signal.SIGTERM, 0, 0, 0)\n"
    "if os.getppid() != int(sys.argv[1]):\n"  # the parent ended before prctl: at once
    "    os.kill(os.getpid(), signal.SIGTERM)\n"
    "try:\n"
    "    os.execvp(sys.argv[2], sys.argv[2:])\n"
    "except OSError as exc:\n"
    "    sys.exit(f'{sys.argv[2]}: could not start: {exc}')\n"
)


def start_group(argv: Sequence[str], **popen: Any) -> subprocess.Popen:
    """`argv` as the leader of a new session, told SIGTERM when we end, recorded where the job
    asks (see the module's words). Popen's keywords pass through."""
    shim = [sys.executable, "-I", "-S", "-c", DIE_WITH_PARENT, str(os.getpid())]
    proc = subprocess.Popen([*shim, *argv], start_new_session=True, **popen)
    _record(proc.pid)
    return proc


def end_group(proc: subprocess.Popen, grace: float = 0.0) -> None:
    """SIGTERM to `proc`'s group (none when `grace` is 0), SIGKILL after `grace` seconds; back
    when nothing of the group is left, its record dropped."""
    deadline = time.monotonic() + grace
    if grace > 0 and proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace)
    while group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)  # the leader gone, its engine core still stopping
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + GONE_WAIT_S
    while group_alive(proc.pid):
        if time.monotonic() > deadline:
            return  # its record stays: the job's lock keeper ends it (remote/engine_groups.py)
        time.sleep(0.05)
    _unrecord(proc.pid)


def _record_path(pgid: int) -> str | None:
    directory = os.environ.get(ENGINE_DIR_ENV)
    return os.path.join(directory, f"{pgid}.json") if directory else None


def _record(pgid: int) -> None:
    path = _record_path(pgid)
    if path is None:
        return
    me = os.getpid()
    record = {"pgid": pgid, "start": proc_start(pgid), "owner": me, "owner_start": proc_start(me)}
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{me}.tmp"
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, path)


def _unrecord(pgid: int) -> None:
    path = _record_path(pgid)
    if path is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
