"""Runs inside the eval target under remote/launcher.py (stdlib only): a continuous eval, the
follower of one training run on another target.

argv: JOB_DIR. Reads JOB_DIR/job.json, written by `dflashops eval RUN --every N`: {"run",
"every": N, "server": {"address", "port"}, "token_file", "argv": the evaluator's command line
without --checkpoint and --out, "ckpts": <ws>/ckpts/RUN, "results": <ws>/evals/RUN, "lock":
<ws>/evals/.evaluating, "poll": seconds}. Over and over: it lists the run's complete
checkpoints on the checkpoint server (remote/ckpt_server.py, on the training target), and takes
the oldest one not yet evaluated whose step is a multiple of N (and, once the run has ended,
its last): copies it to <ws>/ckpts/RUN/step_N through .partial-step_N (removed for a step
gone before it was copied), each file checked against the checkpoint's MANIFEST.sha256 as it
lands; the optimizer state (training_state.pt, optimizer/) is left out, the copy's manifest
lists what is there (a file that verified is never fetched
again), then evaluates it holding the target's evaluation lock (remote/evallock.py: never two
evaluations at once there), its result <ws>/evals/RUN/step_N.json. A step with a result there
(this job's, an earlier one's, or `eval --step`'s) is never evaluated again. When the run has
ended and its last checkpoint is scored, it tells the server goodbye and finishes; stopped or
failed, it tells it goodbye too (a resume gets a new server).

Every request has a deadline and is signed with the token the two share (remote/ckpt_proof.py);
each answer must prove the token over its status, time and body, and a file's body is checked
against the digest of the signed manifest as it lands: what a relay between the two changes is
refused and nothing of it kept. Every request (the listing, a manifest, a file) whose answer
does not come or is not proven is asked again every `poll` seconds for up to an hour before
the job fails; a file whose body is not its manifest's is fetched ATTEMPTS times. While it
copies and evaluates a step it asks the server's listing every `poll` seconds too: a server
whose run has ended waits only so long (its linger) for a follower that has gone quiet. A resume after the server has gone starts a new one
(runs/evaluation/continuous.py) and gives its port and token in job.json, which the follower reads as it
starts (and notes in state.json's "server"). It keeps to the contract of every job's program
(dflashops/runs/lifecycle/job_kind.py): state.json's "status", "pid", "pid_start"; SIGTERM stops it (the
evaluator being run gets SIGTERM; no result is kept for that step), "stopped"; it resumes by
the results there. state.json's "done" is the steps it evaluated, "skipped" those gone from
the training target before they were copied, "failed" those whose evaluator failed, "lags"
the seconds from each checkpoint's manifest written on the training target (its clock) to its
result stored here (this one's), "next" the step it evaluates or waits for now (null once the
run has ended and nothing is left).
"""

import contextlib
import fcntl
import hashlib
import http.client
import json
import os
import secrets
import shutil
import signal
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

from dflashops.remote.ckpt_proof import HEX, answer_mac, request_mac, same_mac, stamp_of
from dflashops.remote.engine_groups import start_evaluator
from dflashops.remote.evallock import one_evaluation
from dflashops.remote.layout import MANIFEST, OPTIMIZER_DIR, STATE_FILE, TRAINING_STATE
from dflashops.remote.manifest import file_sha256, manifest_entries, safe_name
from dflashops.remote.shared import proc_start, read_json, write_json

DEADLINE = 60  # seconds for each request to the server (connect, and each read)
UNREACHABLE_FOR = 3600  # seconds the server may be out of reach before the job fails
ATTEMPTS = 3  # tries of one file whose body is not its manifest's (and of the goodbye)
RETRY_S = 2  # between two tries
MAX_ANSWER = 16 << 20  # bytes of an answer that is not a checkpoint file


def say(text):
    stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    sys.stdout.write(f"[follow] {stamp}: {text}\n")
    sys.stdout.flush()


class Gone(Exception):
    """The server has no such checkpoint (any more): its own signed answer."""


class Forged(OSError):
    """An answer that the server holding the token did not give as it came (its status, time,
    digest or body): a blip, asked again, and nothing of it kept."""


class Stopped(Exception):
    """A stop came while the server was being asked again."""


class Server:
    def __init__(self, job):
        where = job["server"]
        self.base = f"http://{where['address']}:{where['port']}"
        token = read_json(job["token_file"]).get("token")
        if not token:
            raise SystemExit(f"follow: error: no token in {job['token_file']}")
        self.token = token  # never sent: each request is signed with it (ckpt_proof.py)
        self.offset = 0.0  # the server's clock less ours, as its signed answers tell

    def open(self, path, method="GET", **query):
        """The answer to one request, which the server holding the token signed; its body
        still to be read against the signed digest (answer.headers["X-Digest"])."""
        target = path + ("?" + urllib.parse.urlencode(query) if query else "")
        nonce, stamp = secrets.token_hex(16), str(int(time.time() + self.offset))
        mac = request_mac(self.token, nonce, stamp, method, target)
        request = urllib.request.Request(self.base + target, method=method, headers={
            "X-Nonce": nonce, "X-Time": stamp, "Authorization": f"DFO {mac}"})  # fmt: skip
        try:
            answer = urllib.request.urlopen(request, timeout=DEADLINE)
        except urllib.error.HTTPError as exc:
            answer = exc
        try:
            self.check(answer, nonce)
        except BaseException:
            answer.close()
            raise
        if answer.status == 200:
            return answer
        text = body(answer, answer.headers["X-Digest"])
        answer.close()
        if answer.status == 404:
            raise Gone(path)
        raise OSError(f"{self.base} answered {answer.status}: "
                      f"{text.decode(errors='replace').strip()[:200]}")  # fmt: skip

    def check(self, answer, nonce):
        """The answer's status, time and digest are the server's for this request; its clock
        noted (a request it found out of its time window is then asked again in it)."""
        headers = answer.headers or {}
        stamp, digest = headers.get("X-Time"), headers.get("X-Digest") or ""
        want = answer_mac(self.token, nonce, answer.status, stamp, digest)
        proven = stamp_of(stamp) is not None and HEX.match(digest)
        if not (proven and same_mac(headers.get("X-Proof"), want)):
            where = f"{self.base}{path_of(answer)}"
            raise Forged(f"{where} answered without proving it holds the token (its status, "
                         "time or body not as the server signed them); not trusted")  # fmt: skip
        self.offset = stamp_of(stamp) - time.time()

    def get(self, path, method="GET", **query):
        """A whole answer (never a checkpoint file), its body the one the server signed."""
        with self.open(path, method, **query) as answer:
            return body(answer, answer.headers["X-Digest"])


def path_of(answer):
    return urllib.parse.urlsplit(answer.url or "").path or "a request"


def body(answer, digest):
    """An answer's body (at most MAX_ANSWER bytes) when its sha256 is the signed one."""
    data = answer.read(MAX_ANSWER + 1)
    if len(data) > MAX_ANSWER or hashlib.sha256(data).hexdigest() != digest:
        raise Forged(f"the answer to {path_of(answer)} is not the body the server signed; "
                     "not trusted")  # fmt: skip
    return data


@contextlib.contextmanager
def kept_alive(server, every):
    """The server asked its listing every `every` seconds while the body works."""
    done = threading.Event()

    def ask():
        while not done.wait(every):
            with contextlib.suppress(OSError, ValueError, Gone, http.client.HTTPException):
                server.get("/list")

    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()


def update(job_dir, **keys):
    path = os.path.join(job_dir, STATE_FILE)
    write_json(path, {**read_json(path), **keys})


def fetch_file(server, step, name, digest, path, size):
    """One file into `path` (through path.part), hashed as it lands, never more than `size`
    bytes (its signed manifest's bound); None when it verifies, else what is wrong with it
    (nothing of it kept). A cut copy raises (a blip)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    part = path + ".part"
    hashed = hashlib.sha256()
    try:
        with server.open("/file", step=step, name=name) as answer, open(part, "wb") as out:
            if answer.headers["X-Digest"] != digest:
                return f"the server's copy is not the one its {MANIFEST} lists (changed?)"
            left = size + 1
            while left > 0 and (chunk := answer.read(min(1 << 20, left))):
                out.write(chunk)
                hashed.update(chunk)
                left -= len(chunk)
        if left <= 0:
            return f"more than its {size} bytes"
        if hashed.hexdigest() != digest:
            return f"its sha256 differs from {MANIFEST}"
        os.replace(part, path)
        return None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(part)


def fetch_checked(server, step, name, digest, path, size, patiently):
    """fetch_file, asked again (patiently: a blip, as the listing is) after a cut copy, and up
    to ATTEMPTS times for a body that is not the manifest's; a checkpoint gone (Gone) is not
    a blip."""
    for attempt in range(1, ATTEMPTS + 1):
        what = f"step {step}: {name}"
        problem = patiently(what, lambda: fetch_file(server, step, name, digest, path, size))
        if problem is None:
            return
        if attempt < ATTEMPTS:
            say(f"{what}: {problem}; not kept; trying again ({attempt}/{ATTEMPTS})")
            time.sleep(RETRY_S)
    raise ValueError(f"step_{step}/{name}: {problem} ({ATTEMPTS} tries)")


def bounds(sizes):
    """{name: bytes} from /manifest's "sizes"; {} when it is malformed."""
    if not isinstance(sizes, dict):
        return {}
    return {n: v for n, v in sizes.items() if isinstance(v, int) and v >= 0}


def resume_only(name):
    """A file only a resumed trainer reads (its optimizer state): never copied for an
    evaluation, so that what is kept of each scored step is its weights and config."""
    return name == TRAINING_STATE or name.startswith(OPTIMIZER_DIR + "/")


def pull(server, job, step, patiently):
    """<ckpts>/step_N, a verified copy of the server's; how many files were fetched. It keeps
    to pull-ckpt's receiver's ways (remote/receive.py), so that the two never mix: the partial
    directory's flock held while it writes, the placing under the parent's flock, a copy at
    step_N that holds the same manifest taken as it is."""
    doc = patiently(f"step {step}: its manifest",
                    lambda: json.loads(server.get("/manifest", step=step)))  # fmt: skip
    doc = doc if isinstance(doc, dict) else {}
    full, sizes = doc.get("manifest"), bounds(doc.get("sizes"))
    entries = manifest_entries(full) if isinstance(full, str) else None
    if entries is None or not all(safe_name(n) and n != MANIFEST for n in entries):
        raise ValueError(f"step_{step}: its {MANIFEST} is malformed or names a path outside it")
    entries = {n: d for n, d in entries.items() if not resume_only(n)}
    text = "".join(line + "\n" for line in full.splitlines()
                   if line.partition("  ")[2].lstrip("*") in entries)  # fmt: skip
    final = os.path.join(job["ckpts"], f"step_{step}")
    partial = os.path.join(job["ckpts"], f".partial-step_{step}")
    if read_text(os.path.join(final, MANIFEST)) == text:
        return 0  # placed by an earlier pull (pull-ckpt's receiver verifies before it places)
    os.makedirs(partial, mode=0o700, exist_ok=True)
    with held(partial, os.O_DIRECTORY | os.O_NOFOLLOW):
        if read_text(os.path.join(final, MANIFEST)) == text:
            return 0  # placed by another copy while we waited
        fetched = 0
        for name, digest in sorted(entries.items()):
            path = os.path.join(partial, name)
            if file_sha256(path) == digest:
                continue
            if name not in sizes:
                raise ValueError(f"step_{step}/{name}: the server gave no size for it")
            fetch_checked(server, step, name, digest, path, sizes[name], patiently)
            fetched += 1
        only(partial, entries)
        with open(os.path.join(partial, MANIFEST), "w", encoding="utf-8") as f:
            f.write(text)
        place(partial, final, text)
    return fetched


@contextlib.contextmanager
def held(path, flags=0):
    """An exclusive flock on `path` (a directory), waited for while another copy holds it."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | flags)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield fd
    finally:
        os.close(fd)


def only(base, entries):
    """Remove what the manifest does not list (a receiver's marker, temporary names)."""
    for root, _dirs, names in os.walk(base):
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), base).replace(os.sep, "/")
            if rel not in entries:
                os.unlink(os.path.join(root, name))


def place(partial, final, text):
    """Rename the partial directory to step_N under their parent's lock, swapping out a copy
    there that does not hold this manifest."""
    with held(os.path.dirname(final), os.O_DIRECTORY):
        if read_text(os.path.join(final, MANIFEST)) == text:
            shutil.rmtree(partial, ignore_errors=True)
            return
        if os.path.lexists(final):
            old = f"{os.path.dirname(final)}/.old-step_{os.path.basename(final)[5:]}-{os.getpid()}"
            os.rename(final, old)
            shutil.rmtree(old, ignore_errors=True)
        os.rename(partial, final)


def read_text(path):
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError:
        return None


def evaluated(job):
    """The steps with a result on this target."""
    try:
        names = os.listdir(job["results"])
    except OSError:
        return set()
    return {int(n[5:-5]) for n in names
            if n.startswith("step_") and n.endswith(".json") and n[5:-5].isdigit()}  # fmt: skip


def next_step(listing, job, settled):
    """The oldest step to evaluate now, or None."""
    steps = listing.get("checkpoints") or []
    wanted = {s for s in steps if s % job["every"] == 0}
    if listing.get("ended") and steps:
        wanted.add(max(steps))
    todo = sorted(wanted - evaluated(job) - settled)
    return todo[0] if todo else None


def awaited(listing, job):
    """The step a follower with nothing to evaluate waits for: the next multiple of N after
    the newest checkpoint (None once the run has ended)."""
    if listing.get("ended"):
        return None
    every = job["every"]
    return (max(listing.get("checkpoints") or [0]) // every + 1) * every


class Follower:
    def __init__(self, job_dir):
        self.dir = job_dir
        self.job = read_json(os.path.join(job_dir, "job.json"))
        state = read_json(os.path.join(job_dir, STATE_FILE))
        self.done = list(state.get("done") or [])
        self.skipped = list(state.get("skipped") or [])
        self.failed = list(state.get("failed") or [])
        self.lags = dict(state.get("lags") or {})
        self.stopping, self.child = [], []
        self.next = state.get("next", "?")
        self.server = Server(self.job)

    def awaiting(self, step):
        """state.json's "next", written when it changes."""
        if step != self.next:
            self.next = step
            update(self.dir, next=step)

    def on_term(self, _signum, _frame):
        self.stopping.append(True)
        for child in self.child:
            with contextlib.suppress(OSError):
                child.terminate()

    def patiently(self, what, call):
        """call(), asked again every `poll` seconds while the server is out of reach or its
        answer is not proven, for up to UNREACHABLE_FOR; a stop ends it (Stopped)."""
        since = None
        while not self.stopping:
            try:
                return call()
            except (OSError, ValueError, http.client.HTTPException) as exc:
                since = since or time.monotonic()
                if time.monotonic() - since > UNREACHABLE_FOR:
                    raise SystemExit(f"follow: error: {what}: the checkpoint server "
                                     f"{self.server.base} was out of reach for an hour "
                                     f"({exc})") from None  # fmt: skip
                say(f"{what}: the checkpoint server {self.server.base} is out of reach or not "
                    f"proven ({exc}); trying again (a server gone with its run: `dflashops "
                    f"eval {self.job['run']} --every {self.job['every']} --on TARGET` starts "
                    "a new one)")  # fmt: skip
                self.pause(self.job.get("poll", 5))
        raise Stopped(what)

    def pause(self, seconds):
        deadline = time.monotonic() + seconds
        while not self.stopping and time.monotonic() < deadline:
            time.sleep(0.2)

    def listing(self):
        """The server's listing; None once stopped."""
        try:
            return self.patiently("the listing", lambda: json.loads(self.server.get("/list")))
        except Stopped:
            return None

    def evaluate(self, step):
        """The evaluator on the copy of `step`, under the target's evaluation lock; its code."""
        ckpt = os.path.join(self.job["ckpts"], f"step_{step}")
        out = os.path.join(self.job["results"], f"step_{step}.json")
        argv = [*self.job["argv"], "--checkpoint", ckpt, "--out", out]
        with one_evaluation(self.job["lock"], self.stopping, say) as held:
            if not held:
                return None
            try:
                child = start_evaluator(argv, self.dir)
            except OSError as exc:
                say(f"step {step}: the evaluator could not start: {exc}")
                return 127
            self.child.append(child)
            code = child.wait()
            self.child.clear()
        return 128 - code if code < 0 else code

    def result_since(self, step, started):
        path = os.path.join(self.job["results"], f"step_{step}.json")
        with contextlib.suppress(OSError):
            return os.path.getmtime(path) >= started
        return False

    def one(self, step, landed):
        """Copy and evaluate `step` (complete on the training target since `landed`)."""
        started = time.time()
        try:
            fetched = pull(self.server, self.job, step, self.patiently)
        except Stopped:
            return say(f"step {step}: stopped before it was copied")
        except Gone:
            say(f"step {step}: gone from the training target before it was copied; skipped")
            shutil.rmtree(os.path.join(self.job["ckpts"], f".partial-step_{step}"),
                          ignore_errors=True)  # fmt: skip
            self.skipped.append(step)
            return update(self.dir, skipped=self.skipped)
        say(f"step {step}: copied ({fetched} file(s) fetched, each verified); evaluating")
        code = self.evaluate(step)
        if code == 0 or self.result_since(step, started):  # a stop may come as it ends
            self.done.append(step)
            now = time.time()
            say(f"step {step}: evaluated in {now - started:.1f} s")
            stored = os.path.getmtime(os.path.join(self.job["results"], f"step_{step}.json"))
            self.lags[str(step)] = round(stored - landed, 1)
            return update(self.dir, done=self.done, lags=self.lags,
                          last={"step": step, "landed": landed, "scored": now})  # fmt: skip
        if self.stopping or code is None:
            return say(f"step {step}: stopped")
        say(f"step {step}: the evaluator failed (exit code {code}); not tried again")
        self.failed.append(step)
        update(self.dir, failed=self.failed)

    def bye(self):
        """The server told to end: this follower asks nothing more of it (asked again after a
        blip, ATTEMPTS times: else the server ends by its linger)."""
        for attempt in range(1, ATTEMPTS + 1):
            try:
                return self.server.get("/bye", method="POST")
            except (OSError, ValueError, Gone, http.client.HTTPException) as exc:
                if attempt == ATTEMPTS:
                    say(f"the checkpoint server was not told goodbye ({exc}); it ends by itself")
                else:
                    time.sleep(RETRY_S)
        return None

    def run(self):
        settled = set(self.skipped) | set(self.failed)
        while not self.stopping:
            listing = self.listing()
            if listing is None:
                break
            step = next_step(listing, self.job, settled | set(self.done))
            self.awaiting(step if step is not None else awaited(listing, self.job))
            if step is not None:
                with kept_alive(self.server, self.job.get("poll", 5)):
                    self.one(step, (listing.get("landed") or {}).get(str(step)) or time.time())
                settled |= set(self.skipped) | set(self.failed)
                continue
            if listing.get("ended"):
                self.bye()
                say(f"the run has ended ({listing.get('status')}) and its checkpoints are scored")
                return True
            time.sleep(self.job.get("poll", 5))
        return False


def main():
    job_dir = sys.argv[1]
    try:
        return follow(job_dir)
    finally:  # a resume whose token is gone gets a new server and token (runs/evaluation/continuous.py)
        token_file = read_json(os.path.join(job_dir, "job.json")).get("token_file")
        if token_file:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(token_file)


def follow(job_dir):
    follower = Follower(job_dir)
    signal.signal(signal.SIGTERM, follower.on_term)
    job = follower.job
    update(job_dir, status="running", pid=os.getpid(), pid_start=proc_start(os.getpid()),
           server=job["server"])  # fmt: skip
    say(f"following {job['run']} (every {job['every']} steps) at {follower.server.base}")
    try:
        ended = follower.run()
    except (OSError, ValueError) as exc:
        say(f"error: {exc}")
        follower.bye()
        return 1
    if not ended:
        follower.bye()  # a resume gets a server of its own (runs/evaluation/continuous.py)
        update(job_dir, status="stopped")
        return 0
    update(job_dir, status="finished", finished=time.time())
    return 1 if follower.failed else 0


sys.exit(main())
