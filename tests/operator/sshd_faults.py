"""Faults of a bed host's sshd and of what stands between: a frozen sshd (SIGSTOP), a TCP relay
for a ProxyCommand, a python3 that hangs."""

from __future__ import annotations

import os
import signal
from contextlib import contextmanager
from pathlib import Path


def sshd_pids(host) -> list[int]:
    """The host's sshd: the listener and every per-connection sshd under it."""
    parents: dict[int, list[int]] = {}
    names: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        names[int(entry.name)] = name
        parents.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [host.sshd_pid]
    while todo:
        pid = todo.pop()
        if names.get(pid) == "sshd":
            found.append(pid)
            todo += parents.get(pid, [])
    return found


def freeze(host) -> list[int]:
    """SIGSTOP the host's whole sshd (connections stay open, nothing answers)."""
    pids = sshd_pids(host)
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    return pids


def thaw(pids: list[int]) -> None:
    for pid in pids:
        os.kill(pid, signal.SIGCONT)


@contextmanager
def frozen_sshd(host):
    pids = freeze(host)
    try:
        yield
    finally:
        thaw(pids)


RELAY = """\
import socket, sys, threading
sock = socket.create_connection((sys.argv[1], int(sys.argv[2])))
def up():
    while data := sys.stdin.buffer.read1(65536):
        sock.sendall(data)
threading.Thread(target=up, daemon=True).start()
while data := sock.recv(65536):
    sys.stdout.buffer.write(data)
    sys.stdout.buffer.flush()
"""


HUNG_PYTHON = '#!/bin/sh\nsleep 600\nexec /usr/bin/python3 "$@"\n'
