"""A remote command on its own session channel of a shared connection."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from dflashops.errors import UnreachableError

if TYPE_CHECKING:
    from dflashops.ssh.connection import Connection

CLOSE_WAIT_S = 2.0


class ChannelProcess:
    """A remote command on its own session channel of the shared connection; `who` names
    the target in errors."""

    def __init__(self, connection: Connection, command: str, who: str) -> None:
        self.name = connection.endpoint.name
        self.who = who
        self.channel, self._release = connection.open_channel()
        self.heartbeat = connection.heartbeat
        try:
            self.channel.exec_command(command)
        except Exception as exc:  # paramiko's SSHException("Channel closed."), EOFError, OSError
            self.kill()
            raise self._lost(exc) from None

    def write(self, data: bytes | memoryview) -> None:
        self.channel.sendall(bytes(data))  # paramiko takes bytes only

    def stdin_pipe(self) -> None:
        return None  # paramiko encrypts in Python: the bytes go through `write`

    def close_stdin(self) -> None:
        if not self.channel.closed:
            self.channel.shutdown_write()

    def read_stdout(self, size: int) -> bytes:
        return self.channel.recv(size)

    def read_stderr(self, size: int) -> bytes:
        return self.channel.recv_stderr(size)

    def wait(self, timeout: float | None = None) -> int | None:
        if not self.channel.status_event.wait(timeout):
            return None
        code = self.channel.exit_status
        # sshd counts a session against MaxSessions until it has closed it too: give the slot
        # back only then, or a burst of commands trips over sessions still being torn down.
        deadline = time.monotonic() + CLOSE_WAIT_S
        while not self.channel.closed and time.monotonic() < deadline:
            time.sleep(0.002)
        self.kill()
        if code < 0:
            raise self._lost(None)
        return code

    def _lost(self, exc: Exception | None) -> UnreachableError:
        """The connection went away under the command: the keepalive's verdict when it closed
        it (a retry may succeed), else the drop itself."""
        if self.heartbeat is not None and self.heartbeat.dead:
            return self.heartbeat.error(self.who)
        if exc is None:
            return UnreachableError(
                f"{self.name}: the connection dropped before the command's exit status came"
            )
        why = str(exc) or type(exc).__name__
        return UnreachableError(
            f"{self.name}: the connection dropped as the command started ({why})"
        )

    def kill(self) -> None:
        self.channel.close()
        self._release()
