"""`kind: ssh` machines: commands run over the host's shared SSH connection."""

from __future__ import annotations

import shlex
import time
from typing import TYPE_CHECKING

from dflashops.errors import NoAnswerError, UnreachableError
from dflashops.targets.base import Machine, Process

if TYPE_CHECKING:
    from dflashops.inventory import Target
    from dflashops.ssh import Connection


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
        except Exception:
            self.kill()
            raise

    def write(self, data: bytes | memoryview) -> None:
        self.channel.sendall(bytes(data))  # paramiko takes bytes only

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
        if code < 0 and self.heartbeat is not None and self.heartbeat.dead:
            raise NoAnswerError(self.who, self.heartbeat.deadline)
        if code < 0:
            raise UnreachableError(
                f"{self.name}: the connection dropped before the command's exit status came"
            )
        return code

    def kill(self) -> None:
        self.channel.close()
        self._release()


class SshMachine(Machine):
    def __init__(self, target: Target, connection: Connection) -> None:
        super().__init__(target)
        self.connection = connection

    def wrap(self, argv: list[str], env: dict[str, str], cwd: str | None) -> list[str]:
        """PATH and the target's variables set; the login's HOME and USER kept."""
        return [*self.env_argv(env, cwd, base=(f"PATH={self.target.path}",)), *argv]

    def spawn(
        self, argv: list[str], env: dict[str, str], cwd: str | None, *, bulk: bool = False
    ) -> Process:
        command = shlex.join(self.wrap(argv, env, cwd))
        if bulk:
            process = self.connection.bulk_process(command, self.name)
            if process is not None:
                return process
        return ChannelProcess(self.connection, command, self.name)
