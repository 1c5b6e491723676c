"""One lazily opened SSH connection per host: strict host keys, the ssh configuration as
OpenSSH reads it (dflashops.ssh.config), ProxyJump, and a keepalive that needs an answer."""

from __future__ import annotations

import errno
import shlex
import signal
import socket
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from dflashops.errors import HostKeyError, NoAnswerError, OpsError, UnreachableError
from dflashops.inventory import Endpoint
from dflashops.ssh.config import Resolved, client, resolve
from dflashops.ssh.keepalive import Heartbeat, detect_dead_peer
from dflashops.ssh.keys import log_in
from dflashops.ssh.known_hosts import (
    CHANGED,
    REVOKED,
    TRUSTED,
    KnownHosts,
    host_key_files,
    preferred_key_types,
)
from dflashops.ssh.openssh import Configs, OpenSshProcess
from dflashops.ssh.paramiko_lib import load_paramiko, quiet_paramiko

if TYPE_CHECKING:
    import paramiko

WINDOW = 16 << 20
PACKET = 1 << 15


class Connection:
    """A lazily opened SSH connection to one endpoint, shared by every call in a command.

    `lookup_jump(spec, origin)` gives the Connection of a ProxyJump spec's last hop. At most
    `endpoint.max_sessions` commands run on it at once: sshd refuses sessions past its
    MaxSessions (10 by default, as on Proxmox), so more wait for a free one. `deadline` (s):
    the command's; a channel open unanswered that long fails, and a server silent for that
    long (at most keepalive.LOST_AFTER_S) counts as dead (NoAnswerError for every call on it).
    """

    def __init__(
        self,
        endpoint: Endpoint,
        lookup_jump,  # noqa: ANN001
        deadline: float = 30.0,
        openssh: Configs | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.deadline = deadline
        self._lookup_jump = lookup_jump
        self._openssh = openssh
        self._transport: paramiko.Transport | None = None
        self.heartbeat: Heartbeat | None = None
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(endpoint.max_sessions)
        self.typed_passphrase = False  # a key unlocked by a typed passphrase was used
        self.offline = False  # --dry-run: opening it is a bug of ours, refused

    @property
    def openssh(self) -> Configs | None:
        """The private config of the OpenSSH client for this command (None: not to be used)."""
        return self._openssh

    @property
    def resolved(self) -> Resolved:
        return resolve(self.endpoint)

    @property
    def connect_timeout(self) -> float:
        return min(self.endpoint.connect_timeout, self.deadline)

    def transport(self) -> paramiko.Transport:
        with self._lock:
            if self._transport is None or not self._transport.is_active():
                self._stop_heartbeat()
                self._transport = self._open()
                self.heartbeat = Heartbeat(self._transport, self.deadline)
            return self._transport

    def jump_connection(self) -> Connection:
        """The connection to the last hop of this one's jump chain."""
        return self._lookup_jump(self.resolved.jump, self.endpoint)

    def bulk_process(self, command: str, who: str) -> OpenSshProcess | None:
        """`command` run by the OpenSSH client (bulk copies), or None where that client is not
        installed or a key needed a typed passphrase (a client in batch mode could not use it).
        The paramiko connection checks host keys and logins, and reports them, the one way; the
        client starts its own handshake meanwhile (against the same pinned keys, in batch mode)
        and is killed, unused, when that check fails."""
        if self._openssh is None or client() is None:
            return None
        process = OpenSshProcess(self._openssh.argv(self, command), who, self.deadline)
        try:
            self.transport()
            if self._typed_passphrase_on_the_way():
                process.discard()
                return None
        except BaseException:
            process.discard()
            raise
        return process

    def _typed_passphrase_on_the_way(self) -> bool:
        hop: Connection | None = self
        while hop is not None:
            if hop.typed_passphrase:
                return True
            hop = hop.jump_connection() if hop.resolved.jump else None
        return False

    def dead(self) -> bool:
        """Whether the keepalive found the server gone (calls then fail with NoAnswerError)."""
        beat = self.heartbeat
        return beat is not None and beat.dead

    def open_channel(self) -> tuple[paramiko.Channel, Callable[[], None]]:
        """A session channel and the function that gives its slot back (call it once)."""
        self._slots.acquire()
        released = threading.Event()

        def release() -> None:
            if not released.is_set():
                released.set()
                self._slots.release()

        try:
            transport = self.transport()
        except BaseException:
            release()
            raise
        try:
            channel = transport.open_session(
                window_size=WINDOW, max_packet_size=PACKET, timeout=self.deadline
            )
        except Exception as exc:  # paramiko.ChannelException, SSHException, EOFError
            release()
            raise self._refused_session(exc) from None
        return channel, release

    def _refused_session(self, exc: Exception) -> OpsError:
        if self.dead():
            return self.heartbeat.error(self.endpoint.name)
        if "Timeout opening channel" in str(exc):
            return NoAnswerError(self.endpoint.name, self.deadline)
        return UnreachableError(
            f"{self.resolved.label}: sshd refused a new session ({exc}); lower 'max_sessions' "
            f"for {self.endpoint.name} in hosts.yaml below sshd's MaxSessions"
        )

    def _open(self) -> paramiko.Transport:
        if self.offline:
            raise OpsError(f"{self.endpoint.name}: --dry-run opens no connection")
        paramiko = load_paramiko()
        quiet_paramiko()
        target = self.resolved
        known = KnownHosts.load(host_key_files(target))
        transport = _transport(self._socket(target), known.key_types(target.key_name))
        transport.banner_timeout = transport.auth_timeout = self.connect_timeout
        try:
            self._handshake(transport)
            self._check_host_key(target, known, transport.get_remote_server_key())
            self.typed_passphrase = log_in(transport, target).typed
        except OpsError:
            transport.close()
            raise
        except (OSError, paramiko.SSHException, EOFError) as exc:
            transport.close()
            raise UnreachableError(f"{target.label}: {self._explain(exc)}") from None
        return transport

    def _check_host_key(self, target: Resolved, known: KnownHosts, key: paramiko.PKey) -> None:
        found = known.verdict(target.key_name, key)
        what = f"{key.get_name()} {key.fingerprint}"
        name = self.endpoint.name
        if found.state == TRUSTED:
            return
        if found.state == REVOKED:
            raise HostKeyError(
                f"{target.label}: host key {what} is marked @revoked in {found.entry.where}: "
                "refusing to connect"
            )
        if found.state == CHANGED:
            raise HostKeyError(
                f"{target.label}: host key CHANGED (now {key.fingerprint}, pinned in "
                f"{found.entry.where}): refusing to connect; if the host was really reinstalled, "
                f"remove the old key and run `dflashops hosts trust {name}`"
            )
        raise HostKeyError(
            f"{target.label}: host key not trusted ({what}); check it, then pin it with "
            f"`dflashops hosts trust {name}`"
        )

    def _socket(self, target: Resolved):  # noqa: ANN202
        if target.jump:
            hop = self._lookup_jump(target.jump, self.endpoint)
            try:
                return hop.transport().open_channel(
                    "direct-tcpip", (target.hostname, target.port), ("127.0.0.1", 0),
                    timeout=self.connect_timeout,
                )  # fmt: skip
            except OpsError:
                raise
            except Exception as exc:  # paramiko.ChannelException and friends
                raise UnreachableError(
                    f"{target.label}: jump host {target.jump} could not reach it: {exc}"
                ) from None
        if target.proxy_command:
            return load_paramiko().ProxyCommand(_shell_command(target.proxy_command))
        return self._dial(target)

    def _dial(self, target: Resolved) -> socket.socket:
        try:
            sock = socket.create_connection(
                (target.hostname, target.port), timeout=self.connect_timeout
            )
        except OSError as exc:
            raise UnreachableError(f"{target.label}: {self._explain(exc)}") from None
        # SSH is request/response at start (key exchange, auth, each channel open): without
        # this, Nagle plus delayed ACKs add about 40 ms to many of those round trips.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        detect_dead_peer(sock)
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
            transport.banner_timeout = self.connect_timeout
            self._handshake(transport)
            return transport.get_remote_server_key()
        except (OSError, paramiko.SSHException, EOFError) as exc:
            raise UnreachableError(f"{target.label}: {self._explain(exc)}") from None
        finally:
            transport.close()

    def _handshake(self, transport: paramiko.Transport) -> None:
        """Key exchange within the connect timeout (paramiko's start_client just returns when
        its timeout passes). A server that took the connection and sent no banner is said to."""
        paramiko = load_paramiko()
        try:
            transport.start_client(timeout=self.connect_timeout)
        except (OSError, paramiko.SSHException, EOFError) as exc:
            if not transport.remote_version:
                raise self._no_banner(exc) from None
            raise
        if not transport.initial_kex_done:
            if not transport.remote_version:
                raise self._no_banner(TimeoutError())
            raise TimeoutError

    def _no_banner(self, exc: BaseException) -> UnreachableError:
        """The connection was taken, then closed or left silent before the server's first
        line (paramiko wraps what happened in an SSHException: its __context__)."""
        target = self.resolved
        where = f"{target.hostname}:{target.port}"
        cause = exc.__context__ if exc.__context__ is not None else exc
        if isinstance(cause, (EOFError, ConnectionResetError, BrokenPipeError)):
            return UnreachableError(
                f"{target.label}: the connection was closed before an SSH banner from {where} "
                "(sshd turning us away: MaxStartups, a TCP wrapper, a ban; or no sshd there)"
            )
        return UnreachableError(
            f"{target.label}: no answer in {self.connect_timeout:g} s: no SSH banner from "
            f"{where} (the port takes connections but says nothing: sshd stuck, or no sshd)"
        )

    def _explain(self, exc: BaseException) -> str:
        seconds = self.connect_timeout
        if isinstance(exc, (socket.timeout, TimeoutError)) or "banner" in str(exc):
            return f"no answer in {seconds:g} s (host down, unreachable or its sshd stuck)"
        if isinstance(exc, socket.gaierror):
            return f"cannot resolve '{self.endpoint.address}'"
        if isinstance(exc, ConnectionRefusedError):
            return "connection refused (is sshd running on that port?)"
        if isinstance(exc, OSError) and exc.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
            return "host unreachable (no route to it)"
        if isinstance(exc, EOFError):
            return "the server closed the connection during the handshake"
        return str(exc) or type(exc).__name__

    def _stop_heartbeat(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()
            self.heartbeat = None

    def close(self) -> None:
        with self._lock:
            self._stop_heartbeat()
            if self._transport is not None:
                self._transport.close()
                self._transport = None


def _shell_command(command: str) -> str:
    """A ProxyCommand as OpenSSH runs it (`exec` in the shell), in the form paramiko's
    ProxyCommand splits back into an argv."""
    return shlex.join(["/bin/sh", "-c", f"exec {command}"])


def _transport(sock, pinned_types: list[str]):  # noqa: ANN001, ANN202
    """A transport that prefers AES-GCM (no separate MAC pass: much faster bulk copies), asks
    for the host key types we have pinned first, and reports commands killed by a signal."""
    paramiko = load_paramiko()

    transport = paramiko.Transport(sock)
    handlers = dict(transport._channel_handler_table)
    handlers[paramiko.common.MSG_CHANNEL_REQUEST] = _channel_request
    transport._channel_handler_table = handlers
    options = transport.get_security_options()
    gcm = tuple(c for c in options.ciphers if c.endswith("-gcm@openssh.com"))
    options.ciphers = gcm + tuple(c for c in options.ciphers if c not in gcm)
    options.key_types = preferred_key_types(pinned_types, tuple(options.key_types))
    # Leave rekeying to the server (OpenSSH rekeys AES after 64 GiB by default): when paramiko
    # starts it itself (every 512 MiB), a channel that closes meanwhile deadlocks its transport
    # thread for 30 s and the copy fails (paramiko#822; seen in a 1 GB pull-ckpt here).
    transport.packetizer.REKEY_BYTES = transport.packetizer.REKEY_PACKETS = 1 << 40
    return transport


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
