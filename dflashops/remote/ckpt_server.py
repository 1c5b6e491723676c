"""Runs inside the training target in a tmux session of ours (stdlib only): the checkpoint
server a continuous eval's follower (remote/follow_eval.py, on the eval target) reads a run's
complete checkpoints from, over HTTP on the training target's own address.

argv: SERVE_DIR. Reads SERVE_DIR/serve.json, written by `dflashops eval --every`:
{"run_dir": the run's directory (node 0), "address": where to listen, "token_file": a 0600
JSON file {"token": ...} (never on a command line; deleted once read), "linger": seconds to stay once the run has
ended}. It listens on a free port of that address and writes SERVE_DIR/state.json
{"status": "running", "pid", "pid_start", "address", "port"}; what it says goes to
SERVE_DIR/console.log.

The token never travels: every request and every answer is signed with it
(remote/ckpt_proof.py): a request is taken once, within WINDOW_S of this server's clock, and
its answer's status, time and body are under the token, a file's body under the digest its
manifest gives; anything else is refused with a 403 and a line. GET /list: {"ended": bool,
"status": the run's state.json status, "checkpoints": [step, ...] (complete checkpoints: a
step_N directory with its MANIFEST.sha256), "landed": {step: its manifest's mtime}}; a run
directory gone (archived) has ended; GET /manifest?step=N: {"manifest": its MANIFEST.sha256,
"sizes": {name: bytes}} (each file's bound); GET /file?step=N&name=REL: one file the manifest
lists (nothing else is ever served); POST /bye: the follower is done, the server ends. It also
ends on SIGTERM or SIGHUP, and once the run has ended and the follower asked nothing for
`linger` seconds (a request without the token counts for nothing). A connection has HEAD_S in
all to send a request that proves the token, and strangers' connections never take the
follower's slots (Door); then each read and write has a 60 s deadline.
"""

import contextlib
import hashlib
import http.server
import json
import os
import re
import signal
import socket
import sys
import threading
import time
import urllib.parse

from dflashops.remote.ckpt_proof import (
    HEX,
    WINDOW_S,
    answer_mac,
    request_mac,
    same_mac,
    stamp_of,
)
from dflashops.remote.layout import CONSOLE_LOG, EXIT_CODE_FILE, MANIFEST, STATE_FILE
from dflashops.remote.manifest import manifest_entries, safe_name
from dflashops.remote.shared import proc_start, read_json, write_json

STEP_DIR = re.compile(r"^step_(\d+)\Z")
ENDED = ("finished", "stopped", "failed")
MAX_STEP_DIGITS = 18
MAX_CONNECTIONS = 16  # proven connections at once: a follower uses two at a time
HALL = 32  # connections not yet proven at once (the oldest shut for a newcomer past them)
HEAD_S = 10  # seconds a connection has to send a request that proves the token


def step_number(text):
    """A step given in a request, or None: ASCII digits only (not "²"), and never so many
    that int() refuses them."""
    if not (text.isascii() and text.isdigit() and len(text) <= MAX_STEP_DIGITS):
        return None
    return int(text)


def say(text):
    stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    sys.stdout.write(f"[ckpt server] {stamp}: {text}\n")
    sys.stdout.flush()


class Run:
    def __init__(self, run_dir):
        self.dir = run_dir
        self.root = os.path.join(run_dir, "checkpoints")

    def ended(self):
        if not os.path.isdir(self.dir):  # archived or removed: it will write nothing more
            return True, "gone"
        status = read_json(os.path.join(self.dir, STATE_FILE)).get("status")
        return status in ENDED or os.path.exists(os.path.join(self.dir, EXIT_CODE_FILE)), status

    def steps(self):
        try:
            names = os.listdir(self.root)
        except OSError:
            return []
        found = [STEP_DIR.match(n) for n in names]
        return sorted(
            int(m.group(1))
            for m in found
            if m and os.path.isfile(os.path.join(self.root, m.group(0), MANIFEST))
        )

    def landed(self, step):
        """When the step's manifest was written: when it became complete."""
        try:
            return os.path.getmtime(os.path.join(self.root, f"step_{step}", MANIFEST))
        except OSError:
            return None

    def manifest(self, step):
        try:
            with open(os.path.join(self.root, f"step_{step}", MANIFEST), encoding="utf-8") as f:
                return f.read()
        except OSError:
            return None

    def manifest_doc(self, step):
        """{"manifest": its text, "sizes": {name: bytes} of the files it lists (the follower's
        bound on each)}; None when the step has no manifest."""
        text = self.manifest(step)
        if text is None:
            return None
        sizes = {}
        for name in manifest_entries(text) or {}:
            found = self.file(step, name)
            if found is not None:
                sizes[name] = os.path.getsize(found[0])
        return {"manifest": text, "sizes": sizes}

    def file(self, step, name):
        """(path, sha256) of a file the step's manifest lists, inside its directory; else None."""
        text = self.manifest(step)
        entries = manifest_entries(text or "") or {}
        if name not in entries or not safe_name(name):
            return None
        base = os.path.realpath(os.path.join(self.root, f"step_{step}"))
        path = os.path.realpath(os.path.join(base, name))
        inside = path.startswith(base + os.sep) and os.path.isfile(path)
        return (path, entries[name]) if inside else None


class Nonces:
    """The nonces taken within the time window, each checked and taken under one lock: of two
    threads with one request, one wins."""

    def __init__(self):
        self.lock = threading.Lock()
        self.taken = {}  # nonce: the time its request carried
        self.pruned = 0.0

    def take(self, nonce, stamp, now):
        with self.lock:
            if now - self.pruned > 60:  # what the window refuses anyway is forgotten
                self.taken = {n: s for n, s in self.taken.items() if s >= now - WINDOW_S}
                self.pruned = now
            if nonce in self.taken:
                return False
            self.taken[nonce] = stamp
            return True


def handler(run, token, seen, bye, nonces):
    class Handler(http.server.BaseHTTPRequestHandler):
        timeout = 60  # each read and write (the whole request must come within HEAD_S: Door)
        nonce = None  # the request's, once it proved it holds the token: its answer is signed

        def log_message(self, *args):
            pass  # the URLs are no secret, but a console full of them helps nobody

        def allowed(self):
            """Whether this is the follower's request, new and on time; else it is refused."""
            nonce, stamp = self.headers.get("X-Nonce", ""), self.headers.get("X-Time", "")
            scheme, _, given = self.headers.get("Authorization", "").partition(" ")
            if not (scheme == "DFO" and HEX.match(nonce) and stamp_of(stamp) is not None
                    and same_mac(given, request_mac(token, nonce, stamp, self.command,
                                                    self.path))):  # fmt: skip
                return self.refuse(b"not allowed\n")
            now = time.time()
            if abs(stamp_of(stamp) - now) > WINDOW_S:
                self.nonce = nonce  # signed: the follower learns this server's clock from it
                return self.refuse(b"out of the time window: this server's time is X-Time\n")
            if not nonces.take(nonce, stamp_of(stamp), now):
                return self.refuse(b"not allowed\n")  # a request overheard and sent again
            self.nonce = nonce
            if not self.server.admit(self.request):
                return self.refuse(b"busy; ask again\n", 503)
            seen[0] = time.monotonic()  # only the follower keeps the server up
            return True

        def refuse(self, text, code=403):
            self.reply(code, text, "text/plain")
            return False

        def signed(self, code, digest):
            """Status, time and body (its digest) under the token, for the request's nonce."""
            if self.nonce:
                stamp = str(int(time.time()))
                self.send_header("X-Time", stamp)
                self.send_header("X-Digest", digest)
                self.send_header("X-Proof", answer_mac(token, self.nonce, code, stamp, digest))

        def reply(self, code, body, kind="application/json"):
            self.send_response(code)
            self.signed(code, hashlib.sha256(body).hexdigest())
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if not self.allowed():
                return
            url = urllib.parse.urlsplit(self.path)
            query = dict(urllib.parse.parse_qsl(url.query))
            step = query.get("step", "")
            if url.path == "/list":
                ended, status = run.ended()
                steps = run.steps()
                doc = {"ended": ended, "status": status, "checkpoints": steps,
                       "landed": {str(s): run.landed(s) for s in steps}}  # fmt: skip
                return self.reply(200, json.dumps(doc).encode())
            step = step_number(step)
            if step is None:
                return self.reply(400, b"step: a number of ASCII digits\n", "text/plain")
            if url.path == "/manifest":
                doc = run.manifest_doc(step)
                if doc is None:
                    return self.reply(404, b"no such checkpoint\n", "text/plain")
                return self.reply(200, json.dumps(doc).encode())
            if url.path == "/file":
                return self.send_file(run.file(step, query.get("name", "")))
            self.reply(404, b"no such thing\n", "text/plain")

        def send_file(self, found):
            if found is None:
                return self.reply(404, b"not in that checkpoint's manifest\n", "text/plain")
            path, digest = found
            with open(path, "rb") as f:
                self.send_response(200)
                self.signed(200, digest)  # the body is what the manifest says it is
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(os.fstat(f.fileno()).st_size))
                self.end_headers()
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    self.wfile.write(chunk)

        def do_POST(self):
            if not self.allowed():
                return
            if urllib.parse.urlsplit(self.path).path != "/bye":
                return self.reply(404, b"no such thing\n", "text/plain")
            self.reply(200, b"{}")
            bye.set()

    return Handler


def shut(sock):
    """End a connection another thread serves: its reads end, its thread with them."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


class Door(http.server.ThreadingHTTPServer):
    """Who gets a thread. A connection that has not shown the token yet waits in the hall: at
    most HALL of them, each with HEAD_S in all to send its request (not per read), the oldest
    shut when a newcomer finds the hall full. One whose request proved the token takes one of
    MAX_CONNECTIONS slots: strangers never hold the follower's."""

    daemon_threads = True

    def __init__(self, *args):
        super().__init__(*args)
        self.lock = threading.Lock()
        self.hall = {}  # socket: when its time is up (monotonic), oldest first
        self.inside = set()
        threading.Thread(target=self.sweep, daemon=True).start()

    def process_request(self, request, client_address):
        with self.lock:
            if len(self.hall) >= HALL:
                oldest = next(iter(self.hall))
                del self.hall[oldest]
                shut(oldest)
            self.hall[request] = time.monotonic() + HEAD_S
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.leave(request)
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.leave(request)

    def admit(self, request):
        """A slot for a connection whose request proved the token; False when none is free
        (or its time in the hall was up meanwhile)."""
        with self.lock:
            if self.hall.pop(request, None) is None or len(self.inside) >= MAX_CONNECTIONS:
                return False
            self.inside.add(request)
            return True

    def leave(self, request):
        with self.lock:
            self.hall.pop(request, None)
            self.inside.discard(request)

    def sweep(self):
        while True:
            time.sleep(0.5)
            now = time.monotonic()
            with self.lock:
                for sock in [s for s, until in self.hall.items() if until < now]:
                    del self.hall[sock]
                    shut(sock)


def main():
    serve_dir = sys.argv[1]
    log = os.open(os.path.join(serve_dir, CONSOLE_LOG),
                  os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)  # fmt: skip
    os.dup2(log, 1)
    os.dup2(log, 2)
    conf = read_json(os.path.join(serve_dir, "serve.json"))
    token = read_json(conf["token_file"]).get("token")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(conf["token_file"])  # held in memory from here: no secret left at rest
    if not token:
        say(f"no token in {conf['token_file']}; not serving")
        return 2
    run, seen, bye = Run(conf["run_dir"]), [time.monotonic()], threading.Event()
    server = Door((conf["address"], 0), handler(run, token, seen, bye, Nonces()))
    for sig in (signal.SIGTERM, signal.SIGHUP):  # SIGHUP: its tmux session killed (a stop)
        signal.signal(sig, lambda *_: bye.set())
    port = server.server_address[1]
    write_json(os.path.join(serve_dir, STATE_FILE), {
        "status": "running", "pid": os.getpid(), "pid_start": proc_start(os.getpid()),
        "address": conf["address"], "port": port, "started": time.time()})  # fmt: skip
    say(f"serving the checkpoints of {run.dir} on {conf['address']}:{port}")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    linger = float(conf.get("linger", 600))
    while not bye.wait(5):
        if run.ended()[0] and time.monotonic() - seen[0] > linger:
            say(f"the run has ended and nothing was asked for {linger:.0f} s")
            break
    server.shutdown()
    state = read_json(os.path.join(serve_dir, STATE_FILE))
    write_json(os.path.join(serve_dir, STATE_FILE), {**state, "status": "finished",
                                                       "finished": time.time()})  # fmt: skip
    say("stopped" if bye.is_set() else "done")
    return 0


sys.exit(main())
