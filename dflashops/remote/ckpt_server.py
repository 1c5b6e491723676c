"""Runs inside the training target in a tmux session of ours (stdlib only): the checkpoint
server a continuous eval's follower (remote/follow_eval.py, on the eval target) reads a run's
complete checkpoints from, over HTTP on the training target's own address.

argv: SERVE_DIR. Reads SERVE_DIR/serve.json, written by `dflashops eval --every`:
{"run_dir": the run's directory (node 0), "address": where to listen, "token_file": a 0600
JSON file {"token": ...} (never on a command line; deleted once read), "linger": seconds to stay once the run has
ended}. It listens on a free port of that address and writes SERVE_DIR/state.json
{"status": "running", "pid", "pid_start", "address", "port"}; what it says goes to
SERVE_DIR/console.log.

The token never travels: every request carries a fresh "X-Nonce" and "Authorization: DFO
HMAC-SHA256(TOKEN, 'request NONCE METHOD PATH')" (else 403; a nonce is good once), and every
answer to it "X-Proof: HMAC-SHA256(TOKEN, 'answer NONCE')": the follower trusts only a server
that holds the token. /manifest's answer carries "X-Sizes" ({name: bytes}), each file's bound. GET /list: {"ended": bool,
"status": the run's state.json status, "checkpoints": [step, ...] (complete checkpoints: a
step_N directory with its MANIFEST.sha256), "landed": {step: its manifest's mtime}}; a run directory gone (archived) has ended; GET /manifest?step=N: its MANIFEST.sha256; GET
/file?step=N&name=REL: one file the manifest lists (nothing else is ever served); POST /bye:
the follower is done, the server ends. It also ends on SIGTERM, and once the run has ended and
the follower asked nothing for `linger` seconds (a request without the token counts for
nothing). Each connection has a 60 s deadline; at most MAX_CONNECTIONS are open at once.
"""

import contextlib
import hashlib
import hmac
import http.server
import json
import os
import re
import signal
import sys
import threading
import time
import urllib.parse

from dflashops.remote.layout import CONSOLE_LOG, EXIT_CODE_FILE, MANIFEST, STATE_FILE
from dflashops.remote.manifest import manifest_entries, safe_name
from dflashops.remote.shared import proc_start, read_json, write_json

STEP_DIR = re.compile(r"^step_(\d+)\Z")
ENDED = ("finished", "stopped", "failed")
MAX_STEP_DIGITS = 18
MAX_CONNECTIONS = 16  # a follower uses two at a time; the rest are someone else's


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

    def sizes(self, step, text):
        """{name: bytes} of the files the manifest lists (the follower's bound on each)."""
        out = {}
        for name in manifest_entries(text) or {}:
            path = self.file(step, name)
            if path is not None:
                out[name] = os.path.getsize(path)
        return out

    def file(self, step, name):
        """The path of a file the step's manifest lists, inside its directory; else None."""
        text = self.manifest(step)
        entries = manifest_entries(text or "") or {}
        if name not in entries or not safe_name(name):
            return None
        base = os.path.realpath(os.path.join(self.root, f"step_{step}"))
        path = os.path.realpath(os.path.join(base, name))
        return path if path.startswith(base + os.sep) and os.path.isfile(path) else None


def sign(token, text):
    return hmac.new(token.encode(), text.encode(), hashlib.sha256).hexdigest()


def handler(run, token, seen, bye):
    used = set()

    class Handler(http.server.BaseHTTPRequestHandler):
        timeout = 60  # a deadline on every connection

        def log_message(self, *args):
            pass  # the URLs are no secret, but a console full of them helps nobody

        def allowed(self):
            nonce = self.headers.get("X-Nonce", "")
            given = self.headers.get("Authorization", "")
            want = "DFO " + sign(token, f"request {nonce} {self.command} {self.path}")
            fresh = 16 <= len(nonce) <= 64 and nonce not in used
            if fresh and hmac.compare_digest(given.encode(), want.encode()):
                used.add(nonce)  # a request overheard and sent again is refused
                seen[0] = time.monotonic()  # only the follower keeps the server up
                self.nonce = nonce
                return True
            self.nonce = None
            self.reply(403, b"not allowed\n", "text/plain")
            return False

        def proof(self):
            """The answer to an authenticated request's nonce: this server holds the token."""
            if self.nonce:
                self.send_header("X-Proof", sign(token, f"answer {self.nonce}"))

        def reply(self, code, body, kind="application/json", sizes=None):
            self.send_response(code)
            self.proof()
            if sizes is not None:
                self.send_header("X-Sizes", json.dumps(sizes, separators=(",", ":")))
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
                text = run.manifest(step)
                if text is None:
                    return self.reply(404, b"no such checkpoint\n", "text/plain")
                return self.reply(200, text.encode(), "text/plain", run.sizes(step, text))
            if url.path == "/file":
                return self.send_file(run.file(step, query.get("name", "")))
            self.reply(404, b"no such thing\n", "text/plain")

        def send_file(self, path):
            if path is None:
                return self.reply(404, b"not in that checkpoint's manifest\n", "text/plain")
            with open(path, "rb") as f:
                self.send_response(200)
                self.proof()
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


class Capped(http.server.ThreadingHTTPServer):
    """At most MAX_CONNECTIONS at once (one thread each); a connection past them is closed."""

    daemon_threads = True

    def __init__(self, *args):
        super().__init__(*args)
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

    def process_request(self, request, client_address):
        if not self.slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


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
    server = Capped((conf["address"], 0), handler(run, token, seen, bye))
    signal.signal(signal.SIGTERM, lambda *_: bye.set())
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
