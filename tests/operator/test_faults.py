"""Failure paths of issue 24 on the `local` target: real tmux, real processes, the real command
line. The evaluator is a stand-in interpreter (no torch here) that writes a result and exits."""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from dflashops.remote.ckpt_proof import answer_mac
from tests.operator.ckpt_serving import (
    REPO,
    STAND_IN_EVALUATOR,
    ask,
    follow,
    follower_job,
    serving,
    signed,
    wait_for,
)
from tests.operator.cli import Ran, dflashops
from tests.operator.rundirs import make_run
from tests.operator.test_failure_paths import Here, manifest_holds, one_line

RUN = "f-run"


@pytest.fixture
def ws(tmp_path) -> Path:
    return tmp_path / "ws"


@pytest.fixture
def tmux_dir(tmp_path):
    """A private tmux server for the test (TMUX_TMPDIR), killed afterwards."""
    path = tmp_path / "tmux"
    path.mkdir()
    yield path
    env = {**os.environ, "TMUX_TMPDIR": str(path)}
    for server in (["-L", "dflashops"], []):
        subprocess.run(["tmux", *server, "kill-server"], env=env, capture_output=True)


@pytest.fixture
def inventory(tmp_path, ws, tmux_dir) -> Path:
    python = tmp_path / "evalpy"
    python.write_text(STAND_IN_EVALUATOR)
    python.chmod(0o755)
    path = tmp_path / "hosts.yaml"
    env = json.dumps({"TMUX_TMPDIR": str(tmux_dir)})
    path.write_text(
        "version: 1\ntargets:\n"
        f"  local: {{kind: local, workspace: {ws}, python: {python}, env: {env}}}\n"
    )
    return path


@pytest.fixture
def cli(inventory):
    def run(*args: str, **kw) -> Ran:
        env = {"DFLASHOPS_CKPT_LINGER_S": "30", **kw.pop("env", {})}
        return dflashops(*args, inventory=inventory, env=env, **kw)

    return run


def ended_run(ws: Path, tmp_path: Path) -> Path:
    """A finished training run with two complete checkpoints, and what its eval names."""
    run = make_run(ws, RUN, ckpts=(10, 20))
    model = tmp_path / "target-model"
    model.mkdir()
    (run / "run.yaml").write_text(f"target: {{path: {model}}}\noptim: {{max_steps: 20}}\n")
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "hi"}\n')
    return run


def follow_state(ws: Path) -> dict:
    jobs = list((ws / "evals" / RUN / "follow").glob("*/state.json"))
    return json.loads(jobs[0].read_text()) if jobs else {}


def test_a_continuous_eval_on_the_runs_own_target_scores_and_leaves_no_token(cli, ws, tmp_path):
    """Item 2 (the server's and the follower's tokens one path) and item 9 (token files kept)."""
    ended_run(ws, tmp_path)
    ran = cli("eval", RUN, "--every", "10", "--on", "local",
              "--prompts", str(tmp_path / "prompts.jsonl"))  # fmt: skip
    assert ran.code == 0, ran.err
    wait_for("the follower finished", lambda: follow_state(ws).get("status") == "finished")
    assert follow_state(ws).get("done") == [10, 20]
    assert sorted(p.name for p in (ws / "evals" / RUN).glob("step_*.json")) == [
        "step_10.json",
        "step_20.json",
    ]
    secrets = ws / "dflashops" / "secrets"
    wait_for("no token file left", lambda: not list(secrets.glob("ckpt-*")), 30)
    serve = next((ws / "evals" / RUN / "serve").glob("*"))
    assert (serve / "console.log").stat().st_mode & 0o777 == 0o600


# ---------------------------------------------------------------- item 7: real causes


@pytest.fixture
def here(tmp_path):
    bed = Here(tmp_path)
    yield bed
    bed.close()


@pytest.fixture
def small_archive_disk(here):
    """The workspace's archive/ on a 1 MiB filesystem of its own: too small for the run."""
    mount = here.ws / "archive"
    mount.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], check=True)
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


def test_an_archive_onto_a_full_disk_names_the_full_disk(here, small_archive_disk):
    run = make_run(here.ws, "full7", ckpts=(10,))
    (run / "checkpoints" / "step_10" / "big.bin").write_bytes(os.urandom(3 << 20))
    ran = here.cli("archive", "full7")
    assert ran.code == 1, ran.out
    line = one_line(ran)
    assert "No space left on device" in line and "not there" not in line, line
    assert (run / "checkpoints" / "step_10" / "big.bin").stat().st_size == 3 << 20
    assert not list(small_archive_disk.iterdir())  # no temporary left on the full disk
    assert json.loads(here.cli("--json", "status", "full7").out)["state"] == "finished"


# ---------------------------------------------------------------- item 8: hostile inputs


def deep_yaml(levels: int) -> str:
    return "version: 1\ntargets: " + "[" * levels + "]" * levels + "\n"


@pytest.mark.parametrize(
    ("what", "text", "said"),
    [
        ("deep", deep_yaml(3000), "nested"),
        ("latin1", "version: 1\n# caf\xe9\n", "not UTF-8"),
    ],
)
def test_a_hostile_inventory_or_config_is_one_line_exit_2(here, tmp_path, what, text, said):
    bad = tmp_path / f"{what}.yaml"
    bad.write_bytes(text.encode("latin-1"))
    ran = dflashops("--inventory", str(bad), "status", home=tmp_path)
    assert ran.code == 2 and said in one_line(ran) and str(bad) in ran.err, ran.err
    ran = here.cli("launch", "cfg8", "--host", "local", "--config", str(bad))
    assert ran.code == 2 and said in one_line(ran) and str(bad) in ran.err, ran.err
    assert not (here.ws / "runs" / "cfg8").exists()


def test_a_trailing_newline_is_not_part_of_a_name_or_key(here):
    ran = here.launch("n8\n")
    assert ran.code == 2 and "run name" in one_line(ran), ran.err
    assert not (here.ws / "runs").exists() or not list((here.ws / "runs").iterdir())
    ran = here.launch("k8", "--set", "a\n.b=1")
    assert ran.code == 2, ran.err
    assert not (here.ws / "runs" / "k8").exists()


def test_watch_survives_a_nul_in_state_json_and_refuses_a_bad_interval(here, tmp_path):
    records = [{"step": s, "time": 1000 + s, "loss": 1.0, "acc": 0.5} for s in (10, 20, 30)]
    run = make_run(here.ws, "nul8", records)
    state = json.loads((run / "state.json").read_text())
    (run / "state.json").write_text(json.dumps({**state, "wandb_url": "https://w/x\0y"}))
    seen = tmp_path / "alert.env"
    hook = tmp_path / "hook"
    hook.write_text(f"#!/bin/sh\nenv > {seen}\n")
    hook.chmod(0o755)
    ran = here.cli("watch", "nul8", "--stall", "2", "--metric", "acc", "--once",
                   "--on-alert", str(hook))  # fmt: skip
    assert ran.code == 0 and "internal error" not in ran.err, ran.err
    assert "DFLASHOPS_ALERT_WANDB_URL=https://w/x\\0y" in seen.read_text()
    for bad in ("inf", "0", "-5", "nan"):
        ran = here.cli("watch", "nul8", "--stall", "2", f"--interval={bad}")
        assert ran.code == 2 and "--interval" in one_line(ran), (bad, ran.err)


def test_datagen_input_nested_deep_or_with_a_huge_line_is_file_line_exit_2(tmp_path):
    good = b'{"messages": [{"role": "user", "content": "hi"}]}\n'
    cases = {
        "deep": (good + b"[" * 100_000 + b"]" * 100_000 + b"\n", ":2: JSON nested too deeply"),
        "huge": (good + b'{"messages": "' + b"a" * (17 << 20) + b'"}\n', ":2: a line longer"),
    }
    for name, (data, said) in cases.items():
        path = tmp_path / f"{name}.jsonl"
        path.write_bytes(data)
        ran = subprocess.run(
            [sys.executable, "-m", "workload.datagen", "--check-only", "--prompts", str(path)],
            capture_output=True, text=True, timeout=120, cwd=REPO,
        )  # fmt: skip
        lines = ran.stderr.strip().splitlines()
        assert ran.returncode == 2 and len(lines) == 1, ran.stderr[-500:]
        assert f"{path}{said}" in lines[0], lines


def test_status_all_shows_an_escape_sequence_in_a_name_safely(here):
    make_run(here.ws, "\x1b[2J\x1b[31mevil")
    make_run(here.ws, "fine8")
    ran = here.cli("status", "--all")
    assert ran.code == 0, ran.err
    assert "\x1b" not in ran.out and "fine8" in ran.out and "[2J" in ran.out, ran.out


def test_datagen_collect_of_a_training_run_is_refused_as_the_wrong_kind(here):
    make_run(here.ws, "train8", ckpts=(10,))
    ran = here.cli("datagen", "train8", "--collect")
    assert ran.code == 2 and "not a datagen job" in one_line(ran), ran.err
    assert (here.ws / "runs" / "train8" / "checkpoints" / "step_10").is_dir()


def test_the_checkpoint_server_answers_a_bad_step_with_a_4xx_and_no_traceback(ws, tmp_path):
    run = make_run(ws, RUN, ckpts=(10,))
    with serving(run, tmp_path, linger=60) as (base, serve, _proc):
        for step in ("\u00b2", "9" * 5000, "-1"):
            for path in ("/manifest", "/file"):
                url = f"{base}{path}?" + urllib.parse.urlencode({"step": step, "name": "x"})
                assert 400 <= ask(url) < 500, (step, path)
        assert "Traceback" not in (serve / "console.log").read_text()
        assert not (tmp_path / "token.json").exists()  # item 9: the server holds it in memory only


# ---------------------------------------------------------------- item 10: the lease


def test_a_long_start_keeps_its_claim_against_a_second_launch(here, tmp_path):
    """The launch's check (the memory plan here; datagen's input check the same way) takes
    12 s, four times the claim's lease (3 s): the lease is renewed meanwhile, so a second
    launch of the name, made then, is refused instead of sweeping the first one's claim."""
    slow = tmp_path / "slow-python"
    slow.write_text(
        f'#!/bin/sh\ncase " $* " in *" workload.plan "*) sleep 12 ;; esac\n'
        f'exec {here.root / "stand-in"} "$@"\n'
    )
    slow.chmod(0o755)
    here.inventory.write_text(
        "version: 1\ntargets:\n  local: {kind: local, workspace: "
        f"{here.ws}, python: {slow}, env: {json.dumps({'TMUX_TMPDIR': str(here.tmux)})}}}\n"
    )
    env = {**os.environ, "HOME": str(here.root), "DFLASHOPS_LEASE_S": "3"}
    argv = [sys.executable, "-m", "dflashops.cli", "--inventory", str(here.inventory), "launch",
            "lease10", "--host", "local", "--config", str(here.config)]  # fmt: skip
    first = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env=env, text=True)  # fmt: skip
    state = here.ws / "runs" / "lease10" / "state.json"
    try:
        wait_for("the first launch's claim", lambda: state.exists()
                 and json.loads(state.read_text()).get("status") == "launching", 60)  # fmt: skip
        time.sleep(6)  # twice the lease, the first launch still in its check
        until = json.loads(state.read_text())["hold"]["until"]
        assert until > time.time(), "the lease was not renewed"
        second = here.cli("launch", "lease10", "--host", "local", "--config", str(here.config),
                          env={"DFLASHOPS_LEASE_S": "3"})  # fmt: skip
        assert second.code == 2 and "taken" in one_line(second), second.err
        out, err = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, err
    assert json.loads(state.read_text())["run_id"]  # the first launch's run, not swept
    assert here.cli("stop", "lease10", "--kill").code == 0


# ---------------------------------------------------------------- item 3: servers left listening


def test_a_stopped_follower_takes_its_server_down_and_a_resume_replaces_an_older_one(
    cli, ws, tmp_path
):
    """The run still trains (so no linger applies): before, its server listened on for ever.
    Issue 35: the follower is written anew at a resume; a server still up from an older
    dflashops speaks another protocol, so it is replaced (before, the two never agreed)."""
    run = ended_run(ws, tmp_path)
    state = json.loads((run / "state.json").read_text())
    (run / "state.json").write_text(json.dumps({**state, "status": "running", "exit_code": None}))
    ran = cli("eval", RUN, "--every", "10", "--on", "local",
              "--prompts", str(tmp_path / "prompts.jsonl"))  # fmt: skip
    assert ran.code == 0, ran.err
    wait_for("steps 10 and 20 scored", lambda: follow_state(ws).get("done") == [10, 20])
    (job,) = (ws / "evals" / RUN / "follow").glob("*")
    os.kill(follow_state(ws)["pid"], signal.SIGKILL)  # gone without a goodbye: the server stays
    wait_for("the follower gone", lambda: follow_state(ws).get("status") != "running", 30)
    old = ws / "evals" / RUN / "serve" / job.name
    program = old / "ckpt_server.py"
    program.write_text(program.read_text() + "# as an older dflashops wrote it\n")
    name = f"follow-{RUN}-{job.name}"
    resumed = cli("resume", name)
    assert resumed.code == 0, resumed.err
    assert "ran an older program (another protocol); started again" in resumed.err, resumed.err
    serve_id = json.loads((job / "job.json").read_text())["serve_id"]
    wait_for("the follower asking the new server", lambda: follow_state(ws).get("status")
             == "running" and follow_state(ws).get("server") is not None, 30)  # fmt: skip
    time.sleep(2)  # a few listings: none refused
    assert "not proven" not in (job / "console.log").read_text()
    assert cli("stop", name).code == 0
    for where in (old, ws / "evals" / RUN / "serve" / serve_id):
        wait_for(f"{where.name} gone", lambda w=where: json.loads((w / "state.json").read_text())
                 .get("status") == "finished", 20)  # fmt: skip
    assert not list((ws / "dflashops" / "secrets").glob("ckpt-*"))


@pytest.fixture
def served(ws, tmp_path):
    """The checkpoint server of a finished run, linger 8 s; yields (base URL, serve dir, run)."""
    run = make_run(ws, RUN, ckpts=(10,))
    with serving(run, tmp_path, linger=8) as (base, serve, proc):
        yield base, serve, run, proc


def test_requests_without_the_token_do_not_keep_the_server_up(served):
    base, serve, _run, proc = served
    started = time.monotonic()
    while proc.poll() is None and time.monotonic() - started < 20:
        assert ask(f"{base}/list", token="guess") in (403, 0)
        time.sleep(0.5)
    assert proc.poll() == 0, "still listening 20 s into an 8 s linger"


def test_an_archived_run_is_ended_for_its_server_and_connections_are_capped(served):
    base, serve, run, proc = served
    archived = run.parent.parent / "archive" / RUN
    archived.parent.mkdir(parents=True)
    run.rename(archived)
    listing = urllib.request.urlopen(signed(f"{base}/list"), timeout=10)
    assert json.loads(listing.read())["ended"] is True
    held = []
    for _ in range(40):  # idle connections: at most the hall's get a thread (issue 35 item 6)
        held.append(socket.create_connection(("127.0.0.1", int(base.rsplit(":", 1)[1]))))
    time.sleep(1)
    threads = len(os.listdir(f"/proc/{proc.pid}/task"))
    asked = ask(f"{base}/list")  # the follower's request still gets in
    for conn in held:
        conn.close()
    assert threads <= 32 + 4 and asked == 200, (threads, asked)
    proc.wait(timeout=30)  # its linger passes: it ends


# ---------------------------------------------------------------- item 4: blips during a copy


class Blips(http.server.ThreadingHTTPServer):
    """A checkpoint server (the follower's side of its protocol) whose first two copies of a
    file fail: one body cut short, one connection reset."""

    daemon_threads = True

    def __init__(self, step_dir: Path) -> None:
        super().__init__(("127.0.0.1", 0), BlipHandler)
        self.step_dir, self.faults, self.forged, self.grow = step_dir, ["short", "reset"], False, 0


class BlipHandler(http.server.BaseHTTPRequestHandler):
    server: Blips

    def log_message(self, *args) -> None:
        pass

    def head(self, code: int, digest: str, length: int) -> None:
        """Status and headers, signed as the server holding the token "t" signs them (a
        forged one cannot: its proof is not even ASCII, issue 35 item 9)."""
        self.send_response(code)
        nonce, stamp = self.headers.get("X-Nonce", ""), str(int(time.time()))
        proof = answer_mac("t", nonce, code, stamp, digest)
        self.send_header("X-Time", stamp)
        self.send_header("X-Digest", digest)
        self.send_header("X-Proof", "\u00e9" * 64 if self.server.forged else proof)
        self.send_header("Content-Length", str(length))
        self.end_headers()

    def reply(self, body: bytes, code: int = 200) -> None:
        self.head(code, hashlib.sha256(body).hexdigest(), len(body))
        self.wfile.write(body)

    def do_POST(self) -> None:
        self.reply(b"{}")

    def do_GET(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        query = dict(urllib.parse.parse_qsl(url.query))
        if url.path == "/list":
            return self.reply(json.dumps({"ended": True, "status": "finished",
                                          "checkpoints": [10], "landed": {}}).encode())  # fmt: skip
        step_dir = self.server.step_dir
        if url.path == "/manifest":
            sizes = {p.name: p.stat().st_size for p in step_dir.iterdir()}
            text = (step_dir / "MANIFEST.sha256").read_text()
            return self.reply(json.dumps({"manifest": text, "sizes": sizes}).encode())
        real = (step_dir / query["name"]).read_bytes()
        body = real + b"x" * self.server.grow
        fault = self.server.faults.pop(0) if query["name"] == "model.safetensors" and \
            self.server.faults else None  # fmt: skip
        if fault == "gone":
            return self.reply(b"gone\n", 404)
        if fault == "reset":
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                       struct.pack("ii", 1, 0))  # fmt: skip
            self.connection.close()
            return
        self.head(200, hashlib.sha256(real).hexdigest(), len(body))
        if fault == "short":
            self.wfile.write(body[: len(body) // 2])
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        self.wfile.write(body)


def run_follower(
    ws: Path, tmp_path: Path, faults: list[str], timeout: float = 120, **fake: Any
) -> tuple[Path, Path, Any]:
    """The follower program against a Blips server of the faults given, to its end."""
    run = make_run(ws, RUN, ckpts=(10,))
    step_dir = run / "checkpoints" / "step_10"
    server = Blips(step_dir)
    server.faults = faults
    for key, value in fake.items():
        setattr(server, key, value)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    job = follower_job(ws, tmp_path, RUN, server.server_address[1], token="t")
    try:
        ran = follow(job, timeout)
    finally:
        server.shutdown()
    return job, step_dir, ran


def test_a_follower_survives_a_short_body_and_a_reset_during_a_copy(ws, tmp_path):
    job, step_dir, ran = run_follower(ws, tmp_path, ["short", "reset"])
    state = json.loads((job / "state.json").read_text())
    assert ran.returncode == 0 and state["done"] == [10], ran.stdout[-2000:] + ran.stderr[-2000:]
    copy = ws / "ckpts" / RUN / "step_10" / "model.safetensors"
    assert copy.read_bytes() == (step_dir / "model.safetensors").read_bytes()
    assert ran.stdout.count("trying again") == 2, ran.stdout


# ---------------------------------------------------------------- item 6: the eval target's copies


def with_optimizer_state(step_dir: Path) -> None:
    (step_dir / "training_state.pt").write_bytes(os.urandom(50_000))
    (step_dir / "optimizer").mkdir()
    (step_dir / "optimizer" / "rank_0.pt").write_bytes(os.urandom(20_000))
    names = ["config.json", "model.safetensors", "training_state.pt", "optimizer/rank_0.pt"]
    (step_dir / "MANIFEST.sha256").write_text("".join(
        f"{hashlib.sha256((step_dir / n).read_bytes()).hexdigest()}  {n}\n" for n in names))  # fmt: skip


def test_the_eval_target_keeps_the_scored_weights_not_the_optimizer_state(cli, ws, tmp_path):
    run = ended_run(ws, tmp_path)
    for step in (10, 20):
        with_optimizer_state(run / "checkpoints" / f"step_{step}")
    ran = cli("eval", RUN, "--every", "10", "--on", "local",
              "--prompts", str(tmp_path / "prompts.jsonl"))  # fmt: skip
    assert ran.code == 0, ran.err
    wait_for("the follower finished", lambda: follow_state(ws).get("status") == "finished")
    copies = ws / "ckpts" / RUN
    assert sorted(p.name for p in copies.iterdir() if p.is_dir()) == ["step_10", "step_20"]
    for step in (10, 20):
        kept = copies / f"step_{step}"
        assert sorted(p.name for p in kept.iterdir()) == [
            "MANIFEST.sha256", "config.json", "model.safetensors"]  # fmt: skip
        assert (kept / "model.safetensors").read_bytes() == (
            run / "checkpoints" / f"step_{step}" / "model.safetensors").read_bytes()  # fmt: skip
        assert manifest_holds(kept)  # the copy's manifest lists what is kept


def test_a_step_gone_during_its_copy_leaves_no_partial_copy(ws, tmp_path):
    job, _step_dir, ran = run_follower(ws, tmp_path, ["gone"])
    state = json.loads((job / "state.json").read_text())
    assert ran.returncode == 0 and state["skipped"] == [10], ran.stdout[-2000:]
    assert not list((ws / "ckpts" / RUN).glob(".partial-*"))


# ---------------------------------------------------------------- item 5: whom the follower trusts


def test_a_forged_server_and_an_oversized_file_are_refused(ws, tmp_path):
    job, _step_dir, ran = run_follower(ws, tmp_path, [], timeout=6, forged=True)
    assert "without proving it holds the token" in ran.stdout, ran.stdout[-2000:]
    assert "Traceback" not in ran.stdout + ran.stderr, ran.stderr[-2000:]  # a non-ASCII proof
    assert not (ws / "ckpts" / RUN / "step_10").exists()
    import shutil

    shutil.rmtree(ws)
    (tmp_path / "again").mkdir()
    job, _step_dir, ran = run_follower(ws, tmp_path / "again", [], grow=5 << 20)
    assert ran.returncode == 1 and "more than its" in ran.stdout, ran.stdout[-2000:]
    partial = ws / "ckpts" / RUN / ".partial-step_10"
    assert sum(p.stat().st_size for p in partial.rglob("*") if p.is_file()) < 1 << 20
