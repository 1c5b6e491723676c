"""Run the real `dflashops` command line in a process of its own, as a user would: to its end
(`dflashops`), or in the background (`start`, then `finished`).

`dflashops` forks each call from a server that has the package imported (cli_server.py): the
same program in a new process with the call's argv, environment, working directory and files,
without the interpreter's start and imports. DFLASHOPS_TEST_CLI=exec runs each call as
`python -m dflashops.cli` instead; `start` always does (its process is sent signals)."""

from __future__ import annotations

import array
import atexit
import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def as_at_a_terminal() -> None:
    """preexec_fn for a process a test presses Ctrl-C in: SIGINT's disposition is the default,
    as in a terminal's foreground job, even where this run inherited it ignored (started as a
    background job, or under nohup), which the started process would otherwise inherit too."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@dataclass
class Ran:
    code: int
    out: str
    err: str


def dflashops(
    *args: str,
    inventory: Path | None = None,
    cwd: Path | None = None,
    home: Path | None = None,
    stdin: bytes | None = None,
    timeout: float = 120,
    env: dict[str, str] | None = None,
) -> Ran:
    full = [sys.executable, "-m", "dflashops.cli"]
    if inventory is not None:
        full += ["--inventory", str(inventory)]
    environ = dict(os.environ)
    environ.pop("DFLASHOPS_INVENTORY", None)
    if home is not None:
        environ["HOME"] = str(home)
    environ.update(env or {})
    if _forks.can_run(environ, cwd):
        return _forks.call([*full[3:], *args], environ, cwd, stdin or b"", timeout)
    proc = subprocess.run(
        [*full, *args],
        input=stdin if stdin is not None else b"",
        capture_output=True,
        cwd=cwd,
        env=environ,
        timeout=timeout,
    )
    return Ran(
        proc.returncode, proc.stdout.decode(errors="replace"), proc.stderr.decode(errors="replace")
    )


class _Forks:
    """The client of this test process's cli_server (started on first use, one per process)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._server: subprocess.Popen | None = None
        self._socket = ""
        self._python_env = _python_env(os.environ)

    def can_run(self, env: dict[str, str], cwd: Path | None) -> bool:
        """Whether a fork of the server runs as `python -m dflashops.cli` would: not where the
        call sets PYTHON* variables of its own (the interpreter reads them as it starts), nor
        where its working directory has a `dflashops` of its own (`-m` would import that)."""
        return (
            os.environ.get("DFLASHOPS_TEST_CLI") != "exec"
            and _python_env(env) == self._python_env
            and _imports_ours(Path(cwd or os.getcwd()))
        )

    def _address(self) -> str:
        with self._lock:
            if self._server is None or self._server.poll() is not None:
                folder = tempfile.mkdtemp(prefix="dflashops-cli-")
                atexit.register(shutil.rmtree, folder, True)
                self._socket = os.path.join(folder, "s")
                with open(os.path.join(folder, "log"), "wb") as log:
                    self._server = subprocess.Popen(
                        [sys.executable, "-m", "tests.operator.cli_server", self._socket],
                        cwd=ROOT,
                        stdin=subprocess.PIPE,  # its lifeline: closed when this process ends
                        stdout=subprocess.PIPE,
                        stderr=log,
                        env={**_others(os.environ), **self._python_env},
                    )
                if self._server.stdout.readline() != b"ready\n":
                    raise RuntimeError(
                        "cli_server did not start: DFLASHOPS_TEST_CLI=exec to bypass"
                    )
            return self._socket

    def call(
        self, argv: list[str], env: dict[str, str], cwd: Path | None, stdin: bytes, timeout: float
    ) -> Ran:
        with tempfile.TemporaryFile() as given:
            given.write(stdin)
            given.seek(0)
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                conn.connect(self._address())
                header = json.dumps({"argv": argv, "env": env, "cwd": str(cwd or os.getcwd())})
                fds = array.array("i", [given.fileno(), out_w, err_w])
                conn.sendmsg(
                    [header.encode() + b"\n"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)]
                )
            finally:
                os.close(out_w)
                os.close(err_w)
            return self._collect(conn, out_r, err_r, argv, timeout)

    def _collect(
        self, conn: socket.socket, out_r: int, err_r: int, argv: list[str], timeout: float
    ) -> Ran:
        """What subprocess.run(capture_output=True, timeout=...) gives: both outputs to their
        end, then the exit code; past the timeout the process is killed, TimeoutExpired."""
        deadline = time.monotonic() + timeout
        control = conn.fileno()
        got = {out_r: bytearray(), err_r: bytearray(), control: bytearray()}
        sel = selectors.DefaultSelector()
        for fd in got:
            sel.register(fd, selectors.EVENT_READ)
        pid = None
        try:
            while sel.get_map():
                left = deadline - time.monotonic()
                if left <= 0:
                    if pid is not None:
                        os.kill(pid, signal.SIGKILL)
                    raise subprocess.TimeoutExpired(argv, timeout)
                for key, _ in sel.select(min(left, 1.0)):
                    chunk = os.read(key.fd, 1 << 16)
                    if chunk:
                        got[key.fd] += chunk
                    else:
                        sel.unregister(key.fd)
                    if key.fd == control and pid is None and b"\n" in got[control]:
                        pid = json.loads(got[control].split(b"\n")[0])["pid"]
        finally:
            sel.close()
            os.close(out_r)
            os.close(err_r)
            conn.close()
        answers = [json.loads(line) for line in got[control].splitlines() if line]
        if len(answers) != 2:
            raise RuntimeError(f"cli_server gave no exit status for {argv}")
        code = os.waitstatus_to_exitcode(answers[1]["status"])
        return Ran(code, got[out_r].decode(errors="replace"), got[err_r].decode(errors="replace"))


def _imports_ours(cwd: Path) -> bool:
    own = cwd / "dflashops"
    return not own.exists() or own.resolve() == (ROOT / "dflashops").resolve()


def _python_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith("PYTHON")}


def _others(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if not k.startswith("PYTHON")}


_forks = _Forks()


def start(
    *args: str, inventory: Path, home: Path, env: dict[str, str] | None = None
) -> subprocess.Popen:
    """`dflashops ARGS...` started in the background, as a user's second terminal would."""
    env = {**os.environ, "HOME": str(home), **(env or {})}
    env.pop("DFLASHOPS_INVENTORY", None)
    argv = [sys.executable, "-m", "dflashops.cli", "--inventory", str(inventory), *args]
    return subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        preexec_fn=as_at_a_terminal,  # some are sent Ctrl-C
    )


def finished(proc: subprocess.Popen, timeout: float = 120) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")
