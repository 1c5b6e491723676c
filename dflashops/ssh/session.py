"""What one command holds: the inventory, one SSH connection per host, machines, a thread pool."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import TypeVar

from dflashops.errors import OpsError, UsageError
from dflashops.inventory import Endpoint, Inventory, Target, parse_jump
from dflashops.ssh.config import resolve
from dflashops.ssh.connection import Connection
from dflashops.ssh.openssh import Configs
from dflashops.targets.base import DEFAULT_TIMEOUT_S, Machine

T = TypeVar("T")
R = TypeVar("R")


class Session:
    def __init__(
        self,
        inventory: Inventory,
        *,
        dry_run: bool = False,
        announce: Callable[[str], None] = print,
        timeout: float = DEFAULT_TIMEOUT_S,
        offline: bool = False,
    ) -> None:
        self.inventory = inventory
        self.dry_run = dry_run
        # --dry-run's reader: no connection is ever opened; a read of a remote target is
        # only said (stderr), and comes back empty, while a `local` target is still read
        self.offline = offline or dry_run
        self.announce = announce
        self.timeout = timeout  # seconds: the deadline of every remote call (Machine.run)
        self._connections: dict[Endpoint, Connection] = {}
        self._openssh = Configs()  # the OpenSSH client's private config, for bulk copies
        self._machines: dict[str, Machine] = {}
        self._lock = threading.Lock()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def connection(self, endpoint: Endpoint) -> Connection:
        """One connection per server: entries naming the same one (a Proxmox host that is also
        a `kind: ssh` target) share it."""
        key = replace(endpoint, name="", connect_timeout=0, max_sessions=0)
        with self._lock:
            conn = self._connections.get(key)
            if conn is None:
                conn = Connection(endpoint, self._jump, self.timeout, self._openssh)
                conn.offline = self.offline
                self._connections[key] = conn
            return conn

    def endpoint(self, spec: str) -> Endpoint:
        """A host of the inventory (or a kind: ssh target) by name, else an ~/.ssh/config
        alias or `[user@]host[:port]`, reached through the hops before it (`a,b,host`)."""
        try:
            hops = parse_jump(spec)
        except ValueError as exc:
            raise UsageError(f"{spec}: {exc}") from None
        *via, last = hops
        known = None
        if last.user is None and last.port is None:
            known = self.inventory.hosts.get(last.host) or next(
                (t.endpoint for t in self.inventory.targets.values()
                 if t.kind == "ssh" and t.name == last.host), None,
            )  # fmt: skip
        chain = ",".join(str(h) for h in via) or None
        if known is not None:
            return replace(known, jump=chain) if chain else known
        return Endpoint(
            name=str(last), address=last.host, user=last.user, port=last.port, jump=chain
        )

    def _jump(self, spec: str, origin: Endpoint) -> Connection:
        """The connection a host's ProxyJump goes through, refusing loops before any wait."""
        first = self.endpoint(spec)
        names, hop = [origin.name], first
        while hop is not None:
            names.append(hop.name)
            if hop == origin or hop.name in names[:-1]:
                raise UsageError(f"jump loop: {' -> '.join(names)}; fix 'jump' in hosts.yaml "
                                 "or ProxyJump in ~/.ssh/config")  # fmt: skip
            onward = resolve(hop).jump
            hop = self.endpoint(onward) if onward else None
        return self.connection(first)

    def machine(self, target: str | Target) -> Machine:
        if isinstance(target, str):
            target = self.inventory.target(target)
        with self._lock:
            found = self._machines.get(target.name)
        if found is not None:
            return found
        made = self._make(target)
        made.dry_run, made.announce, made.timeout = self.dry_run, self.announce, self.timeout
        if self.offline and not self.dry_run and target.kind != "local":
            made.dry_run, made.announce = True, _unread
        with self._lock:
            return self._machines.setdefault(target.name, made)

    def _make(self, target: Target) -> Machine:
        if target.kind == "local":
            from dflashops.targets.local import LocalMachine

            return LocalMachine(target)
        if target.kind == "ssh":
            from dflashops.targets.ssh import SshMachine

            return SshMachine(target, self.connection(target.endpoint))
        from dflashops.targets.pct import PctMachine

        return PctMachine(target, self.connection(target.endpoint))

    def host_machine(self, endpoint: Endpoint) -> Machine:
        """The Proxmox host itself (for `pct list` and the like), as a plain SSH machine."""
        from dflashops.targets.ssh import SshMachine

        target = Target(
            name=endpoint.name, kind="ssh", workspace="/", python="python3", endpoint=endpoint
        )
        made = SshMachine(target, self.connection(endpoint))
        made.dry_run, made.announce, made.timeout = self.dry_run, self.announce, self.timeout
        if self.offline and not self.dry_run:
            made.dry_run, made.announce = True, _unread
        return made

    def each(self, fn: Callable[[T], R], items: Iterable[T]) -> list[R | OpsError]:
        """`fn` over `items` in parallel (up to 32 threads); an OpsError is returned in place
        of its item's result. Every remote call has its deadline, so a target that does not
        answer comes back as NoAnswerError while the others' answers are kept. The threads
        are daemons: one still stuck (in a local call) never holds up the end of the command."""
        items = list(items)
        if len(items) <= 1:
            return [_guarded(fn, item) for item in items]
        results: list = [None] * len(items)
        failures: list[BaseException] = []
        slots = threading.Semaphore(32)

        def work(index: int, item: T) -> None:
            with slots:
                try:
                    results[index] = _guarded(fn, item)
                except BaseException as exc:  # noqa: BLE001 (a bug of ours: raised below)
                    failures.append(exc)

        threads = [
            threading.Thread(target=work, args=(i, item), daemon=True)
            for i, item in enumerate(items)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if failures:
            raise failures[0]
        return results

    def close(self) -> None:
        with self._lock:
            connections = list(self._connections.values())
            self._connections.clear()
        for conn in connections:
            conn.close()
        self._openssh.close()


def _unread(line: str) -> None:
    """A read an offline Session leaves undone: said on stderr (it needs the host)."""
    sys.stderr.write(f"dry run: not read (needs the host): {line}\n")
    sys.stderr.flush()


def _guarded(fn: Callable[[T], R], item: T) -> R | OpsError:
    try:
        return fn(item)
    except OpsError as exc:
        return exc
