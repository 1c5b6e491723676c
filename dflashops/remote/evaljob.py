"""Runs inside a target under remote/launcher.py (stdlib only): one eval job, step by step.

argv: JOB_DIR. Reads JOB_DIR/job.json, written by `dflashops eval`:
{"run": name, "evals": [{"step": N, "argv": [...]}, ...]}, and runs each argv in turn (the
evaluator, `python -m workload.eval ... --out <ws>/evals/RUN/step_N.json`), as given, never
through a shell, with the launcher's environment; their output goes where ours goes
(console.log). A step that fails does not stop the others; the job's exit code is the first
failure's (0 when every step wrote its result).

It keeps to the contract of every job's program (dflashops/runs/lifecycle/job_kind.py): state.json's "status"
is "running" while it works, then "finished" (or "stopped"), with its "pid" and "pid_start" so
that `stop` can signal it. One evaluation at a time on a target: each step waits for the
target's evaluation lock (remote/evallock.py), which a continuous eval's steps hold too.
SIGTERM ends the step being evaluated (its evaluator gets SIGTERM) and the job, "stopped". The
evaluator dies with this program however it dies (remote/engine_groups.py), and the engines it
started are gone before the lock is let go.
The steps that wrote their result are kept in state.json's "done": the job started again
(`resume`) evaluates only the others.
"""

import contextlib
import os
import signal
import sys
import time

from dflashops.remote.engine_groups import start_evaluator
from dflashops.remote.evallock import one_evaluation
from dflashops.remote.layout import STATE_FILE
from dflashops.remote.shared import proc_start, read_json, write_json


def say(text):
    stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    sys.stdout.write(f"[eval job] {stamp}: {text}\n")
    sys.stdout.flush()


def update(job_dir, **keys):
    """Merge `keys` into state.json (atomically)."""
    path = os.path.join(job_dir, STATE_FILE)
    state = read_json(path)
    state.update(keys)
    write_json(path, state)


def lock_path(job_dir):
    """The target's evaluation lock: <ws>/evals/.evaluating (job_dir: <ws>/evals/RUN/jobs/ID)."""
    return os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(job_dir))), ".evaluating")


def run_step(item, current, job_dir):
    """The evaluator of one step; its exit code."""
    try:
        child = start_evaluator(item["argv"], job_dir)
    except OSError as exc:
        say(f"step {item['step']}: could not start: {exc}")
        return 127
    current.append(child)
    code = child.wait()
    current.clear()
    return code


def main():
    job_dir = sys.argv[1]
    job = read_json(os.path.join(job_dir, "job.json"))
    evals = job["evals"]
    done = list(read_json(os.path.join(job_dir, STATE_FILE)).get("done") or [])
    stopping, current = [], []

    def on_term(_signum, _frame):
        stopping.append(True)
        for child in current:
            with contextlib.suppress(OSError):
                child.terminate()

    signal.signal(signal.SIGTERM, on_term)
    update(job_dir, status="running", pid=os.getpid(), pid_start=proc_start(os.getpid()),
           done=done)  # fmt: skip
    first_failure = 0
    for i, item in enumerate(evals):
        if item["step"] in done:
            say(f"step {item['step']}: evaluated already")
            continue
        if stopping:
            break
        say(f"step {item['step']} ({i + 1}/{len(evals)}) of {job['run']}")
        with one_evaluation(lock_path(job_dir), stopping, say) as held:
            code = run_step(item, current, job_dir) if held else 0
        code = 128 - code if code < 0 else code
        if stopping:
            say(f"step {item['step']}: stopped")
            break
        say(f"step {item['step']}: exit code {code}")
        if code == 0:
            done.append(item["step"])
            update(job_dir, done=done)
        first_failure = first_failure or code
    if stopping:
        update(job_dir, status="stopped")
    elif first_failure == 0:
        update(job_dir, status="finished", finished=time.time())
    return first_failure


sys.exit(main())
