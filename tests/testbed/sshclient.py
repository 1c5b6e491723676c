"""paramiko helpers for tests: pinned host keys, RejectPolicy, both streams read at once."""

from __future__ import annotations

import contextlib
import shlex
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import paramiko

if TYPE_CHECKING:
    from .bed import TestBed
    from .host import Host

CHUNK = 1 << 20


@dataclass
class SSHResult:
    rc: int
    stdout: bytes
    stderr: bytes


def connect(
    bed: TestBed, host: Host, *, known_hosts: Path | None = None, timeout: float = 10
) -> paramiko.SSHClient:
    """root@host with the bed's client key; host keys only from `known_hosts` (default: the
    bed's), unknown ones refused."""
    client = paramiko.SSHClient()
    client.load_host_keys(str(known_hosts or bed.known_hosts_path))
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    client.connect(
        host.address,
        port=host.port,
        username="root",
        key_filename=str(bed.client_key),
        look_for_keys=False,
        allow_agent=False,
        timeout=timeout,
    )
    return client


def run(
    client: paramiko.SSHClient,
    command: str | list[str],
    *,
    stdin: bytes | Path | None = None,
    timeout: float = 120,
) -> SSHResult:
    """exec `command` (an argv is joined with shlex.join: the one quoting layer), feed stdin,
    collect stdout and stderr concurrently, return the exit status."""
    if not isinstance(command, str):
        command = shlex.join(command)
    chan = client.get_transport().open_session()
    chan.settimeout(timeout)
    chan.exec_command(command)
    out: list[bytes] = []
    err: list[bytes] = []
    readers = [
        threading.Thread(target=_drain, args=(chan.recv, out), daemon=True),
        threading.Thread(target=_drain, args=(chan.recv_stderr, err), daemon=True),
    ]
    for reader in readers:
        reader.start()
    # OSError: the remote command closed its stdin early; its exit status tells the rest
    with contextlib.suppress(OSError):
        _feed(chan, stdin)
    chan.shutdown_write()
    for reader in readers:
        reader.join(timeout)
    rc = chan.recv_exit_status()
    chan.close()
    return SSHResult(rc, b"".join(out), b"".join(err))


def _drain(recv, sink: list[bytes]) -> None:
    while data := recv(CHUNK):
        sink.append(data)


def _feed(chan: paramiko.Channel, stdin: bytes | Path | None) -> None:
    if stdin is None:
        return
    if isinstance(stdin, (bytes, bytearray, memoryview)):
        view = memoryview(stdin)
        for start in range(0, len(view), CHUNK):
            chan.sendall(view[start : start + CHUNK])
        return
    with open(stdin, "rb") as fh:
        while chunk := fh.read(CHUNK):
            chan.sendall(chunk)
