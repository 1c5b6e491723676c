"""Finding a dead server: an end-to-end keepalive that needs an answer, and TCP keepalive
on the socket we dial.

Liveness of a connection is not progress of a command: a server that has sent nothing for
`limit(deadline)` seconds (the command's deadline, at most LOST_AFTER_S) is gone, however
long the command itself may stay quiet. The OpenSSH client is told the same (`openssh_alive`).
"""

from __future__ import annotations

import socket
import threading
import time
from typing import TYPE_CHECKING

from dflashops.errors import ConnectionLostError, NoAnswerError
from dflashops.ssh.paramiko_lib import load_paramiko

if TYPE_CHECKING:
    import paramiko

KEEPALIVE_INTERVAL_S = 5  # at most this long between two keepalives to a silent server
KEEPALIVE_MISSED_MAX = 3  # this many unanswered, then one interval more: the server is gone
LOST_AFTER_S = KEEPALIVE_INTERVAL_S * (KEEPALIVE_MISSED_MAX + 1)


def limit(deadline: float) -> float:
    """Seconds a server may send nothing before its connection counts as lost."""
    return min(deadline, LOST_AFTER_S)


def openssh_alive(deadline: float) -> tuple[int, int]:
    """(ServerAliveInterval, ServerAliveCountMax) for the OpenSSH client: it gives up after
    interval x (count + 1) seconds without a word from the server, about `limit(deadline)`."""
    seconds = limit(deadline)
    interval = max(1, int(seconds // (KEEPALIVE_MISSED_MAX + 1)))
    return interval, max(1, round(seconds / interval) - 1)


def lost(who: str, deadline: float) -> NoAnswerError:
    """The error for a connection whose server went silent: the command's deadline when that
    is what ran out, else the keepalive's own, shorter limit."""
    seconds = limit(deadline)
    return ConnectionLostError(who, seconds) if seconds < deadline else NoAnswerError(who, deadline)


class Heartbeat:
    """Asks the server for an answer every limit/4 seconds (at most KEEPALIVE_INTERVAL_S:
    keepalive@openssh.com with want_reply, which sshd answers even when it does not know the
    request); once nothing at all (no answer, no data) has come for `limit(deadline)` seconds
    the connection is closed, which ends every call on it. It runs end to end, so it sees a
    dead server behind a jump host or a ProxyCommand too (TCP keepalive sees only the first
    hop, and paramiko's own keepalive asks for no answer). Any packet counts as life: on a
    slow link a busy copy's answers may queue behind megabytes of its data."""

    def __init__(self, transport: paramiko.Transport, deadline: float) -> None:
        paramiko = load_paramiko()

        self.transport = transport
        self.deadline = deadline
        self.limit = limit(deadline)
        self.interval = min(max(self.limit / 4, 0.25), KEEPALIVE_INTERVAL_S)
        self.heard = time.monotonic()
        self.dead = False
        self._stopped = threading.Event()
        self._message = paramiko.Message()
        self._message.add_byte(paramiko.common.cMSG_GLOBAL_REQUEST)
        self._message.add_string("keepalive@openssh.com")
        self._message.add_boolean(True)
        self._listen(transport.packetizer)
        for loop in (self._ask, self._watch):
            threading.Thread(target=loop, daemon=True, name="dflashops-keepalive").start()

    def error(self, who: str) -> NoAnswerError:
        """What a call on the connection the keepalive closed fails with."""
        return lost(who, self.deadline)

    def _listen(self, packetizer) -> None:  # noqa: ANN001 (paramiko.Packetizer)
        """Note the time of every packet the transport reads."""
        read = packetizer.read_message

        def heard():  # noqa: ANN202
            message = read()
            self.heard = time.monotonic()
            return message

        packetizer.read_message = heard

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
            if time.monotonic() - self.heard > self.limit:
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
