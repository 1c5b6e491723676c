"""Runs inside a target with its python3 (stdlib only): the few changes made to a run directory.

argv: ACTION RUN_DIR, and stdin: a JSON object for the action. stdout: one JSON object.

- relaunch: merge stdin's keys into state.json (atomically) and remove exit_code, before the
  launch script starts again.
- signal: send stdin's "signal" (a name such as "TERM") to the trainer whose pid state.json
  holds, only if that pid is a workload.train process; {"pid": pid} or {"pid": null}.
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


def load_state(run_dir):
    try:
        with open(os.path.join(run_dir, "state.json"), encoding="utf-8") as f:
            state = json.load(f)
        return state if isinstance(state, dict) else {}
    except (OSError, ValueError):
        return {}


def save_state(run_dir, state):
    path = os.path.join(run_dir, "state.json")
    tmp = os.path.join(run_dir, f".state.json.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(state, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def relaunch(run_dir, req):
    state = load_state(run_dir)
    state.update(req)
    save_state(run_dir, state)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(run_dir, "exit_code"))
    return {"state": state}


def is_trainer(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"workload.train" in f.read()
    except OSError:
        return False


def send(run_dir, req):
    pid = load_state(run_dir).get("pid")
    if not isinstance(pid, int) or not is_trainer(pid):
        return {"pid": None}
    os.kill(pid, getattr(signal, "SIG" + req.get("signal", "TERM")))
    return {"pid": pid, "sent": time.time()}


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


ACTIONS = {"relaunch": relaunch, "signal": send, "archive": archive}


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
