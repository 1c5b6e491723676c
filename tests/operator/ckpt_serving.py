"""The checkpoint server (remote/ckpt_server.py) and the follower (remote/follow_eval.py) run
as the real programs on loopback, for the tests of what a neighbour on the bridge can do to
them (test_ckpt_server.py, test_faults.py)."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from dflashops.remote.ckpt_proof import request_mac

REPO = Path(__file__).resolve().parents[2]
TOKEN = "t0k"
STAND_IN_EVALUATOR = """\
#!/usr/bin/python3
import json, sys
if "workload.eval" in sys.argv:
    out = sys.argv[sys.argv.index("--out") + 1]
    json.dump({"step": 0, "tau": 1.5}, open(out, "w"))
"""


def wait_for(what: str, check, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.3)
    raise AssertionError(f"not within {timeout:.0f} s: {what}")


SKEWED = """\
import runpy, sys, time
real, skew = time.time, float(sys.argv.pop(1))
time.time = lambda: real() + skew
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@contextlib.contextmanager
def serving(
    run: Path, where: Path, linger: float, skew: float = 0
) -> Iterator[tuple[str, Path, subprocess.Popen]]:
    """The checkpoint server of `run` (token TOKEN) in `where`, its clock `skew` seconds off
    ours (the target's clock set wrong); (base URL, serve dir, process)."""
    serve = where / "serve"
    serve.mkdir()
    token_file = where / "token.json"
    token_file.write_text(json.dumps({"token": TOKEN}))
    conf = {"run_dir": str(run), "address": "127.0.0.1", "token_file": str(token_file),
            "linger": linger}  # fmt: skip
    (serve / "serve.json").write_text(json.dumps(conf))
    server = REPO / "dflashops" / "remote" / "ckpt_server.py"
    skewed = ["-c", SKEWED, str(skew)] if skew else []
    proc = subprocess.Popen([sys.executable, *skewed, str(server), str(serve)], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
    try:
        state = wait_for("the port", lambda: json.loads((serve / "state.json").read_text())
                         if (serve / "state.json").exists() else None, 20)  # fmt: skip
        yield f"http://127.0.0.1:{state['port']}", serve, proc
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def signed(
    url: str, token: str = TOKEN, method: str = "GET", stamp: int | None = None
) -> urllib.request.Request:
    """A request as the follower signs it (remote/ckpt_proof.py): the token never sent."""
    nonce = secrets.token_hex(16)
    target = "/" + url.split("/", 3)[3]
    when = str(int(time.time()) if stamp is None else stamp)
    mac = request_mac(token, nonce, when, method, target)
    return urllib.request.Request(url, method=method, headers={
        "X-Nonce": nonce, "X-Time": when, "Authorization": f"DFO {mac}"})  # fmt: skip


def status_of(request: urllib.request.Request) -> int:
    """The answer's status; 0 when none came (refused, or reset as the server shuts down)."""
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def ask(url: str, token: str = TOKEN) -> int:
    return status_of(signed(url, token))


def follower_job(ws: Path, where: Path, run: str, port: int, token: str = TOKEN) -> Path:
    """A continuous eval's job directory as `eval --every 10` writes it, its server at
    127.0.0.1:port, its evaluator a stand-in that writes a result."""
    evaluator = where / "evalpy"
    evaluator.write_text(STAND_IN_EVALUATOR)
    evaluator.chmod(0o755)
    token_file = where / "follow-token.json"
    token_file.write_text(json.dumps({"token": token}))
    job = where / "job"
    job.mkdir()
    plan = {"run": run, "every": 10, "server": {"address": "127.0.0.1", "port": port},
            "token_file": str(token_file), "argv": [str(evaluator), "-m", "workload.eval"],
            "ckpts": str(ws / "ckpts" / run), "results": str(ws / "evals" / run),
            "lock": str(ws / "evals" / ".evaluating"), "poll": 1}  # fmt: skip
    (job / "job.json").write_text(json.dumps(plan))
    (ws / "evals" / run).mkdir(parents=True, exist_ok=True)
    return job


def start_follower(job: Path) -> subprocess.Popen:
    """The follower program on `job`, its output piped."""
    follower = REPO / "dflashops" / "remote" / "follow_eval.py"
    return subprocess.Popen([sys.executable, str(follower), str(job)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip


def follow(job: Path, timeout: float) -> subprocess.CompletedProcess:
    """The follower program on `job`, to its end (returncode None: still trying at `timeout`)."""
    proc = start_follower(job)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        return subprocess.CompletedProcess(proc.args, None, out, err)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
