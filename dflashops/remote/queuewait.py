"""Runs inside a target, in a queued run's tmux session (stdlib only): the wait of
`launch --queue`, then the run's launcher in its place.

argv: RUN_DIR. The run is claimed and prepared (run.yaml, launch.json, launcher.py, its code
and secrets), its state.json at status "queued" with "queue": {"at", "nonce"} (when the launch
claimed it: the queue's order). Every POLL_S this target is read: it is free when no other run
of ours here claims, starts or runs (its tmux session on our server, its launcher or trainer
alive, or a launch's lease still held), no run queued here before this one still waits, and
nvidia-smi (where there is one) shows no compute process. Then, under the run's lock and only
while it is still queued (a `stop` removes it under the same lock), status becomes "launching"
and this process becomes the launcher (exec): the run starts in this same session.

What it waits for is kept in state.json ("queue": "waits_for") and said in console.log each
time it changes. SIGTERM ends the wait (the run stays queued, with no one waiting: `stop`
removes it); a hangup or Ctrl-C in the pane does not.
"""

import os
import signal
import socket
import subprocess
import sys
import time

from dflashops.remote.gpu_query import NVIDIA_APPS, nvidia_smi
from dflashops.remote.layout import CONSOLE_LOG, NODE_FILE, RUN_LOCK, STATE_FILE
from dflashops.remote.shared import (
    flock_now,
    machine_id,
    proc_start,
    read_json,
    same_process,
    write_json,
)

POLL_S = float(os.environ.get("DFLASHOPS_QUEUE_POLL_S") or 2.0)
HELD = ("claiming", "launching")  # a launch at work: its lease says until when
LIVE = ("starting", "running")


def stamp():
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())


def sessions():
    """Our tmux server's session names (None when tmux cannot be asked)."""
    argv = ["tmux", "-L", "dflashops", "list-sessions", "-F", "#{session_name}"]
    try:
        out = subprocess.run(argv, capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return set(out.stdout.decode("utf-8", "replace").split()) if out.returncode == 0 else set()


def session_of(run):
    return "dflash-" + run.replace(".", "=")


def alive(run_dir, state, live_sessions, now):
    """Something of that run still holds this target."""
    name = os.path.basename(run_dir)
    if live_sessions is None or session_of(name) in live_sessions:
        return True
    launcher = read_json(os.path.join(run_dir, NODE_FILE)).get("launcher") or {}
    if same_process(launcher.get("pid"), launcher.get("start")):
        return True
    if same_process(state.get("pid"), state.get("pid_start")):
        return True
    until = (state.get("hold") or {}).get("until")
    return state.get("status") in HELD and isinstance(until, (int, float)) and now < until


def queue_key(state):
    queue = state.get("queue") or {}
    return (float(queue.get("at") or 0), str(queue.get("nonce") or ""))


def what_holds(run_dir, mine):
    """Why this target is not free for the run at `run_dir` (None when it is)."""
    home = os.path.dirname(run_dir)
    live_sessions = sessions()
    now = time.time()
    before, holder = [], None
    for name in sorted(os.listdir(home)):
        other = os.path.join(home, name)
        if other == run_dir or name.startswith(".") or not os.path.isdir(other):
            continue
        state = read_json(os.path.join(other, STATE_FILE))
        status = state.get("status")
        if status not in (*HELD, *LIVE, "queued") or not alive(other, state, live_sessions, now):
            continue
        if status != "queued":
            started = os.path.exists(os.path.join(other, NODE_FILE))  # its launcher ran
            shown = status if status in LIVE else ("running" if started else "starting")
            holder = holder or f"run {name} ({shown}) holds it"
        elif queue_key(state) < mine:
            before.append((queue_key(state), name))
    ahead = [name for _, name in sorted(before)]
    line = f"{len(ahead)} queued before it ({', '.join(ahead)})" if ahead else None
    if holder or line:
        return "; ".join(x for x in (holder, line) if x)
    apps = nvidia_smi(NVIDIA_APPS) or []
    if apps:
        shown = ", ".join(f"pid {row[0]} {row[-1]}" for row in apps[:3])
        return f"nvidia-smi shows its GPUs in use: {shown}"
    return None


def update(run_dir, change):
    """Apply `change` to state.json under the run's lock while it is still queued; False when
    it is not queued any more (started, or removed by `stop`), None when the lock was busy."""
    try:
        fd = flock_now(os.open(os.path.join(run_dir, RUN_LOCK), os.O_RDWR | os.O_CREAT, 0o600))
    except FileNotFoundError:
        return False
    if fd is None:
        return None
    try:
        state = read_json(os.path.join(run_dir, STATE_FILE))
        if state.get("status") != "queued":
            return False
        change(state)
        write_json(os.path.join(run_dir, STATE_FILE), state)
        return True
    finally:
        os.close(fd)


def main():
    run_dir = sys.argv[1]
    os.chdir(run_dir)
    console = open(CONSOLE_LOG, "ab", buffering=0)  # noqa: SIM115 (open for our whole life)

    def say(text):
        console.write(f"[dflashops] {stamp()}: {text}\n".encode())

    for sig in (signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    me = {"pid": os.getpid(), "start": proc_start(os.getpid())}
    mine = queue_key(read_json(STATE_FILE))
    said = None

    def record(state):  # who waits: `stop` ends this process by it
        state["queue"] = {**state.get("queue", {}), "waiter": me}

    recorded = update(run_dir, record)
    while recorded is None:
        time.sleep(0.2)
        recorded = update(run_dir, record)
    if recorded is False:
        return 0
    while True:
        why = what_holds(run_dir, mine)
        if why is None:

            def begin(state):  # held by this process, which becomes the launcher (one pid)
                hold = state.get("hold") or {}
                lease = float(hold.get("lease_s") or 300)
                state["hold"] = {
                    **hold,
                    "verb": "queue",
                    "host": socket.gethostname(),
                    "machine": machine_id(),
                    **me,
                    "until": time.time() + lease,
                }
                state["status"] = "launching"
                state["queue"] = {**state.get("queue", {}), "started": time.time()}

            done = update(run_dir, begin)
            if done:
                say("the target is free: the run starts")
                console.close()
                launcher = os.path.join(run_dir, "launcher.py")
                os.execv(sys.executable, [sys.executable, launcher, run_dir])
            if done is False:
                return 0
        elif why != said:

            def note(state, why=why):
                state["queue"] = {**state.get("queue", {}), "waits_for": why}

            if update(run_dir, note) is False:
                return 0
            say(f"queued: {why}")
            said = why
        time.sleep(POLL_S)


sys.exit(main())
