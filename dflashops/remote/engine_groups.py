"""Put in front of the eval programs and runctl (stdlib only): the engines a job's evaluator
starts, ended with the job.

An evaluator starts each engine (a vLLM server, the offline engine program) as the leader of
its own process group, which holds what the engine starts in turn (vLLM's engine core and its
workers), and records it while it lives in JOB_DIR/engines/PGID.json (workload/common/
processes.py: the group, its leader's start, the evaluator that owns it). Here:

- the evaluator is started in the job's process group, told SIGTERM by the kernel when the job's
  program dies however it dies (PR_SET_PDEATHSIG), and told where to record its engines;
- `stop --kill` (runctl kill) ends the job's recorded groups with the rest of the job;
- the target's evaluation lock (evallock.py), when taken and before it is let go, ends every
  recorded group whose evaluator is gone and waits until none is left: no process of the group
  in /proc and, where `nvidia-smi` answers, none of their pids among its compute apps.

A group is its members in /proc (processes whose group id is the record's, started no earlier
than its leader): a number in use as a group id is not given to a new process, so while one
member lives the group is ours.
"""

import contextlib
import glob
import os
import signal
import subprocess
import sys
import time

from dflashops.remote.layout import ENGINES_DIR
from dflashops.remote.shared import proc_start, read_json

ENGINE_DIR_ENV = "DFLASHOPS_ENGINE_DIR"  # read by workload/common/processes.py
ORPHAN_GRACE_S = 60  # a living evaluator's own stop of its engines, before they are killed
GONE_WAIT_S = 120  # for a killed group's last process
GPU_WAIT_S = 30  # for the driver to drop the dead processes' contexts


# PR_SET_PDEATHSIG (1) set by the child itself, then exec (kept across it): no preexec_fn,
# which is not safe where a program runs threads (the follower does)
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


def start_evaluator(argv, job_dir):
    """`argv` in our process group (a kill of the job's group takes it), told SIGTERM when we
    die, its engines recorded in JOB_DIR/engines/."""
    env = {**os.environ, ENGINE_DIR_ENV: os.path.join(job_dir, ENGINES_DIR)}
    shim = [sys.executable, "-I", "-S", "-c", DIE_WITH_PARENT, str(os.getpid())]
    return subprocess.Popen([*shim, *argv], stdin=subprocess.DEVNULL, env=env)


def records(directories):
    """(path, record) of every engine group recorded in `directories`."""
    found = []
    for directory in directories:
        for path in sorted(glob.glob(os.path.join(directory, "*.json"))):
            record = read_json(path)
            if isinstance(record.get("pgid"), int) and record["pgid"] > 1:
                found.append((path, record))
    return found


def members(record):
    """The living processes of the record's group."""
    pgid, start = record["pgid"], record.get("start") or 0
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(f"/proc/{name}/stat", "rb") as f:
                raw = f.read()
            state, _ppid, group, *rest = raw[raw.rindex(b")") + 2 :].split()
            if int(group) == pgid and state not in (b"Z", b"X") and int(rest[16]) >= start:
                found.append(int(name))
    return found


def owner_alive(record):
    owner = record.get("owner")
    return isinstance(owner, int) and proc_start(owner) == record.get("owner_start")


def kill_group(pgid, pids):
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
    for pid in pids:  # the leader gone: its members, each
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def end_groups(directories, orphans_only=False, grace_s=0.0, patience_s=GONE_WAIT_S,
               stopping=(), say=None):  # fmt: skip
    """SIGKILL the groups recorded in `directories` (with `orphans_only`, those whose evaluator
    is gone, or still there after `grace_s`); back when none is left (records dropped), after
    `patience_s`, or once `stopping`. The pids seen; those still alive."""
    t0, seen, said = time.monotonic(), set(), False
    while True:
        alive = []
        for path, record in records(directories):
            pids = members(record)
            if not pids:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                continue
            alive.append(record["pgid"])
            seen.update(pids)
            waited = time.monotonic() - t0
            if not orphans_only or not owner_alive(record) or waited > grace_s:
                kill_group(record["pgid"], pids)
        if not alive or stopping or time.monotonic() - t0 > patience_s:
            return seen, alive
        if say is not None and not said:
            say(f"the engines of an evaluation that ended still run (process group "
                f"{', '.join(map(str, alive))}); ending them first")  # fmt: skip
            said = True
        time.sleep(0.1)


def gpu_pids():
    """The pids `nvidia-smi` lists as the GPU's compute apps; None without nvidia-smi."""
    argv = ["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    return {int(x) for x in done.stdout.split() if x.strip().isdigit()}


def wait_gpu_free(pids, say=None):
    """Until none of `pids` is among the GPU's compute apps (at most GPU_WAIT_S); True when
    none is, or there is no nvidia-smi to ask."""
    deadline = time.monotonic() + GPU_WAIT_S
    while pids:
        held = gpu_pids()
        if held is None or not held & pids:
            return True
        if time.monotonic() > deadline:
            if say is not None:
                say(f"nvidia-smi still lists {sorted(held & pids)} after {GPU_WAIT_S}s")
            return False
        time.sleep(0.5)
    return True


def engine_dirs(evals_dir):
    """Every job's engine records under <ws>/evals (eval jobs and continuous evals)."""
    return glob.glob(os.path.join(evals_dir, "*", "*", "*", ENGINES_DIR))


def settle(evals_dir, stopping, say, patience_s=float("inf")):
    """The engines left by evaluations that ended, ended; True once none is left (and the GPU,
    where nvidia-smi answers, lists none of them), False when `stopping` or `patience_s` came
    first."""
    seen, alive = end_groups(engine_dirs(evals_dir), orphans_only=True, grace_s=ORPHAN_GRACE_S,
                             patience_s=patience_s, stopping=stopping, say=say)  # fmt: skip
    return not alive and wait_gpu_free(seen, say)
