"""Runs inside a target under remote/launcher.py (stdlib only): one eval job, step by step.

argv: JOB_DIR. Reads JOB_DIR/job.json, written by `dflashops eval`:
{"run": name, "evals": [{"step": N, "argv": [...]}, ...]}, and runs each argv in turn (the
evaluator, `python -m workload.eval ... --out <ws>/evals/RUN/step_N.json`), as given, never
through a shell, with the launcher's environment; their output goes where ours goes
(console.log). A step that fails does not stop the others; the job's exit code is the first
failure's (0 when every step wrote its result).
"""

import json
import os
import subprocess
import sys
import time


def say(text):
    stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    sys.stdout.write(f"[eval job] {stamp}: {text}\n")
    sys.stdout.flush()


def main():
    job_dir = sys.argv[1]
    with open(os.path.join(job_dir, "job.json"), encoding="utf-8") as f:
        job = json.load(f)
    evals = job["evals"]
    first_failure = 0
    for i, item in enumerate(evals):
        say(f"step {item['step']} ({i + 1}/{len(evals)}) of {job['run']}")
        try:
            code = subprocess.call(item["argv"], stdin=subprocess.DEVNULL)
        except OSError as exc:
            say(f"step {item['step']}: could not start: {exc}")
            code = 127
        code = 128 - code if code < 0 else code
        say(f"step {item['step']}: exit code {code}")
        first_failure = first_failure or code
    return first_failure


sys.exit(main())
