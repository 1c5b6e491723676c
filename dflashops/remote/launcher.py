"""Runs inside a target, in the run's tmux session (stdlib only): one node of a run.

argv: RUN_DIR. Reads RUN_DIR/launch.json, written by `dflashops launch`/`resume`:
{"argv": [...], "env": {...}, "secrets": path or null, "node": i, "target": name}.
Nothing in it ever reaches a shell: the argv (torchrun and the trainer) is executed as given,
with exactly the environment given (never the tmux server's), in a new session so that its
process group can be stopped as one.

- The secrets file (JSON {name: value}, mode 0600, outside the run directory) is read into the
  trainer's environment and deleted before the trainer starts.
- Everything the node prints goes to console.log (rank 0's output; other ranks write their own
  ranks/rank_<R>.log).
- node.json records this launcher and the torchrun agent (pid and start time: a pid alone can
  be reused), then how the node ended; exit_code and state.json get the exit code too, even when
  the trainer dies hard. A hangup (tmux killed) or Ctrl-C in the pane does not stop the node.
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

from dflashops.remote.layout import (
    CONSOLE_LOG,
    EXIT_CODE_FILE,
    LAUNCH_FILE,
    NODE_FILE,
    STATE_FILE,
)
from dflashops.remote.shared import proc_start, read_json, write_json


def take_secrets(path):
    """The secrets, read once; the file is gone afterwards whatever happens."""
    if not path:
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            values = json.load(f)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    return {str(k): str(v) for k, v in values.items()}


def stamp():
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())


def exit_status(code):
    """A shell's view of a child's end: 128+N when killed by signal N."""
    return 128 - code if code < 0 else code


def record_end(run_dir, node, code):
    with open(os.path.join(run_dir, EXIT_CODE_FILE), "w") as f:
        f.write(f"{code}\n")
    now = time.time()
    node.update(status="finished" if code == 0 else "failed", exit_code=code, finished=now)
    write_json(os.path.join(run_dir, NODE_FILE), node)
    state = read_json(os.path.join(run_dir, STATE_FILE))
    state["exit_code"] = code
    if code != 0:
        state["status"] = "failed"
    state["finished"] = state.get("finished") or now
    write_json(os.path.join(run_dir, STATE_FILE), state)


def main():
    run_dir = sys.argv[1]
    os.chdir(run_dir)
    launch = read_json(LAUNCH_FILE)
    console = open(CONSOLE_LOG, "ab", buffering=0)  # noqa: SIM115 (open for our whole life)

    def say(text):
        console.write(f"[dflashops] {stamp()}: {text}\n".encode())

    def ignore(signum, _frame):
        say(f"the launcher got {signal.Signals(signum).name}; the node goes on")

    for sig in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, ignore)
    node = {
        "node": launch.get("node", 0),
        "target": launch.get("target"),
        "launcher": {"pid": os.getpid(), "start": proc_start(os.getpid())},
        "agent": None,
        "started": time.time(),
        "status": "starting",
        "exit_code": None,
        "finished": None,
    }
    write_json(NODE_FILE, node)
    try:
        own = {k: os.environ[k] for k in ("HOME", "USER", "LOGNAME") if k in os.environ}
        env = {**own, **launch["env"], **take_secrets(launch.get("secrets"))}
        argv = launch["argv"]
        say(" ".join(argv))
        agent = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=console,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=run_dir,
            start_new_session=True,
        )
    except (OSError, KeyError, ValueError) as exc:
        say(f"could not start: {exc}")
        code = 127 if isinstance(exc, FileNotFoundError) else 1
        record_end(run_dir, node, code)
        return code
    node.update(agent={"pid": agent.pid, "start": proc_start(agent.pid)}, status="running")
    write_json(NODE_FILE, node)
    code = exit_status(agent.wait())
    say(f"exit code {code}")
    record_end(run_dir, node, code)
    return code


sys.exit(main())
