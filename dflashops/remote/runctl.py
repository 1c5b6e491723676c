"""Runs inside a target with its python3 (stdlib only): the few changes made to a run directory.

argv: ACTION RUN_DIR, and stdin: a JSON object for the action. stdout: one JSON object.

Every action that changes an existing run directory takes the run's lock first (flock on
RUN_DIR/.lock, never waited for: a second command refuses at once) and checks there what its
operator saw: a run changed meanwhile by another command is refused, never torn.

- claim: create RUN_DIR (and its parents); it must not exist: {"taken": state.json's content}
  when it does. state.json starts as stdin's object (status "claiming", the run's id, its
  "hold": who launches it, until when at the latest: "until" on this target's clock).
- sweep: delete RUN_DIR, a launch that was cut short (its holder gone), only if state.json
  still has stdin's "run_id" and hold "token"; and its secrets files (stdin's "secrets_dir").
- renew: the hold's lease begins again ("until" = now + its "lease_s"), only while state.json
  still has stdin's hold "token" and is claiming or launching: a long start keeps its claim.
- commit: the claim holds (status "launching") if state.json still has stdin's "run_id".
- queue: the claim waits (status "queued", "queue": {"at": now on this target's clock,
  "nonce": the claim's}: the queue's order), if state.json still has stdin's "run_id" and no launcher started; remote/queuewait.py, in the
  run's tmux session, starts the launcher when the target frees.
- dequeue: a queued run cancelled, if state.json has stdin's "run_id" and is still queued: its
  waiter killed (pid and start, and its tmux session), its secrets file (launch.json's) and
  RUN_DIR deleted; {"removed": bool, "status": state.json's status}.
- remove: delete RUN_DIR, only if its state.json has stdin's "run_id" (a launch that failed
  takes back only what it made); {"removed": bool}.
- discard: delete a temporary tree of ours (RUN_DIR is its path; its name has ".tmp-").
- publish: rename the directory stdin's "from" to RUN_DIR (the code snapshot) unless RUN_DIR
  exists already (then "from" is deleted): snapshots are written once, never changed.
- secrets: write stdin's "values" (JSON) to RUN_DIR, a new file of mode 0600 (its directory
  0700): RUN_DIR is the secrets file's path here.
- relaunch: if state.json is still stdin's "expect", merge stdin's "state" into it (atomically)
  and remove exit_code, node.json and the ranks' records, before the launcher starts again;
  older secrets files of this run are swept. {"state": ..., "before": {file: its text}}.
- restore: put back relaunch's "before" files (a resume that failed leaves the run as it was),
  only if state.json still has stdin's hold "token".
- signal: send stdin's "signal" (a name such as "TERM") to the trainer whose pid (and start
  time) state.json holds, only if it is still that process; {"pid": pid} or {"pid": null}.
- kill: SIGKILL to this node's torchrun agent and ranks (each its own process group), each only
  if still the process recorded (pid and start time), and to the engine groups an eval job's
  evaluator recorded (RUN_DIR/engines/, remote/engine_groups.py), waited for until they are
  gone (at most KILL_WAIT_S); {"killed": [pid, ...], "engines": [pid, ...], "engines_left": [pgid, ...]}.
- alert: a W&B alert for the trainer to send (`watch`): stdin's "alert" ({"title", "text",
  "level"}) written atomically to RUN_DIR/alerts/ID.json (stdin's "id", [A-Za-z0-9_.-]), only
  while the trainer state.json names still runs and no request ID (ID.json, or ID.sent once the
  trainer sent it) exists; {"written": bool, "live": bool, "sent": bool}.
- archive: if state.json is still stdin's "expect", move RUN_DIR to stdin's "to" first (a
  rename; across filesystems a copy under a temporary name, verified byte for byte, renamed into
  place, then the original removed), then delete the checkpoint directories named in "delete"
  (manifest first, so an interrupted deletion leaves an incomplete checkpoint, never a
  complete-looking broken one); {"removed": [...], "freed": bytes, "dir": to}.
"""

import contextlib
import errno
import fcntl
import filecmp
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

from dflashops.remote.engine_groups import end_groups
from dflashops.remote.layout import (
    CHECKPOINTS,
    ENGINES_DIR,
    EXIT_CODE_FILE,
    LAUNCH_FILE,
    MANIFEST,
    NODE_FILE,
    RUN_LOCK,
    STATE_FILE,
)
from dflashops.remote.shared import read_json, same_process, write_json

KILL_WAIT_S = 20  # for a job's killed engines to be gone, within the caller's deadline


def load_state(run_dir):
    return read_json(os.path.join(run_dir, STATE_FILE))


def save_state(run_dir, state):
    write_json(os.path.join(run_dir, STATE_FILE), state)


@contextlib.contextmanager
def run_lock(run_dir):
    """The run's lock for one change, held until it is done; refused when another command
    holds it, or when RUN_DIR is gone (moved by an archive, removed by a take-back)."""
    try:
        fd = os.open(os.path.join(run_dir, RUN_LOCK), os.O_RDWR | os.O_CREAT, 0o600)
    except FileNotFoundError:
        raise ValueError(f"{run_dir} is not there (moved or removed meanwhile)") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ValueError(f"{run_dir} is busy: another dflashops command is changing it; "
                             "try again when it is done") from None  # fmt: skip
        if not same_file(os.path.join(run_dir, RUN_LOCK), fd):
            raise ValueError(f"{run_dir} is not there (moved or removed meanwhile)")
        yield  # what the action raises is its own (a full disk, EIO, EACCES), never "not there"
    finally:
        os.close(fd)


def same_file(path, fd):
    """`path` is still the file open as `fd` (not moved away or replaced)."""
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except OSError:
        return False


def expect_unchanged(run_dir, req):
    """The run is as its operator read it (stdin's "expect": state.json's content)."""
    if "expect" not in req:
        return
    state = load_state(run_dir)
    if state != req["expect"]:
        raise ValueError(f"{run_dir} was changed by another command meanwhile (now: status "
                         f"{state.get('status')}); read it again (dflashops status)")  # fmt: skip


def held(hold):
    """`hold` with its lease's end on this target's clock."""
    return {**hold, "until": time.time() + float(hold.get("lease_s") or 0)}


def sweep_secrets(req, run_id):
    """Secrets files of this run and run id that no launcher took (a start cut short)."""
    directory = req.get("secrets_dir")
    prefix = f"{os.path.basename(req.get('run') or '')}-{run_id}-"
    if not directory or not run_id or prefix.startswith("-"):
        return
    for name in os.listdir(directory) if os.path.isdir(directory) else []:
        if name.startswith(prefix) and name.endswith(".json"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(directory, name))


def read_files(run_dir, names):
    out = {}
    for name in names:
        with contextlib.suppress(FileNotFoundError), open(os.path.join(run_dir, name)) as f:
            out[name] = f.read()
    return out


def relaunch(run_dir, req):
    expect_unchanged(run_dir, req)
    stale = [STATE_FILE, EXIT_CODE_FILE, NODE_FILE]
    ranks = os.path.join(run_dir, "ranks")
    if os.path.isdir(ranks):
        stale += [os.path.join("ranks", n) for n in os.listdir(ranks) if n.endswith(".json")]
    before = read_files(run_dir, stale)
    state = load_state(run_dir)
    sweep_secrets({**req, "run": run_dir}, state.get("run_id"))
    state.update(req.get("state", {}))
    if req.get("hold"):
        state["hold"] = held(req["hold"])
    save_state(run_dir, state)
    for name in stale[1:]:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(run_dir, name))
    return {"state": state, "before": before}


def restore(run_dir, req):
    for path in req.get("files") or []:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    if (load_state(run_dir).get("hold") or {}).get("token") != req["token"]:
        return {"restored": False}
    for name in (EXIT_CODE_FILE, NODE_FILE):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(run_dir, name))
    for name, text in sorted(req["before"].items(), key=lambda kv: kv[0] == STATE_FILE):
        path = os.path.join(run_dir, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(f"{path}.restore", "w") as f:
            f.write(text)
        os.replace(f"{path}.restore", path)
    return {"restored": True}


def send(run_dir, req):
    state = load_state(run_dir)
    pid = state.get("pid")
    if not same_process(pid, state.get("pid_start")):
        return {"pid": None}
    os.kill(pid, getattr(signal, "SIG" + req.get("signal", "TERM")))
    return {"pid": pid, "sent": time.time()}


ALERT_ID = re.compile(r"^[A-Za-z0-9_.-]{1,120}\Z")


def alert(run_dir, req):
    name = req["id"]
    if not ALERT_ID.match(name) or name.startswith("."):
        raise ValueError(f"alert id {name!r}: letters, digits, _ . - only")
    state = load_state(run_dir)
    if not same_process(state.get("pid"), state.get("pid_start")):
        return {"written": False, "live": False, "sent": False}
    directory = os.path.join(run_dir, "alerts")
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, name + ".json")
    if os.path.exists(os.path.join(directory, name + ".sent")):
        return {"written": False, "live": True, "sent": True}
    tmp = os.path.join(directory, f".{name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(req["alert"], f)
    try:
        os.link(tmp, path)  # never over a request already there
    except FileExistsError:
        return {"written": False, "live": True, "sent": False}
    finally:
        os.unlink(tmp)
    return {"written": True, "live": True, "sent": False}


def recorded_processes(run_dir):
    """(pid, start) of this node's torchrun agent and of every rank it recorded."""
    found = []
    node = read_json(os.path.join(run_dir, NODE_FILE))
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
    seen, left = end_groups([os.path.join(run_dir, ENGINES_DIR)], patience_s=KILL_WAIT_S)
    return {"killed": killed, "engines": sorted(seen), "engines_left": left}


def claim(run_dir, req):
    os.makedirs(os.path.dirname(run_dir), exist_ok=True)
    try:
        os.mkdir(run_dir)
    except FileExistsError:
        started = os.path.exists(os.path.join(run_dir, NODE_FILE))
        return {"taken": load_state(run_dir), "now": time.time(), "started": started}
    if req.get("hold"):
        req = {**req, "hold": held(req["hold"])}
    save_state(run_dir, req)
    return {"taken": None}


def renew(run_dir, req):
    """The hold's lease extended, while stdin's hold "token" still holds the run."""
    state = load_state(run_dir)
    hold = state.get("hold") or {}
    if hold.get("token") != req.get("token") or state.get("status") not in ("claiming",
                                                                             "launching"):  # fmt: skip
        return {"renewed": False}
    save_state(run_dir, {**state, "hold": held(hold)})
    return {"renewed": True}


def sweep(run_dir, req):
    state = load_state(run_dir)
    token = (state.get("hold") or {}).get("token")
    if state.get("run_id") != req["run_id"] or token != req.get("token"):
        return {"swept": False}
    if state.get("status") not in ("claiming", "launching") or os.path.exists(
        os.path.join(run_dir, NODE_FILE)
    ):
        return {"swept": False}
    sweep_secrets({**req, "run": run_dir}, req["run_id"])
    shutil.rmtree(run_dir)
    return {"swept": True}


def commit(run_dir, req):
    state = load_state(run_dir)
    if state.get("run_id") != req["run_id"]:
        raise ValueError(f"{run_dir} is no longer this launch's (run id {state.get('run_id')})")
    state["status"] = "launching"
    if state.get("hold"):
        state["hold"] = held(state["hold"])
    save_state(run_dir, state)
    return {"state": state}


def queue(run_dir, req):
    state = load_state(run_dir)
    claimed_only = state.get("status") in ("claiming", "launching") and not os.path.exists(
        os.path.join(run_dir, NODE_FILE)
    )
    if state.get("run_id") != req["run_id"] or not claimed_only:
        raise ValueError(f"{run_dir} is no longer this launch's claim (status "
                         f"{state.get('status')})")  # fmt: skip
    claimed = state.get("claim") or {}
    state["status"] = "queued"
    state["queue"] = {"at": time.time(), "nonce": claimed.get("nonce", ""),
                      "since": time.time(), "waits_for": req.get("waits_for")}  # fmt: skip
    save_state(run_dir, state)
    return {"state": state}


def dequeue(run_dir, req):
    state = load_state(run_dir)
    if state.get("run_id") != req["run_id"] or state.get("status") != "queued":
        return {"removed": False, "status": state.get("status")}
    waiter = (state.get("queue") or {}).get("waiter") or {}
    if same_process(waiter.get("pid"), waiter.get("start")):
        with contextlib.suppress(ProcessLookupError):
            os.kill(waiter["pid"], signal.SIGKILL)
    session = "=dflash-" + os.path.basename(run_dir).replace(".", "=")
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        subprocess.run(["tmux", "-L", "dflashops", "kill-session", "-t", session],
                       capture_output=True, timeout=10)  # fmt: skip
    secret = read_json(os.path.join(run_dir, LAUNCH_FILE)).get("secrets")
    if isinstance(secret, str):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(secret)
    shutil.rmtree(run_dir)
    return {"removed": True, "status": "queued"}


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


class Progress:
    """A line on stderr every half second: the life that the caller's deadline counts."""

    def __init__(self):
        self.done, self.said = 0, time.monotonic()

    def beat(self, size):
        self.done += size
        if time.monotonic() - self.said >= 0.5:
            self.said = time.monotonic()
            sys.stderr.write(f"copied {self.done >> 20} MiB\n")
            sys.stderr.flush()


def copy_file(src, dst, progress):
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        while chunk := fin.read(1 << 20):
            fout.write(chunk)
            progress.beat(len(chunk))
        fout.flush()
        os.fsync(fout.fileno())
    shutil.copystat(src, dst)
    if not filecmp.cmp(src, dst, shallow=False):
        raise OSError(errno.EIO, f"{dst}: the copy differs from {src}")


def copy_tree(src, dst, skip):
    """`src` to `dst` (a new directory), each file read back and compared; the checkpoints
    named in `skip` (about to be pruned) are left out."""
    progress = Progress()
    for root, dirs, names in os.walk(src):
        rel = os.path.relpath(root, src)
        if rel == "checkpoints":
            dirs[:] = [d for d in dirs if d not in skip]
        os.makedirs(os.path.join(dst, rel), exist_ok=True)
        for name in names:
            here, there = os.path.join(root, name), os.path.join(dst, rel, name)
            if os.path.islink(here):
                os.symlink(os.readlink(here), there)
            else:
                copy_file(here, there, progress)


def move(run_dir, dest, skip):
    """RUN_DIR to `dest`: a rename, or across filesystems copy, verify, rename, remove."""
    try:
        os.rename(run_dir, dest)
        return
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
    tmp = os.path.join(os.path.dirname(dest), f".{os.path.basename(dest)}.tmp-{os.getpid()}")
    try:
        copy_tree(run_dir, tmp, skip)
        os.rename(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(run_dir)


def prune(run_dir, names):
    removed, freed = [], 0
    base = os.path.join(run_dir, CHECKPOINTS)
    for name in names:
        path = os.path.join(base, name)
        if not os.path.isdir(path):
            continue
        freed += tree_bytes(path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(path, MANIFEST))
        shutil.rmtree(path)
        removed.append(name)
    return removed, freed


def archive(run_dir, req):
    names = req.get("delete", [])
    for name in names:
        if "/" in name or name in ("", ".", ".."):
            raise ValueError(f"refusing to delete {name!r}")
    expect_unchanged(run_dir, req)
    dest = req["to"]
    if os.path.lexists(dest):
        raise FileExistsError(f"{dest} already exists")
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    before = {n: tree_bytes(os.path.join(run_dir, CHECKPOINTS, n)) for n in names}
    move(run_dir, dest, set(names))
    removed, freed = prune(dest, names)
    gone = [n for n in names if n not in removed and before[n]]  # left out of a copy
    return {"removed": removed + gone, "freed": freed + sum(before[n] for n in gone),
            "dir": dest}  # fmt: skip


ACTIONS = {
    "claim": claim,
    "sweep": sweep,
    "renew": renew,
    "commit": commit,
    "remove": remove,
    "queue": queue,
    "dequeue": dequeue,
    "discard": discard,
    "publish": publish,
    "secrets": secrets,
    "relaunch": relaunch,
    "restore": restore,
    "signal": send,
    "kill": kill,
    "archive": archive,
    "alert": alert,
}
LOCKED = (
    "sweep",
    "renew",
    "commit",
    "queue",
    "dequeue",
    "remove",
    "relaunch",
    "restore",
    "signal",
    "kill",
    "archive",
)


def main():
    action, run_dir = sys.argv[1], sys.argv[2]
    req = json.load(sys.stdin)
    try:
        if action in LOCKED and not (action == "remove" and not os.path.isdir(run_dir)):
            with run_lock(run_dir):
                out = ACTIONS[action](run_dir, req)
        else:
            out = ACTIONS[action](run_dir, req)
    except (OSError, ValueError) as exc:
        sys.stderr.write(f"runctl {action}: {exc}\n")
        sys.exit(1)
    json.dump(out, sys.stdout)


main()
