"""One lazily opened SSH connection per host, with strict host keys, ~/.ssh/config and ProxyJump."""

from __future__ import annotations

import errno
import signal
import socket
import threading
from collections.abc import Callable
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
    """Apply ~/.ssh/config: what the inventory sets wins, then the config, then ssh's defaults."""
    paramiko = load_paramiko()

    config_path = Path.home() / ".ssh" / "config"
    found: dict = {}
    if config_path.is_file():
        found = paramiko.SSHConfig.from_path(str(config_path)).lookup(endpoint.address)
    identities = (str(endpoint.identity),) if endpoint.identity else ()
    if not identities:
        identities = tuple(str(Path(p).expanduser()) for p in found.get("identityfile", []))
    jump = endpoint.jump or found.get("proxyjump")
    if jump is not None and jump.strip().lower() == "none":
        jump = None
    proxy_command = found.get("proxycommand")
    if proxy_command is not None and proxy_command.strip().lower() == "none":
        proxy_command = None
    return Resolved(
        endpoint=endpoint,
        hostname=found.get("hostname", endpoint.address),
        port=endpoint.port or int(found.get("port", 22)),
        user=endpoint.user or found.get("user") or "root",
        identities=identities,
        jump=jump,
        proxy_command=proxy_command,
    )


def host_key_files(endpoint: Endpoint) -> list[Path]:
    files = [Path.home() / ".ssh" / "known_hosts", pinned_keys_file()]
    if endpoint.known_hosts:
        files.append(endpoint.known_hosts)
    return [f for f in files if f.is_file()]


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
    """A lazily opened SSH connection to one endpoint, shared by every call in a command.

    `lookup_jump(spec, origin)` gives the Connection of a ProxyJump spec's last hop. At most
    `endpoint.max_sessions` commands run on it at once: sshd refuses sessions past its
    MaxSessions (10 by default, as on Proxmox), so more wait for a free one.
    """

    def __init__(self, endpoint: Endpoint, lookup_jump) -> None:  # noqa: ANN001
        self.endpoint = endpoint
        self._lookup_jump = lookup_jump
        self._client: paramiko.SSHClient | None = None
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(endpoint.max_sessions)

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

    def open_channel(self) -> tuple[paramiko.Channel, Callable[[], None]]:
        """A session channel and the function that gives its slot back (call it once)."""
        self._slots.acquire()
        released = threading.Event()

        def release() -> None:
            if not released.is_set():
                released.set()
                self._slots.release()

        try:
            channel = self.transport().open_session(
                window_size=WINDOW,
                max_packet_size=PACKET,
                timeout=max(30.0, self.endpoint.connect_timeout),
            )
        except OpsError:
            release()
            raise
        except Exception as exc:  # paramiko.ChannelException, SSHException, EOFError
            release()
            raise UnreachableError(
                f"{self.resolved.label}: sshd refused a new session ({exc}); lower 'max_sessions' "
                f"for {self.endpoint.name} in hosts.yaml below sshd's MaxSessions"
            ) from None
        return channel, release

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
                f"{target.label}: host key not trusted ({exc.key.get_name()} {exc.key.fingerprint});"
                f" check it, then pin it with `dflashops hosts trust {self.endpoint.name}`"
            ) from None
        except paramiko.BadHostKeyException as exc:
            client.close()
            raise HostKeyError(
                f"{target.label}: host key CHANGED (now {exc.key.fingerprint}, pinned "
                f"{exc.expected_key.fingerprint}): refusing to connect; if the host was really "
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
            hop = self._lookup_jump(target.jump, self.endpoint)
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
        _detect_dead_peer(sock)
        return sock

    def server_key(self) -> paramiko.PKey:
        """Fetch the host's key without authenticating (for `hosts trust`)."""
        paramiko = load_paramiko()

        target = self.resolved
        sock = self._socket(target)
        try:
            transport = paramiko.Transport(sock)
        except Exception:
            sock.close()
            raise
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
    """A transport that prefers AES-GCM (no separate MAC pass: much faster bulk copies) and
    reports commands killed by a signal."""
    paramiko = load_paramiko()

    transport = paramiko.Transport(sock, **kwargs)
    handlers = dict(transport._channel_handler_table)
    handlers[paramiko.common.MSG_CHANNEL_REQUEST] = _channel_request
    transport._channel_handler_table = handlers
    options = transport.get_security_options()
    gcm = tuple(c for c in options.ciphers if c.endswith("-gcm@openssh.com"))
    options.ciphers = gcm + tuple(c for c in options.ciphers if c not in gcm)
    return transport


def _detect_dead_peer(sock: socket.socket) -> None:
    """A host that is powered off or cut off is noticed within about a minute, not the
    quarter of an hour TCP retransmissions take (paramiko's keepalive expects no reply)."""
    options = (
        (socket.SOL_SOCKET, "SO_KEEPALIVE", 1),
        (socket.IPPROTO_TCP, "TCP_KEEPIDLE", KEEPALIVE_S),
        (socket.IPPROTO_TCP, "TCP_KEEPINTVL", 5),
        (socket.IPPROTO_TCP, "TCP_KEEPCNT", 3),
        (socket.IPPROTO_TCP, "TCP_USER_TIMEOUT", 60_000),
    )
    for level, name, value in options:
        if hasattr(socket, name):
            sock.setsockopt(level, getattr(socket, name), value)


def _channel_request(channel: paramiko.Channel, m: paramiko.Message) -> None:
    """Channel requests as paramiko handles them, plus sshd's `exit-signal`, which paramiko
    drops (leaving the status at -1): a command killed by signal N exits 128+N, as in a shell."""
    paramiko = load_paramiko()

    start = m.packet.tell()
    if m.get_text() != "exit-signal":
        m.packet.seek(start)
        paramiko.Channel._handle_request(channel, m)
        return
    m.get_boolean()  # want_reply
    name = m.get_text()
    channel.exit_status = 128 + getattr(signal.Signals, f"SIG{name}", signal.SIGTERM).value
    channel.status_event.set()


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
