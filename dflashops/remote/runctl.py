"""Runs inside a target with its python3 (stdlib only): the few changes made to a run directory.

argv: ACTION RUN_DIR, and stdin: a JSON object for the action. stdout: one JSON object.

- claim: create RUN_DIR (and its parents); it must not exist: {"taken": state.json's content}
  when it does. state.json starts as stdin's object (status "claiming", the run's id, ...).
- commit: the claim holds (status "launching") if state.json still has stdin's "run_id".
- remove: delete RUN_DIR, only if its state.json has stdin's "run_id" (a launch that failed
  takes back only what it made); {"removed": bool}.
- discard: delete a temporary tree of ours (RUN_DIR is its path; its name has ".tmp-").
- publish: rename the directory stdin's "from" to RUN_DIR (the code snapshot) unless RUN_DIR
  exists already (then "from" is deleted): snapshots are written once, never changed.
- secrets: write stdin's "values" (JSON) to RUN_DIR, a new file of mode 0600 (its directory
  0700): RUN_DIR is the secrets file's path here.
- relaunch: merge stdin's keys into state.json (atomically) and remove exit_code and node.json's
  end, before the launcher starts again.
- signal: send stdin's "signal" (a name such as "TERM") to the trainer whose pid (and start
  time) state.json holds, only if it is still that process; {"pid": pid} or {"pid": null}.
- kill: SIGKILL to this node's torchrun agent and ranks (each its own process group), each only
  if still the process recorded (pid and start time); {"killed": [pid, ...]}.
- archive: delete the checkpoint directories named in stdin's "delete" (manifest first, so an
  interrupted deletion leaves an incomplete checkpoint, never a complete-looking broken one),
  then rename RUN_DIR to stdin's "to"; {"removed": [...], "freed": bytes}.
"""

import contextlib
import json
import os
import shutil
import signal
import sys
import time

from dflashops.remote.shared import read_json, same_process, write_json


def load_state(run_dir):
    return read_json(os.path.join(run_dir, "state.json"))


def save_state(run_dir, state):
    write_json(os.path.join(run_dir, "state.json"), state)


def relaunch(run_dir, req):
    state = load_state(run_dir)
    state.update(req)
    save_state(run_dir, state)
    stale = ["exit_code", "node.json"]
    ranks = os.path.join(run_dir, "ranks")
    if os.path.isdir(ranks):
        stale += [os.path.join("ranks", n) for n in os.listdir(ranks) if n.endswith(".json")]
    for name in stale:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(run_dir, name))
    return {"state": state}


def send(run_dir, req):
    state = load_state(run_dir)
    pid = state.get("pid")
    if not same_process(pid, state.get("pid_start")):
        return {"pid": None}
    os.kill(pid, getattr(signal, "SIG" + req.get("signal", "TERM")))
    return {"pid": pid, "sent": time.time()}


def recorded_processes(run_dir):
    """(pid, start) of this node's torchrun agent and of every rank it recorded."""
    found = []
    node = read_json(os.path.join(run_dir, "node.json"))
    agent = node.get("agent") or {}
    found.append((agent.get("pid"), agent.get("start")))
    ranks = os.path.join(run_dir, "ranks")
    for name in sorted(os.listdir(ranks)) if os.path.isdir(ranks) else []:
        if name.startswith("rank_") and name.endswith(".json"):
            beat = read_json(os.path.join(ranks, name))
            found.append((beat.get("pid"), beat.get("pid_start")))
    state = load_state(run_dir)
    found.append((state.get("pid"), state.get("pid_start")))
    return [(p, s) for p, s in found if isinstance(p, int) and isinstance(s, int)]


def kill(run_dir, req):
    killed = []
    for pid, start in recorded_processes(run_dir):
        if not same_process(pid, start):
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)  # torchrun starts the agent and each rank as leaders
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        killed.append(pid)
    return {"killed": killed}


def claim(run_dir, req):
    os.makedirs(os.path.dirname(run_dir), exist_ok=True)
    try:
        os.mkdir(run_dir)
    except FileExistsError:
        return {"taken": load_state(run_dir)}
    save_state(run_dir, req)
    return {"taken": None}


def commit(run_dir, req):
    state = load_state(run_dir)
    if state.get("run_id") != req["run_id"]:
        raise ValueError(f"{run_dir} is no longer this launch's (run id {state.get('run_id')})")
    state["status"] = "launching"
    save_state(run_dir, state)
    return {"state": state}


def remove(run_dir, req):
    for path in req.get("files") or []:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    if not os.path.isdir(run_dir) or load_state(run_dir).get("run_id") != req["run_id"]:
        return {"removed": False}
    shutil.rmtree(run_dir)
    return {"removed": True}


def discard(path, req):
    """Delete a temporary tree of ours (its name has ".tmp-"), e.g. a snapshot cut short."""
    if ".tmp-" not in os.path.basename(path):
        raise ValueError(f"refusing to delete {path}: not a temporary directory")
    shutil.rmtree(path, ignore_errors=True)
    return {"removed": True}


def publish(final, req):
    source = req["from"]
    if os.path.isdir(final):
        shutil.rmtree(source, ignore_errors=True)
        return {"published": False}
    os.makedirs(os.path.dirname(final), exist_ok=True)
    try:
        os.rename(source, final)
    except OSError:
        if not os.path.isdir(final):  # not a snapshot that appeared meanwhile
            raise
        shutil.rmtree(source, ignore_errors=True)
        return {"published": False}
    return {"published": True}


def secrets(path, req):
    directory = os.path.dirname(path)
    os.makedirs(directory, mode=0o700, exist_ok=True)
    os.chmod(directory, 0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(req["values"], f)
    return {"path": path}


def tree_bytes(path):
    total = 0
    for root, _dirs, names in os.walk(path):
        for name in names:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def archive(run_dir, req):
    removed, freed = [], 0
    base = os.path.join(run_dir, "checkpoints")
    for name in req.get("delete", []):
        if "/" in name or name in ("", ".", ".."):
            raise ValueError(f"refusing to delete {name!r}")
        path = os.path.join(base, name)
        if not os.path.isdir(path):
            continue
        freed += tree_bytes(path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(path, "MANIFEST.sha256"))
        shutil.rmtree(path)
        removed.append(name)
    dest = req["to"]
    if os.path.lexists(dest):
        raise FileExistsError(f"{dest} already exists")
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    os.rename(run_dir, dest)
    return {"removed": removed, "freed": freed, "dir": dest}


ACTIONS = {
    "claim": claim,
    "commit": commit,
    "remove": remove,
    "discard": discard,
    "publish": publish,
    "secrets": secrets,
    "relaunch": relaunch,
    "signal": send,
    "kill": kill,
    "archive": archive,
}


def main():
    action, run_dir = sys.argv[1], sys.argv[2]
    req = json.load(sys.stdin)
    try:
        out = ACTIONS[action](run_dir, req)
    except (OSError, ValueError) as exc:
        sys.stderr.write(f"runctl {action}: {exc}\n")
        sys.exit(1)
    json.dump(out, sys.stdout)


main()
