"""Proxmox containers: `pct exec VMID -- env -i ... ARGV` over the host's SSH connection.

pct forces PATH=/sbin:/bin:/usr/sbin:/usr/bin and, with its default --keep-env, leaks the
host's environment into the container; `env -i` replaces both with the target's own.
The argv is joined with exactly one quoting layer, for the host's login shell.
"""

from __future__ import annotations

import re
from functools import cached_property

from dflashops.errors import NotFoundError, OpsError, UnreachableError
from dflashops.targets.base import Result
from dflashops.targets.ssh import OverSsh

PCT_ERROR = 255
NO_PCT = re.compile(r"pct: (command )?not found")


class PctMachine(OverSsh):
    def wrap(self, argv: list[str], env: dict[str, str], cwd: str | None) -> list[str]:
        vmid = str(self.target.vmid)
        base = (f"PATH={self.target.path}", "HOME=/root", "LANG=C.UTF-8", "USER=root")
        return ["pct", "exec", vmid, "--", *self.env_argv(env, cwd, base=base, clear=True), *argv]

    @cached_property
    def _not_running(self) -> re.Pattern:
        vmid = self.target.vmid
        return re.compile(rf"^(container '{vmid}' not running!|CT {vmid} not running)")

    @cached_property
    def _no_config(self) -> re.Pattern:
        return re.compile(
            rf"^Configuration file '[^']*/lxc/{self.target.vmid}\.conf' does not exist"
        )

    def is_way_in_error(self, line: bytes) -> bool:
        text = line.decode("utf-8", "replace")
        return any(p.search(text) for p in (self._not_running, self._no_config, NO_PCT))

    def check(self, result: Result) -> None:
        if result.returncode == 0:
            return
        last = result.error_text
        where = f"{self.target.name}: CT {self.target.vmid} on {self.target.host}"
        if result.returncode == 127 and NO_PCT.search(last):
            raise OpsError(f"{where}: the host has no `pct` command; is it a Proxmox VE node?")
        if result.returncode != PCT_ERROR:
            return
        if self._no_config.search(last):
            raise NotFoundError(
                f"{where} does not exist (pct: {last}); check the vmid in hosts.yaml "
                f"against `pct list` on {self.target.host}"
            )
        if self._not_running.search(last):
            raise UnreachableError(
                f"{where} is stopped; start it with `pct start {self.target.vmid}` on "
                f"{self.target.host}"
            )
