"""Runs inside a target with its python3 (stdlib only): the stored eval results and eval jobs.

stdin: {"ws": workspace, "runs": [run, ...] or null for all}.
stdout: {"now": time, "results": [...], "jobs": [...], "serves": [...]}: a result is the summary of
<ws>/evals/RUN/step_N.json (its keys without the per-prompt records, with run, step, file and
mtime; the real loop's check, check_real, and vLLM's greedy and simulation checks without their
per-prompt details; engine, fingerprint and prompt_set as they are); a job is <ws>/evals/RUN/jobs/ID/state.json with its exit code and whether it still runs
(its tmux session on our server, or its launcher by pid and start time); "follows": the
continuous evals (<ws>/evals/RUN/follow/ID/) as the jobs.
"""

import json
import os
import re
import sys
import time

from dflashops.remote.layout import STATE_FILE
from dflashops.remote.shared import job_alive, read_json

STEP_FILE = re.compile(r"^step_(\d+)\.json\Z")
SERVE_FILE = re.compile(r"^serve_(\d+)\.json\Z")  # eval --serve's
SERVE_SUMMARY = ("tau", "per_position", "n_prompts", "max_new_tokens", "checkpoint", "engine",
                 "fingerprint", "prompt_set", "checkpoint_sha256", "tau_by_category",
                 "tau_by_length", "timing")  # fmt: skip
SUMMARY = ("tau", "ddtree", "per_position", "n_prompts", "max_new_tokens", "checkpoint",
           "budgets", "prompts_file", "timing", "check_real", "real_loop_rounds_checked",
           "engine", "fingerprint", "prompt_set", "checkpoint_sha256",
           "engine_mean_acceptance_length", "tokens_per_s", "speedup", "greedy",
           "simulation")  # fmt: skip
DETAILS = ("details", "differ", "differences", "running_tau")  # per-prompt lists: left out


def listdir(path):
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def summary(doc):
    out = {k: doc[k] for k in SUMMARY if k in doc}
    for key in ("check_real", "greedy", "simulation"):
        if isinstance(out.get(key), dict):
            out[key] = {k: v for k, v in out[key].items() if k not in DETAILS}
    ref = doc.get("reference")
    if isinstance(ref, dict):
        out["reference"] = {k: ref[k] for k in SUMMARY if k in ref}
    return out


def serve_summary(doc):
    out = {k: doc[k] for k in SERVE_SUMMARY if k in doc}
    serve = doc.get("serve") if isinstance(doc.get("serve"), dict) else {}
    out["serve"] = {c: {"speedup": e.get("speedup"),
                        "spec": (e.get("spec") or {}).get("output_tokens_per_s"),
                        "plain": (e.get("plain") or {}).get("output_tokens_per_s")}
                    for c, e in serve.items() if isinstance(e, dict)}  # fmt: skip
    return out


def results(base, run, pattern=STEP_FILE, summarize=summary):
    found = []
    for name in listdir(os.path.join(base, run)):
        match = pattern.match(name)
        path = os.path.join(base, run, name)
        if not match:
            continue
        doc = read_json(path)
        if not doc:
            continue
        entry = {"run": run, "step": int(match.group(1)), "file": path}
        entry["mtime"] = os.path.getmtime(path)
        entry.update(summarize(doc))
        found.append(entry)
    return found


def jobs(base, run, sub="jobs"):
    found = []
    for job in listdir(os.path.join(base, run, sub)):
        job_dir = os.path.join(base, run, sub, job)
        state = read_json(os.path.join(job_dir, STATE_FILE))
        if not state:
            continue
        state.update(run=run, job=job, dir=job_dir, alive=job_alive(state.get("tmux", ""), job_dir))
        found.append(state)
    return found


def main():
    req = json.load(sys.stdin)
    base = os.path.join(req["ws"], "evals")
    wanted = req.get("runs")
    names = [n for n in listdir(base) if os.path.isdir(os.path.join(base, n))]
    names = [n for n in names if wanted is None or n in wanted]
    out = {"now": time.time(), "results": [], "jobs": [], "follows": [], "serves": []}
    for run in names:
        out["results"] += results(base, run)
        out["serves"] += results(base, run, SERVE_FILE, serve_summary)
        out["jobs"] += jobs(base, run)
        out["follows"] += jobs(base, run, "follow")
    json.dump(out, sys.stdout)


main()
