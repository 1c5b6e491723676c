"""Finding a dead server: an end-to-end keepalive that needs an answer, and TCP keepalive
on the socket we dial."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from dflashops.ssh.paramiko_lib import load_paramiko

if TYPE_CHECKING:
    import paramiko

KEEPALIVE_MAX_S = 15.0


class Heartbeat:
    """Asks the server for an answer every deadline/4 seconds (keepalive@openssh.com with
    want_reply, which sshd answers even when it does not know the request); when none has come
    for `deadline` seconds the connection is closed, which ends every call on it. It runs end
    to end, so it sees a dead server behind a jump host or a ProxyCommand too (TCP keepalive
    sees only the first hop, and paramiko's own keepalive asks for no answer)."""

    def __init__(self, transport: paramiko.Transport, deadline: float) -> None:
        paramiko = load_paramiko()

        self.transport = transport
        self.deadline = deadline
        self.interval = min(max(deadline / 4, 0.25), KEEPALIVE_MAX_S)
        self.answered = time.monotonic()
        self.dead = False
        self._stopped = threading.Event()
        self._message = paramiko.Message()
        self._message.add_byte(paramiko.common.cMSG_GLOBAL_REQUEST)
        self._message.add_string("keepalive@openssh.com")
        self._message.add_boolean(True)
        table = transport._handler_table
        for kind in (paramiko.common.MSG_REQUEST_SUCCESS, paramiko.common.MSG_REQUEST_FAILURE):
            table[kind] = self._hook(table[kind])
        for loop in (self._ask, self._watch):
            threading.Thread(target=loop, daemon=True, name="dflashops-keepalive").start()

    def _hook(self, handler: Callable) -> Callable:
        def answered(message: paramiko.Message) -> None:
            self.answered = time.monotonic()
            handler(message)

        return answered

    def _ask(self) -> None:
        """Sends on a thread of its own: a send may block (a full socket to a stopped peer)
        while the watcher still sees the time pass."""
        while not self._stopped.wait(self.interval):
            try:
                self.transport._send_user_message(self._message)
            except Exception:  # noqa: BLE001 (the connection is going; the watcher tells)
                return

    def _watch(self) -> None:
        while not self._stopped.wait(min(self.interval, 0.5)):
            if not self.transport.is_active():
                return
            if time.monotonic() - self.answered > self.deadline:
                self.dead = True
                self.transport.close()
                return

    def stop(self) -> None:
        self._stopped.set()


def detect_dead_peer(sock: socket.socket) -> None:
    """TCP keepalive as well: a host that is powered off is noticed even between calls."""
    options = (
        (socket.SOL_SOCKET, "SO_KEEPALIVE", 1),
        (socket.IPPROTO_TCP, "TCP_KEEPIDLE", 15),
        (socket.IPPROTO_TCP, "TCP_KEEPINTVL", 5),
        (socket.IPPROTO_TCP, "TCP_KEEPCNT", 3),
        (socket.IPPROTO_TCP, "TCP_USER_TIMEOUT", 60_000),
    )
    for level, name, value in options:
        if hasattr(socket, name):
            sock.setsockopt(level, getattr(socket, name), value)
