"""A fork server for the tests' `dflashops` calls: one per test process, started by
tests/operator/cli.py. It imports the operator's package once, then forks one child per call;
the child takes the call's stdin, stdout and stderr (passed as file descriptors), environment,
working directory and argv, and runs the command line as `python -m dflashops.cli` would, to a
normal interpreter exit (atexit, threads joined, buffers flushed). What a call saves is the
interpreter's start and the imports: about half a second of CPU each, over several hundred calls.

Protocol, one unix-socket connection per call: the client sends one JSON line {argv, env, cwd}
with its three descriptors (SCM_RIGHTS); the server answers {"pid": N} once the child runs and
{"status": WAITSTATUS} when it is gone. The server ends when its stdin (a pipe from the test
process) closes. It stays single-threaded, so every fork is of one thread.
"""

from __future__ import annotations

import array
import contextlib
import importlib
import json
import os
import pkgutil
import selectors
import socket
import sys
import threading
from dataclasses import dataclass

FDS = 3  # stdin, stdout, stderr


@dataclass
class Call:
    argv: list[str]
    env: dict[str, str]
    cwd: str


def preload() -> None:
    """Import what a command imports, without running anything: every module stays fresh."""
    import dflashops
    import dflashops.cli  # noqa: F401
    from dflashops.ssh.paramiko_lib import load_paramiko

    load_paramiko()  # as the operator imports it (without invoke)
    for info in pkgutil.walk_packages(dflashops.__path__, "dflashops."):
        if info.name.startswith("dflashops.remote."):
            continue  # programs for a target: they run when imported
        with contextlib.suppress(Exception):  # one that fails here is left to the child
            importlib.import_module(info.name)
    if threading.active_count() != 1:
        raise SystemExit("cli_server: an import started a thread; forking would not be safe")


def receive(conn: socket.socket) -> tuple[Call, list[int]]:
    data, fds = b"", []
    while not data.endswith(b"\n"):
        msg, ancdata, _, _ = conn.recvmsg(1 << 20, socket.CMSG_SPACE(FDS * 4))
        if not msg:
            raise EOFError
        data += msg
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                got = array.array("i")
                got.frombytes(payload[: len(payload) - len(payload) % got.itemsize])
                fds += list(got)
    raw = json.loads(data)
    return Call(raw["argv"], raw["env"], raw["cwd"]), fds


def serve(listener: socket.socket) -> tuple[Call, list[int]] | None:
    """Answer calls until stdin closes (None); in a forked child, return its call."""
    sel = selectors.DefaultSelector()
    sel.register(sys.stdin.fileno(), selectors.EVENT_READ, "stdin")
    sel.register(listener, selectors.EVENT_READ, "accept")
    while True:
        for key, _ in sel.select():
            if key.data == "stdin":
                if not os.read(key.fd, 4096):
                    return None
            elif key.data == "accept":
                conn, _ = listener.accept()
                try:
                    call, fds = receive(conn)
                except (EOFError, OSError, ValueError):
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    for other in list(sel.get_map().values()):
                        if isinstance(other.data, tuple):  # another call's pidfd and socket
                            os.close(other.fd)
                            other.data[1].close()
                    sel.close()
                    listener.close()
                    conn.close()
                    return call, fds
                for fd in fds:
                    os.close(fd)
                conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
                sel.register(os.pidfd_open(pid), selectors.EVENT_READ, (pid, conn))
            else:
                pid, conn = key.data
                sel.unregister(key.fd)
                os.close(key.fd)
                _, status = os.waitpid(pid, 0)
                with contextlib.suppress(OSError):  # the test process gave up on it (a timeout)
                    conn.sendall(json.dumps({"status": status}).encode() + b"\n")
                conn.close()


def run(call: Call, fds: list[int]) -> None:
    """In the child: become `python -m dflashops.cli ARGV` with the call's files and
    environment; its SystemExit ends this interpreter as it would have ended that one."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(call.cwd)
    os.environ.clear()
    os.environ.update(call.env)
    sys.path[0] = call.cwd
    sys.argv = ["dflashops", *call.argv]
    from dflashops.cli import main

    main()


if __name__ == "__main__":
    preload()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(sys.argv[1])
        server.listen(64)
        print("ready", flush=True)
        got = serve(server)
    if got is not None:
        run(*got)
