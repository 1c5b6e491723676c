"""One lazily opened SSH connection per host, with strict host keys, ~/.ssh/config and ProxyJump."""

from __future__ import annotations

import errno
import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dflashops.errors import HostKeyError, OpsError, UnreachableError
from dflashops.inventory import Endpoint

if TYPE_CHECKING:
    import paramiko

KEEPALIVE_S = 15
WINDOW = 16 << 20
PACKET = 1 << 15


def load_paramiko():  # noqa: ANN201
    """Import paramiko without the `invoke` package it pulls in (a third of its import time,
    used only for `Match exec` in ~/.ssh/config, which then reports that invoke is missing)."""
    import sys

    with _IMPORT_LOCK:
        blocked = "invoke" not in sys.modules
        if blocked:
            sys.modules["invoke"] = None  # type: ignore[assignment]
        try:
            import paramiko
        finally:
            if blocked and sys.modules.get("invoke", 0) is None:
                del sys.modules["invoke"]
    return paramiko


_IMPORT_LOCK = threading.Lock()


def pinned_keys_file() -> Path:
    """Where `hosts trust` pins keys when a host names no known_hosts file of its own."""
    return Path.home() / ".config" / "dflashops" / "known_hosts"


@dataclass(frozen=True)
class Resolved:
    """An endpoint with ~/.ssh/config applied: what we really connect to."""

    endpoint: Endpoint
    hostname: str
    port: int
    user: str
    identities: tuple[str, ...]
    jump: str | None
    proxy_command: str | None

    @property
    def key_name(self) -> str:
        return self.hostname if self.port == 22 else f"[{self.hostname}]:{self.port}"

    @property
    def label(self) -> str:
        return f"{self.endpoint.name} ({self.user}@{self.hostname}:{self.port})"


def resolve(endpoint: Endpoint) -> Resolved:
    paramiko = load_paramiko()

    config_path = Path.home() / ".ssh" / "config"
    found: dict = {}
    if config_path.is_file():
        found = paramiko.SSHConfig.from_path(str(config_path)).lookup(endpoint.address)
    identities = (str(endpoint.identity),) if endpoint.identity else ()
    if not identities:
        identities = tuple(str(Path(p).expanduser()) for p in found.get("identityfile", []))
    port = endpoint.port
    if port == 22 and "port" in found:
        port = int(found["port"])
    user = endpoint.user
    if user == "root" and "user" in found:
        user = found["user"]
    return Resolved(
        endpoint=endpoint,
        hostname=found.get("hostname", endpoint.address),
        port=port,
        user=user,
        identities=identities,
        jump=endpoint.jump or found.get("proxyjump"),
        proxy_command=found.get("proxycommand"),
    )


def host_key_files(endpoint: Endpoint) -> list[Path]:
    files = [Path.home() / ".ssh" / "known_hosts", pinned_keys_file()]
    if endpoint.known_hosts:
        files.append(endpoint.known_hosts)
    return [f for f in files if f.is_file()]


def fingerprint(key: paramiko.PKey) -> str:
    return key.fingerprint  # "SHA256:..." as OpenSSH prints it


class _Refuse:
    """Missing-host-key policy: remember the key, accept nothing."""

    def __init__(self) -> None:
        self.seen: paramiko.PKey | None = None

    def missing_host_key(self, client, hostname, key) -> None:  # noqa: ANN001 (paramiko API)
        self.seen = key
        raise _UnknownKey(hostname, key)


class _UnknownKey(Exception):
    def __init__(self, hostname: str, key: paramiko.PKey) -> None:
        super().__init__(hostname)
        self.hostname = hostname
        self.key = key


class Connection:
    """A lazily opened SSH connection to one endpoint, shared by every call in a command."""

    def __init__(self, endpoint: Endpoint, lookup_jump) -> None:  # noqa: ANN001
        self.endpoint = endpoint
        self._lookup_jump = lookup_jump
        self._client: paramiko.SSHClient | None = None
        self._lock = threading.Lock()

    @property
    def resolved(self) -> Resolved:
        return resolve(self.endpoint)

    def transport(self) -> paramiko.Transport:
        with self._lock:
            if self._client is None:
                self._client = self._open()
            transport = self._client.get_transport()
            if transport is None or not transport.is_active():
                self._client = self._open()
                transport = self._client.get_transport()
            return transport

    def open_channel(self) -> paramiko.Channel:
        return self.transport().open_session(window_size=WINDOW, max_packet_size=PACKET)

    def _open(self) -> paramiko.SSHClient:
        paramiko = load_paramiko()

        _quiet_paramiko()

        target = self.resolved
        client = paramiko.SSHClient()
        for path in host_key_files(self.endpoint):
            client.load_host_keys(str(path))
        client.set_missing_host_key_policy(_Refuse())
        sock = self._socket(target)
        try:
            client.connect(
                target.hostname,
                port=target.port,
                username=target.user,
                key_filename=list(target.identities) or None,
                look_for_keys=not target.identities,
                allow_agent=True,
                timeout=self.endpoint.connect_timeout,
                banner_timeout=self.endpoint.connect_timeout,
                auth_timeout=self.endpoint.connect_timeout,
                sock=sock,
                transport_factory=_transport,
            )
        except _UnknownKey as exc:
            client.close()
            raise HostKeyError(
                f"{target.label}: host key not trusted ({exc.key.get_name()} {fingerprint(exc.key)});"
                f" check it, then pin it with `dflashops hosts trust {self.endpoint.name}`"
            ) from None
        except paramiko.BadHostKeyException as exc:
            client.close()
            raise HostKeyError(
                f"{target.label}: host key CHANGED (now {fingerprint(exc.key)}, pinned "
                f"{fingerprint(exc.expected_key)}): refusing to connect; if the host was really "
                f"reinstalled, remove the old key and run `dflashops hosts trust {self.endpoint.name}`"
            ) from None
        except paramiko.AuthenticationException:
            client.close()
            who = ", ".join(target.identities) or "ssh-agent and ~/.ssh keys"
            raise UnreachableError(
                f"{target.label}: authentication refused (tried {who}); "
                f"set 'identity' for {self.endpoint.name} in hosts.yaml"
            ) from None
        except (OSError, paramiko.SSHException, EOFError) as exc:
            client.close()
            raise UnreachableError(f"{target.label}: {_explain(exc, self.endpoint)}") from None
        client.get_transport().set_keepalive(KEEPALIVE_S)
        return client

    def _socket(self, target: Resolved):  # noqa: ANN202
        if target.jump:
            hop = self._lookup_jump(target.jump.split(",")[-1])
            try:
                return hop.transport().open_channel(
                    "direct-tcpip", (target.hostname, target.port), ("127.0.0.1", 0)
                )
            except OpsError:
                raise
            except Exception as exc:  # paramiko.ChannelException and friends
                raise UnreachableError(
                    f"{target.label}: jump host {target.jump} could not reach it: {exc}"
                ) from None
        if target.proxy_command:
            paramiko = load_paramiko()

            return paramiko.ProxyCommand(target.proxy_command)
        return self._dial(target)

    def _dial(self, target: Resolved) -> socket.socket:
        try:
            sock = socket.create_connection(
                (target.hostname, target.port), timeout=self.endpoint.connect_timeout
            )
        except OSError as exc:
            raise UnreachableError(f"{target.label}: {_explain(exc, self.endpoint)}") from None
        # SSH is request/response at start (key exchange, auth, each channel open): without
        # this, Nagle plus delayed ACKs add about 40 ms to many of those round trips.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def server_key(self) -> paramiko.PKey:
        """Fetch the host's key without authenticating (for `hosts trust`)."""
        paramiko = load_paramiko()

        target = self.resolved
        sock = self._socket(target)
        transport = paramiko.Transport(sock)
        try:
            transport.start_client(timeout=self.endpoint.connect_timeout)
            return transport.get_remote_server_key()
        except (OSError, paramiko.SSHException, EOFError) as exc:
            raise UnreachableError(f"{target.label}: {_explain(exc, self.endpoint)}") from None
        finally:
            transport.close()

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None


def _transport(sock, **kwargs):  # noqa: ANN001, ANN202
    """A transport that prefers AES-GCM: no separate MAC pass, much faster bulk copies."""
    paramiko = load_paramiko()

    transport = paramiko.Transport(sock, **kwargs)
    options = transport.get_security_options()
    gcm = tuple(c for c in options.ciphers if c.endswith("-gcm@openssh.com"))
    options.ciphers = gcm + tuple(c for c in options.ciphers if c not in gcm)
    return transport


def _quiet_paramiko() -> None:
    """paramiko logs failures that we report ourselves, in one line; keep its logger quiet."""
    import logging

    logger = logging.getLogger("paramiko")
    if not logger.handlers:
        logger.addHandler(logging.NullHandler())
        logger.propagate = False


def _explain(exc: BaseException, endpoint: Endpoint) -> str:
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return f"no answer within {endpoint.connect_timeout:g}s (host down or unreachable)"
    if isinstance(exc, socket.gaierror):
        return f"cannot resolve '{endpoint.address}'"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused (is sshd running on that port?)"
    if isinstance(exc, OSError) and exc.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
        return "host unreachable (no route to it)"
    if isinstance(exc, EOFError):
        return "the server closed the connection during the handshake"
    return str(exc) or type(exc).__name__
