"""Machines reached over the host's shared SSH connection, and `kind: ssh` machines."""

from __future__ import annotations

import shlex
from typing import TYPE_CHECKING

from dflashops.ssh.channel import ChannelProcess
from dflashops.targets.base import Machine, Process

if TYPE_CHECKING:
    from dflashops.inventory import Target
    from dflashops.ssh.connection import Connection


class OverSsh(Machine):
    """A machine whose commands start over an SSH connection (a `kind: ssh` one, a container
    on a Proxmox host): each `wrap`ped argv as one shell string, for the login shell there,
    on a session channel; bulk streams through the OpenSSH client where it can be used."""

    def __init__(self, target: Target, connection: Connection) -> None:
        super().__init__(target)
        self.connection = connection

    def spawn(
        self, argv: list[str], env: dict[str, str], cwd: str | None, *, bulk: bool = False
    ) -> Process:
        command = shlex.join(self.wrap(argv, env, cwd))
        if bulk:
            process = self.connection.bulk_process(command, self.name)
            if process is not None:
                return process
        return ChannelProcess(self.connection, command, self.name)


class SshMachine(OverSsh):
    def wrap(self, argv: list[str], env: dict[str, str], cwd: str | None) -> list[str]:
        """PATH and the target's variables set; the login's HOME and USER kept."""
        return [*self.env_argv(env, cwd, base=(f"PATH={self.target.path}",)), *argv]
