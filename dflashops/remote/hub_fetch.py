# A hub repository downloaded inside the target by the target's python with huggingface_hub,
# every file checked against the hub's hashes (LFS files by sha256, the others by their git
# blob id), with a line on stderr every few seconds while bytes arrive or are hashed (the life
# the operator's deadline counts: silence means that nothing moves).
#
# stdin: {"repo", "revision", "dest", "token" (or null), "deadline" (seconds),
#         "repo_type" ("model" or "dataset", default model), "files" (names or fnmatch
#         patterns, or null: all)}
# stdout: {"repo", "commit", "files", "names", "bytes", "fetched", "checked", "bad", "removed", "extra",
#          "seconds": {"check": of the files already there, "fetch": of the others, hashed too}}
# Exit 0 with "bad" naming the files that did not match (removed, with the hub's record of
# them: the next run fetches them again); 1 failed; 2 DEST holds another repository;
# 3 the hub refused or went silent for 80% of the deadline (every partial file removed);
# 4 no huggingface_hub, or a named file not in the repository; 130 interrupted.
#
# DEST holds one repository at one commit: .cache/dflashops/fetch.json names them and the
# files of the listing; a file that an earlier commit listed and this one does not is removed,
# a file that no listing names is left alone and named ("extra"). huggingface_hub 2.x writes
# each download to a process-unique .incomplete and resumes it within the run; a run that was
# cut off leaves one behind, which the next run removes (under DEST's lock, so not another's).
import concurrent.futures
import contextlib
import fcntl
import fnmatch
import hashlib
import json
import os
import shutil
import sys
import threading
import time

OURS = os.path.join(".cache", "dflashops")  # under DEST: our lock and record
RECORD = "fetch.json"
LOCK = "fetch.lock"
HUB_RECORDS = os.path.join(".cache", "huggingface", "download")  # huggingface_hub's, local_dir
WORKERS = 8  # files at once, as snapshot_download does
CHUNK = 8 << 20  # hashed at a time
PIECE = 1 << 20  # written at a time by huggingface_hub
EVERY_S = 5.0  # a progress line at most this often (and at least 3 in a deadline)
GIVE_UP = 0.8  # of the deadline without movement: we stop first, cleanly
SHOWN = 64 << 10  # less moved since the last line is not worth one (it still counts as life)


class Stop(Exception):
    def __init__(self, code, message):
        super().__init__(message)
        self.code = code


def gib(n):
    if n >= 1 << 30:
        return f"{n / (1 << 30):.2f} GiB"
    return f"{n / (1 << 20):.1f} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


class Meter:
    """What moved: bytes fetched (whole files and partial ones on disk), bytes hashed."""

    def __init__(self, dest):
        self.dest = dest
        self.lock = threading.Lock()
        self.fetched = self.hashed = 0
        self.at_work = {}  # name -> "fetching" | "checking"
        self.latest = {}  # kind -> the file that last began it

    def start(self, name, kind):
        with self.lock:
            self.at_work[name] = kind
            self.latest[kind] = name

    def fetched_file(self, name, size):
        with self.lock:
            self.at_work.pop(name, None)
            self.fetched += size

    def hash_bytes(self, n):
        with self.lock:
            self.hashed += n

    def done(self, name):
        with self.lock:
            self.at_work.pop(name, None)

    def partial(self):
        """Bytes of downloads under way: huggingface_hub's .incomplete files, and a file it
        copies from its cache straight into place."""
        with self.lock:
            fetching = [n for n, kind in self.at_work.items() if kind == "fetching"]
        size = 0
        for path in partial_files(self.dest) + [os.path.join(self.dest, n) for n in fetching]:
            with contextlib.suppress(OSError):  # moved into place, or removed, meanwhile
                size += os.path.getsize(path)
        return size

    def now(self):
        with self.lock:
            return self.fetched, self.hashed, dict(self.at_work)

    def named(self, kind):
        """The files at work of a kind ("a and 2 more"), else the last one that was."""
        with self.lock:
            names = sorted(n for n, k in self.at_work.items() if k == kind)
            if not names:
                return self.latest.get(kind, "files")
        return names[0] + (f" and {len(names) - 1} more" if len(names) > 1 else "")


def partial_files(dest):
    found = []
    for root, _dirs, names in os.walk(os.path.join(dest, HUB_RECORDS)):
        found += [os.path.join(root, n) for n in names if n.endswith(".incomplete")]
    return found


def remove_partial_files(dest):
    removed = 0
    for path in partial_files(dest):
        try:
            removed += os.path.getsize(path)
            os.unlink(path)
        except OSError:
            pass
    return removed


def holds_files(dest):
    """Any file in DEST besides our and huggingface_hub's .cache."""
    for root, dirs, files in os.walk(dest):
        if root == dest:
            dirs[:] = [d for d in dirs if d != ".cache"]
        if files:
            return True
    return False


def say(line):
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def digest(path, lfs, meter):
    h = hashlib.sha256() if lfs else hashlib.sha1()
    if not lfs:
        h.update(b"blob %d\0" % os.path.getsize(path))
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            meter.hash_bytes(len(chunk))
    return h.hexdigest()


def matches(dest, entry, meter):
    name, size, want, lfs = entry
    path = os.path.join(dest, name)
    if not os.path.isfile(path) or os.path.getsize(path) != size:
        return False
    meter.start(name, "checking")
    try:
        return digest(path, lfs, meter) == want
    finally:
        meter.done(name)


def drop(dest, name):
    """A file and huggingface_hub's record of it: without the record, it fetches it again."""
    for path in (os.path.join(dest, name), os.path.join(dest, HUB_RECORDS, name + ".metadata")):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    parent = os.path.dirname(os.path.join(dest, name))
    while parent != dest.rstrip("/") and parent.startswith(dest):
        try:
            os.rmdir(parent)  # only an empty one
        except OSError:
            break
        parent = os.path.dirname(parent)


class Watch:
    """The main thread's loop while workers fetch or hash: a line when something moved, and
    Stop(3) once nothing moved for GIVE_UP of the deadline."""

    def __init__(self, meter, deadline, totals, silent):
        self.meter, self.totals, self.silent = meter, totals, silent  # totals: (fetch, hash)
        self.every = max(0.2, min(EVERY_S, deadline / 3))
        self.give_up = deadline * GIVE_UP
        self.first = self.last = self.said_at = self.moved()
        self.since = self.said = time.monotonic()

    def moved(self):
        fetched, hashed, _ = self.meter.now()
        return fetched + self.meter.partial(), hashed

    def wait(self, futures):
        pending = set(futures)
        while pending:
            done, pending = concurrent.futures.wait(
                pending, timeout=self.every, return_when=concurrent.futures.FIRST_EXCEPTION
            )
            for future in done:
                future.result()  # a worker's error ends the run here
            self.tick()

    def tick(self):
        now, moved = time.monotonic(), self.moved()
        if moved != self.last:
            self.last, self.since = moved, now
            if now - self.said >= self.every:
                self.report(moved, now)
        elif now - self.since > self.give_up:
            names = ", ".join(sorted(self.meter.now()[2])) or "the listing"
            raise Stop(3, f"{self.silent} for {now - self.since:.0f} s ({names}); "
                          "partial files removed, run it again")  # fmt: skip

    def report(self, moved, now):
        span = now - self.said
        for i, kind, verb in ((0, "fetching", "fetched"), (1, "checking", "hashed")):
            step = moved[i] - self.said_at[i]
            if step >= SHOWN:
                done = moved[i] - self.first[i]
                say(f"{kind} {self.meter.named(kind)}: {gib(done)} of {gib(self.totals[i])} "
                    f"{verb}, {step / span / 1e6:.1f} MB/s")  # fmt: skip
        self.said, self.said_at = now, moved


def lock(dest):
    os.makedirs(os.path.join(dest, OURS), exist_ok=True)
    fd = os.open(os.path.join(dest, OURS, LOCK), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise Stop(1, f"{dest}: another fetch-model is writing here; wait for it to end") from None
    return fd


def read_record(dest):
    try:
        with open(os.path.join(dest, OURS, RECORD)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def write_record(dest, record):
    path = os.path.join(dest, OURS, RECORD)
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)


def settle(dest, req, commit, names, wanted):
    """DEST made ours for this repository at this commit: another repository refused, the
    files of an earlier commit that this one lacks removed, files nobody listed named."""
    kind = req.get("repo_type") or "model"
    old = read_record(dest)
    if old and (old["repo"], old.get("repo_type", "model")) != (req["repo"], kind):
        raise Stop(2, f"{dest} holds {old['repo']} (fetched at {old['commit'][:12]}); "
                      "give another --to, or remove it first")  # fmt: skip
    listed = set(names)
    held = set(old["files"]) if old else set()
    stale = sorted(held - listed)
    for name in stale:
        drop(dest, name)
    if stale:
        say(f"removed {len(stale)} file(s) that {commit[:12]} no longer has: {', '.join(stale)}")
    write_record(dest, {"repo": req["repo"], "repo_type": kind, "commit": commit,
                        "files": sorted((held & listed) | set(wanted))})  # fmt: skip
    extra = []
    for root, dirs, files in os.walk(dest):
        if root == dest:
            dirs[:] = [d for d in dirs if d != ".cache"]
        rel = os.path.relpath(root, dest)
        extra += [os.path.normpath(os.path.join(rel, n)) for n in files]
    extra = sorted(n for n in extra if n not in listed)
    if extra:
        shown = ", ".join(extra[:5]) + (f" and {len(extra) - 5} more" if len(extra) > 5 else "")
        say(f"{dest}: not in {req['repo']}@{commit[:12]}, left as they are: {shown}")
    return stale, extra


def listing(hub, req, token):
    """The commit REV names now and its files: (name, size, hash, is LFS) each."""
    info = hub.HfApi().repo_info(req["repo"], revision=req["revision"],
                                 repo_type=req.get("repo_type"), files_metadata=True,
                                 token=token)  # fmt: skip
    entries = []
    for s in info.siblings:
        parts = s.rfilename.split("/")
        if s.rfilename.startswith("/") or ".." in parts or parts[0] == ".cache":
            raise Stop(1, f"{req['repo']}@{info.sha[:12]} lists {s.rfilename!r}: not a file "
                          "name inside DEST; refused")  # fmt: skip
        lfs = s.lfs is not None
        want = s.lfs.sha256 if lfs else s.blob_id
        entries.append((s.rfilename, s.lfs.size if lfs else s.size, want, lfs))
    return info.sha, entries


def chosen(req, commit, entries):
    """The entries of the files asked for, by name or fnmatch pattern (all when none are)."""
    wanted = req.get("files")
    if not wanted:
        return entries
    missing = sorted(w for w in wanted if not any(fnmatch.fnmatchcase(e[0], w) for e in entries))
    if missing:
        raise Stop(4, f"{req['repo']}@{commit[:12]} has no {', '.join(missing)}")
    return [e for e in entries if any(fnmatch.fnmatchcase(e[0], w) for w in wanted)]


def fetch_one(hub, req, token, commit, entry, meter):
    """Download one file; True when it then matches the hub's hash (else it is dropped)."""
    name, size, _, _ = entry
    meter.start(name, "fetching")
    hub.hf_hub_download(req["repo"], name, repo_type=req.get("repo_type"), revision=commit,
                        local_dir=req["dest"], token=token)  # fmt: skip
    meter.fetched_file(name, size)
    if matches(req["dest"], entry, meter):
        return True
    drop(req["dest"], name)
    return False


def run(hub, req, meter, pool):
    token = req.get("token") or False
    dest = req["dest"]
    swept = remove_partial_files(dest)
    if swept:
        say(f"removed the partial files of a run that was cut off ({gib(swept)})")
    commit, every_file = listing(hub, req, token)
    entries = chosen(req, commit, every_file)
    say(f"{req['repo']}@{commit[:12]}: {len(entries)} file(s), {gib(sum(e[1] for e in entries))}")
    stale, extra = settle(dest, req, commit, [e[0] for e in every_file], [e[0] for e in entries])
    deadline = float(req.get("deadline") or 30)
    present = [e for e in entries if os.path.isfile(os.path.join(dest, e[0]))]
    if present:
        say(f"checking the {len(present)} file(s) already in {dest}")
    began = time.monotonic()
    checks = {pool.submit(matches, dest, e, meter): e for e in present}
    there = sum(e[1] for e in present)
    Watch(meter, deadline, (0, there), "no byte of the files there hashed").wait(checks)
    checked_s, began = time.monotonic() - began, time.monotonic()
    good = {checks[f][0] for f in checks if f.result()}
    todo = [e for e in entries if e[0] not in good]
    for e in todo:
        drop(dest, e[0])  # a file that did not match goes with the hub's record of it
    fetch_bytes = sum(e[1] for e in todo)
    if todo:
        say(f"fetching {len(todo)} file(s), {gib(fetch_bytes)}, of {req['repo']}@{commit[:12]}")
    jobs = {pool.submit(fetch_one, hub, req, token, commit, e, meter): e for e in todo}
    Watch(meter, deadline, (fetch_bytes,) * 2, "nothing came from the hub").wait(jobs)
    bad = sorted(jobs[f][0] for f in jobs if not f.result())
    seconds = {"check": round(checked_s, 3), "fetch": round(time.monotonic() - began, 3)}
    fetched, hashed, _ = meter.now()
    size = sum(e[1] for e in entries if e[0] not in bad)
    return {"repo": req["repo"], "commit": commit, "files": len(entries), "bytes": size,
            "names": [e[0] for e in entries],
            "fetched": fetched, "checked": hashed, "bad": bad, "removed": stale,
            "extra": extra, "seconds": seconds}  # fmt: skip


def import_hub():
    # asked to fetch: an HF_HUB_OFFLINE of the target's environment (or ours) does not apply;
    # huggingface_hub reads these as it is imported; its own bars would be \r-lines in a pipe
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.pop(name, None)
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    # our progress and stall rule watch each partial file grow as plain HTTP writes it, in
    # order (the path the tests run); the xet transport (hf_xet) writes it its own way
    os.environ["HF_HUB_DISABLE_XET"] = "1"
    try:
        import huggingface_hub
        from huggingface_hub import constants, errors
    except ImportError:
        raise Stop(4, f"no huggingface_hub in {sys.executable}") from None
    # it writes what arrives by this much: at its default (10 MiB) a slow link would look
    # silent for longer than the deadline while bytes still come
    constants.DOWNLOAD_CHUNK_SIZE = PIECE
    return huggingface_hub, (errors.HfHubHTTPError, errors.LocalEntryNotFoundError)


def main():
    req = json.loads(sys.stdin.read())
    req["dest"] = os.path.normpath(req["dest"])
    code, locked = 0, False
    made = not os.path.exists(req["dest"])
    pool = concurrent.futures.ThreadPoolExecutor(WORKERS)
    try:
        hub, refusals = import_hub()
        lock(req["dest"])
        locked = True
        try:
            print(json.dumps(run(hub, req, Meter(req["dest"]), pool)))
        except refusals as exc:
            raise Stop(3, (str(exc).splitlines() or [type(exc).__name__])[0]) from None
    except Stop as stop:
        say(str(stop))
        code = stop.code
    except KeyboardInterrupt:
        say("interrupted")
        code = 130
    except Exception as exc:  # noqa: BLE001 (the hub library's own: one line, not a traceback)
        say(f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}")
        code = 1
    if code and locked:
        remove_partial_files(req["dest"])  # ours: DEST's lock is still held
        if made and not holds_files(req["dest"]):
            shutil.rmtree(req["dest"], ignore_errors=True)  # a failed first run leaves nothing
    sys.stdout.flush()
    os._exit(code)  # download threads still at work end with us, and DEST's lock with them


main()
