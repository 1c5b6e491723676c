"""Runs inside a target with its python3 (stdlib only): everything about its runs, one JSON.

stdin: a JSON request {"ws": workspace, "homes": {where: {"pattern": P, "name": T,
"files": [...], "archive": bool}}, "names": [run, ...] or null for all, "archive": bool,
"records": "none" | "recent" | "all", "cursor": {"ino": N, "end": N} or null,
"files": [name, ...], "console": bytes of console.log's tail, "checkpoints": bool,
"verify": bool, "dirs": [path, ...], "paths": [path, ...], "gpus": bool,
"free_port": address or null}.
stdout: {"now": time, "names": {"runs": [...], "archive": [...]}, "runs": [...],
"dirs": {path: ...}, "paths": {path: kind}, "gpus": {...} or null, "free_port": N or null};
see dflashops/runs/reading/view.py for the fields of a run.

A home is where one kind of job lives: the directories <ws>/P/<entry>/ (P a path under the
workspace, whose "*" parts match any directory: "evals/*/jobs"), each job named by the template
T from P's "*" parts and its entry ("eval-{}-{}"; default "{}": the entry). Every home's names
are listed; its jobs are read (of those named, or all) unless it is an archive home and
"archive" is false. A home's "files" are read in each of its jobs, besides the request's.
Without "homes": {"runs"} and {"archive"}.

Processes are recognised by pid and start time (field 22 of /proc/PID/stat), never by a name:
after a container restart another process can have the pid. Runs live on a tmux server of our
own (socket "dflashops"), never the user's.

train_log.jsonl is read as the contract says: numeric values only, a partial last line
ignored, a malformed line skipped with a warning naming its line number. Only what is asked
for is parsed: "recent" parses back from the end to the last RECENT records, "none" to the last
record; "all" parses every line, or, given the "cursor" of an earlier answer (the file's inode
and the end of its last complete line), only the lines after it, unless the file was replaced
or cut shorter since (then all of it, with "reset": true). Warnings name the bad lines among
those parsed.
"""

import glob
import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import time

from dflashops.remote.gpu_query import gpus_info
from dflashops.remote.layout import (
    CHECKPOINTS,
    CONSOLE_LOG,
    EXIT_CODE_FILE,
    MANIFEST,
    NODE_FILE,
    STATE_FILE,
    TRAIN_LOG,
)
from dflashops.remote.manifest import manifest_entries
from dflashops.remote.shared import read_json, same_process

STEP_DIR = re.compile(r"^step_(\d+)\Z")
TEMP_DIR = re.compile(r"^\.tmp-step_(\d+)-")
PROGRESS = re.compile(rb"^step (\d+)/(\d+) ", re.M)
PLANNED = re.compile(rb"^drafter: .*?, (\d+) steps,", re.M)
# Console lines that are no news, left out of the tail we report: torch's c10d warns at every
# connection when a peer's address has no name and no DNS server answers (getnameinfo's
# EAI_AGAIN: nodes on a LAN without DNS, as Proxmox containers often are).
QUIET = re.compile(
    rb"^\[W[^\]\n]*\] \[c10d\] The hostname of the client socket cannot be retrieved\. "
    rb"err=-?\d+\r?\n",
    re.M,
)
RECENT = 20
TMUX = ["tmux", "-L", "dflashops"]
RANK_FILE = re.compile(r"rank_(\d+)\.json$")
FILE_LIMIT = 1 << 20
CHUNK = 1 << 16


def listdir(path):
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def read_text(path, limit=FILE_LIMIT):
    try:
        with open(path, "rb") as f:
            return f.read(limit).decode("utf-8", "replace")
    except OSError:
        return None


def tmux_sessions():
    try:
        out = subprocess.run(
            [*TMUX, "list-sessions", "-F", "#{session_name}"],
            capture_output=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return []  # no server running: no sessions
    return out.stdout.decode("utf-8", "replace").split()


def session_name(run):
    """dflash-RUN, one-to-one: tmux refuses '.' in a session name, and '=' is never in a run's."""
    return "dflash-" + run.replace(".", "=")


def node_info(run_dir):
    """node.json (written by the launcher) with whether its processes are still those."""
    node = read_json(os.path.join(run_dir, NODE_FILE))
    if not isinstance(node, dict):
        return None
    for key in ("launcher", "agent"):
        proc = node.get(key)
        if isinstance(proc, dict):
            proc["alive"] = bool(same_process(proc.get("pid"), proc.get("start")))
    return node


def ranks_info(run_dir):
    """Every rank heartbeat of this node (ranks/rank_<R>.json) with whether it is alive."""
    out = []
    for path in sorted(glob.glob(os.path.join(run_dir, "ranks", "rank_*.json"))):
        beat = read_json(path)
        if not isinstance(beat, dict) or not RANK_FILE.search(path):
            continue
        beat["alive"] = bool(same_process(beat.get("pid"), beat.get("pid_start")))
        beat["log"] = os.path.isfile(path[: -len(".json")] + ".log")
        out.append(beat)
    return sorted(out, key=lambda b: b.get("rank", 0))


def free_port(address):
    """A TCP port free on `address` now (for a rendezvous the launch is about to start)."""
    with socket.socket() as sock:
        sock.bind((address, 0))
        return sock.getsockname()[1]


def numeric(obj):
    out = {}
    for key, value in obj.items():
        if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
            out[key] = value
    return out


def parse_line(line):
    """(record, None), (None, why it is skipped), or (None, None) for a blank line."""
    if not line.strip():
        return None, None
    try:
        obj = json.loads(line)
    except ValueError:
        return None, "malformed line skipped"
    step = obj.get("step") if isinstance(obj, dict) else None
    if not isinstance(step, int) or isinstance(step, bool):
        return None, "no integer 'step'; line skipped"
    return numeric(obj), None


def complete_end(f, size):
    """The offset just past the last newline: a partial last line is never read."""
    pos = size
    while pos > 0:
        start = max(0, pos - CHUNK)
        f.seek(start)
        found = f.read(pos - start).rfind(b"\n")
        if found >= 0:
            return start + found + 1
        pos = start
    return 0


def parse_from(f, start, end):
    """(records, bad) of the lines in [start, end); bad: [(offset, why)]."""
    f.seek(start)
    records, bad, offset = [], [], start
    for line in f.read(end - start).split(b"\n")[:-1]:  # the bytes end with a newline
        record, why = parse_line(line)
        if why:
            bad.append((offset, why))
        elif record is not None:
            records.append(record)
        offset += len(line) + 1
    return records, bad


def lines_backwards(f, end):
    """(offset, line) of the complete lines before `end` (which follows a newline), last first."""
    pos, pending = end, b""  # pending: bytes from pos not yet yielded, ending with a newline
    while pos > 0:
        start = max(0, pos - CHUNK)
        f.seek(start)
        pending = f.read(pos - start) + pending
        pos = start
        lines = pending.split(b"\n")[:-1]
        first = lines.pop(0) if pos > 0 else None  # may begin before this block
        offset = pos + len(pending)
        for line in reversed(lines):
            offset -= len(line) + 1
            yield offset, line
        pending = b"" if first is None else first + b"\n"


def parse_tail(f, end, want):
    """(records, bad) of the last `want` records before `end` and the lines after the first."""
    records, bad = [], []
    for offset, line in lines_backwards(f, end):
        record, why = parse_line(line)
        if why:
            bad.append((offset, why))
        elif record is not None:
            records.append(record)
            if len(records) >= want:
                break
    return records[::-1], bad[::-1]


def numbered(f, bad):
    """Warnings naming the line number of each bad line (newlines counted only when needed)."""
    out, line, pos = [], 1, 0
    for offset, why in bad:
        f.seek(pos)
        while pos < offset:
            chunk = f.read(min(CHUNK, offset - pos))
            line += chunk.count(b"\n")
            pos += len(chunk)
        out.append(f"{TRAIN_LOG}:{line}: {why}")
    return out


def log_info(run_dir, req):
    """What train_log.jsonl says, parsed only as far as the request needs (module docstring)."""
    path = os.path.join(run_dir, TRAIN_LOG)
    try:
        f = open(path, "rb")  # noqa: SIM115 (closed below)
    except OSError:
        return None
    with f:
        st = os.fstat(f.fileno())
        end = complete_end(f, st.st_size)
        mode = req.get("records", "recent")
        cursor, reset = req.get("cursor"), False
        if mode == "all":
            start = 0
            if cursor and cursor.get("ino") == st.st_ino and 0 <= cursor.get("end", -1) <= end:
                start = cursor["end"]
            reset = bool(cursor) and start == 0 and cursor.get("end") != 0
            records, bad = parse_from(f, start, end)
        else:
            records, bad = parse_tail(f, end, RECENT if mode == "recent" else 1)
        info = {
            "last": records[-1] if records else None,
            "warnings": numbered(f, bad),
            "cursor": {"ino": st.st_ino, "end": end},
            "reset": reset,
        }
    if mode != "none":
        info["records"] = records
    return info


def console_info(run_dir, tail):
    path = os.path.join(run_dir, CONSOLE_LOG)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(1 << 16)
            f.seek(max(0, size - max(tail, 1 << 16)))
            end = f.read()
        mtime = os.path.getmtime(path)
    except OSError:
        return None
    info = {"mtime": mtime, "total_steps": None}
    found = PROGRESS.findall(end) or PLANNED.findall(head)
    if found:
        last = found[-1]
        info["total_steps"] = int(last[1] if isinstance(last, tuple) else last)
    if tail:
        info["tail"] = QUIET.sub(b"", end[-tail:]).decode("utf-8", "replace")
    return info


def tree_size(path):
    total, files = 0, 0
    for root, _dirs, names in os.walk(path):
        for name in names:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
                files += 1
            except OSError:
                pass
    return total, files


class Heartbeat:
    """Hashing a big checkpoint takes minutes and prints nothing on stdout until the end: a
    line on stderr every half second is the life that the caller's deadline counts."""

    EVERY_S = 0.5

    def __init__(self):
        self.done = 0
        self.said = time.monotonic()

    def beat(self, size):
        self.done += size
        now = time.monotonic()
        if now - self.said >= self.EVERY_S:
            self.said = now
            sys.stderr.write(f"hashed {self.done >> 20} MiB\n")
            sys.stderr.flush()


HEARTBEAT = Heartbeat()


def sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            chunk = f.read(1 << 20)
            if not chunk:
                return digest.hexdigest()
            digest.update(chunk)
            HEARTBEAT.beat(len(chunk))


def verify_dir(path):
    """(ok, problem): the manifest lists exactly the other files, and every hash matches."""
    text = read_text(os.path.join(path, MANIFEST))
    if text is None:
        return False, "no MANIFEST.sha256"
    entries = manifest_entries(text)
    if entries is None:
        return False, "MANIFEST.sha256 is malformed"
    present = set()
    for root, _dirs, names in os.walk(path):
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), path).replace(os.sep, "/")
            if rel != MANIFEST:
                present.add(rel)
    missing, extra = sorted(set(entries) - present), sorted(present - set(entries))
    if missing:
        return False, "missing: " + ", ".join(missing)
    if extra:
        return False, "not in the manifest: " + ", ".join(extra)
    bad = [
        name
        for name, digest in sorted(entries.items())
        if sha256(os.path.join(path, name)) != digest
    ]
    if bad:
        return False, "sha256 mismatch: " + ", ".join(bad)
    return True, None


def dir_info(path, verify):
    """A checkpoint copy elsewhere (pull-ckpt): its manifest's text, and verified when asked."""
    if not os.path.isdir(path):
        return {"exists": False}
    info = {"exists": True, "manifest": read_text(os.path.join(path, MANIFEST))}
    if verify:
        info["verified"], info["problem"] = verify_dir(path)
    return info


def checkpoints(run_dir, verify):
    root = os.path.join(run_dir, CHECKPOINTS)
    out = []
    for name in listdir(root):
        path = os.path.join(root, name)
        m = STEP_DIR.match(name) or TEMP_DIR.match(name)
        if not m or not os.path.isdir(path):
            continue
        size, files = tree_size(path)
        manifest = os.path.join(path, MANIFEST)
        item = {
            "step": int(m.group(1)),
            "name": name,
            "complete": name.startswith("step_") and os.path.isfile(manifest),
            "temporary": not name.startswith("step_"),
            "bytes": size,
            "files": files,
            "mtime": os.path.getmtime(path),
        }
        if item["complete"]:
            item["files"] = files - 1
            item["manifest"] = read_text(manifest)
            item["entries"] = manifest_entries(item["manifest"] or "")
            if verify:
                item["verified"], item["problem"] = verify_dir(path)
        out.append(item)
    out.sort(key=lambda c: (c["step"], c["temporary"]))
    return out


def exit_file(run_dir):
    text = read_text(os.path.join(run_dir, EXIT_CODE_FILE), 64)
    try:
        return int(text.strip()) if text else None
    except ValueError:
        return None


def run_info(run_dir, where, name, req, sessions, extra):
    state = read_json(os.path.join(run_dir, STATE_FILE))
    info = {
        "name": name,
        "where": where,
        "dir": run_dir,
        "state": state if isinstance(state, dict) else None,
        "exit_file": exit_file(run_dir),
        "tmux": None if sessions is None else session_name(name) in sessions,
        "pid_alive": same_process(*pid_of(state)),
        "node": node_info(run_dir),
        "ranks": ranks_info(run_dir),
        "log": log_info(run_dir, req),
        "console": console_info(run_dir, int(req.get("console") or 0)),
    }
    if req.get("checkpoints"):
        info["checkpoints"] = checkpoints(run_dir, req.get("verify"))
    files = {}
    for fname in [*(req.get("files") or []), *extra]:
        files[fname] = read_text(os.path.join(run_dir, fname))
    info["files"] = files
    return info


def pid_of(state):
    if not isinstance(state, dict):
        return None, None
    return state.get("pid"), state.get("pid_start")


def path_kind(path):
    if os.path.isdir(path):
        return "dir"
    if os.path.isfile(path):
        return "file"
    return "missing" if not os.path.lexists(path) else "other"


def job_dirs(ws, home):
    """{name: dir} of the jobs of one home (see the module's docstring)."""
    pattern = home.get("pattern", "")
    template = home.get("name") or "{}"
    base = os.path.join(ws, pattern)
    bases = sorted(glob.glob(base)) if "*" in pattern else [base]
    found = {}
    for base in bases:
        parts = os.path.relpath(base, ws).split(os.sep)
        stars = [parts[i] for i, want in enumerate(pattern.split("/")) if want == "*"]
        for entry in listdir(base):  # a hidden directory (datagen's .tokens/) is no job
            if not entry.startswith(".") and os.path.isdir(os.path.join(base, entry)):
                found[template.format(*stars, entry)] = os.path.join(base, entry)
    return found


DEFAULT_HOMES = {"runs": {"pattern": "runs"}, "archive": {"pattern": "archive", "archive": True}}


def main():
    req = json.load(sys.stdin)
    ws = req["ws"]
    homes = req.get("homes") or DEFAULT_HOMES
    listed = {where: job_dirs(ws, home) for where, home in homes.items()}
    names = {where: list(found) for where, found in listed.items()}
    wanted = req.get("names")
    sessions = tmux_sessions()
    runs = []
    for where, found in listed.items():
        if homes[where].get("archive") and not req.get("archive"):
            continue
        extra = homes[where].get("files") or []
        for name, run_dir in found.items():
            if wanted is not None and name not in wanted:
                continue
            try:
                runs.append(run_info(run_dir, where, name, req, sessions, extra))
            except OSError as exc:
                runs.append({"name": name, "where": where, "error": str(exc)})
    out = {
        "now": time.time(),
        "names": names,
        "runs": runs,
        "dirs": {p: dir_info(p, req.get("verify")) for p in req.get("dirs") or []},
        "paths": {p: path_kind(p) for p in req.get("paths") or []},
        "gpus": gpus_info() if req.get("gpus") else None,
        "free_port": free_port(req["free_port"]) if req.get("free_port") else None,
    }
    json.dump(out, sys.stdout)


main()
