"""Bulk byte streams through the OpenSSH client (paramiko's one channel tops out well below it).

The client gets nothing from the user's ssh configuration: a private ssh_config (mode 0600, in
a private temporary directory, removed at the end of the command) says exactly what the
paramiko connection resolved, hop by hop: address, port, user, identity files, our known_hosts
files with StrictHostKeyChecking=yes (nothing is ever accepted or written), the jump chain or
ProxyCommand, BatchMode, no ControlMaster, and a ServerAlive keepalive with the same limit.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from dflashops.errors import HostKeyError, NoAnswerError, UnreachableError
from dflashops.ssh.config import client
from dflashops.ssh.keepalive import lost, openssh_alive
from dflashops.ssh.known_hosts import host_key_files

if TYPE_CHECKING:
    from dflashops.ssh.config import Resolved

CIPHERS = (
    "aes128-gcm@openssh.com,aes256-gcm@openssh.com,chacha20-poly1305@openssh.com,"
    "aes128-ctr,aes192-ctr,aes256-ctr"
)
DEFAULT_KEYS = ("id_ed25519", "id_ecdsa", "id_rsa")
# What the client itself says when it fails (exit 255), as opposed to the remote command.
OWN_ERROR = re.compile(
    r"^(ssh: |Host key verification failed|.*: Permission denied \(|Connection (closed|reset) by"
    r"|Connection timed out|Connection to .* timed out"
    r"|kex_exchange_identification|Timeout, server .* not responding|Received disconnect"
    r"|Bad owner or permissions|Too many authentication failures|no matching .* found"
    r"|channel \d+: open failed|ssh_dispatch_run_fatal|Load key|ProxyCommand|kex_)"
)
TAIL = 4096
PREFIX = "dflashops-ssh-"  # + pid: the private config directories in the temporary directory
PIPE_SIZE = 1 << 20  # fewer, larger hand-overs between us and the client than 64 KiB pipes


class Hop(Protocol):
    """What the client's config is made from: one connection (dflashops.ssh.connection's)."""

    deadline: float

    @property
    def resolved(self) -> Resolved: ...
    @property
    def connect_timeout(self) -> float: ...
    @property
    def openssh(self) -> Configs | None: ...
    def jump_connection(self) -> Hop: ...
    def transport(self) -> object: ...


class Configs:
    """The private ssh_config files of one command: one Host block per hop, written once."""

    def __init__(self) -> None:
        self._dir: str | None = None
        self._aliases: dict[int, str] = {}
        self._lock = threading.Lock()

    def argv(self, conn: Hop, command: str, *, terminal: bool = False) -> list[str]:
        """`ssh` running `command` (one shell string, as sshd takes it) on `conn`'s server;
        `terminal`: with a pty on our terminal, where the client may ask for a passphrase."""
        with self._lock:
            alias = self._alias(conn)
            path = os.path.join(self._dir, "config")
        mode = ["-t", "-o", "BatchMode=no"] if terminal else ["-T", "-o", "BatchMode=yes"]
        return [client() or "ssh", "-F", path, *mode, alias, "--", command]

    def _alias(self, conn: Hop) -> str:
        if id(conn) in self._aliases:
            return self._aliases[id(conn)]
        target = conn.resolved
        onward = None
        if target.jump:
            onward = f"  ProxyJump {self._alias(conn.jump_connection())}\n"
        elif target.proxy_command:
            onward = f"  ProxyCommand {target.proxy_command.replace('%', '%%')}\n"
        alias = f"dflashops-{len(self._aliases)}"
        self._aliases[id(conn)] = alias
        self._append(f"Host {alias}\n{block(conn)}{onward or ''}")
        return alias

    def _append(self, text: str) -> None:
        if self._dir is None:
            _sweep()
            self._dir = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-")
        fd = os.open(
            os.path.join(self._dir, "config"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600
        )
        with os.fdopen(fd, "w") as f:
            f.write(text)

    def close(self) -> None:
        with self._lock:
            if self._dir is not None:
                shutil.rmtree(self._dir, ignore_errors=True)
                self._dir = None
            self._aliases.clear()


def terminal_argv(conn: Hop, command: str) -> list[str] | None:
    """`ssh -t` running `command` on `conn`'s server with our terminal (shell, attach), under
    the same private config as bulk copies; None where the OpenSSH client is not installed.
    The paramiko connection is opened first, so host keys and logins are checked, and
    reported, the one way."""
    configs = conn.openssh
    if configs is None or client() is None:
        return None
    conn.transport()
    return configs.argv(conn, command, terminal=True)


def _sweep() -> None:
    """Remove the config directories of our commands that were killed before they could (the
    pid in the name is gone)."""
    for path in Path(tempfile.gettempdir()).glob(f"{PREFIX}*"):
        pid = path.name[len(PREFIX) :].split("-", 1)[0]
        try:
            if not pid.isdigit() or path.lstat().st_uid != os.getuid():
                continue
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except OSError:
            continue


def block(conn: Hop) -> str:
    """The settings of one hop, every one of them explicit."""
    target = conn.resolved
    identities = list(target.identities) or [
        str(p) for p in (Path.home() / ".ssh" / n for n in DEFAULT_KEYS) if p.is_file()
    ]
    known = " ".join(_quoted(str(p)) for p in host_key_files(target)) or "/dev/null"
    interval, count = openssh_alive(conn.deadline)
    lines = [
        f"HostName {target.hostname}",
        f"Port {target.port}",
        f"User {target.user}",
        *(f"IdentityFile {_quoted(p)}" for p in identities),
        f"IdentitiesOnly {'yes' if target.identities_only else 'no'}",
        f"UserKnownHostsFile {known}",
        "GlobalKnownHostsFile /dev/null",
        "StrictHostKeyChecking yes",
        "UpdateHostKeys no",
        "CheckHostIP no",
        "BatchMode yes",
        "ControlMaster no",
        "ControlPath none",
        "ForwardAgent no",
        "ForwardX11 no",
        "ClearAllForwardings yes",
        "PermitLocalCommand no",
        "RequestTTY no",
        "Compression no",
        "LogLevel INFO",  # the default: errors and "Timeout, server ... not responding"
        f"ConnectTimeout {max(1, round(conn.connect_timeout))}",
        f"ServerAliveInterval {interval}",
        f"ServerAliveCountMax {count}",
        f"Ciphers {CIPHERS}",
    ]
    return "".join(f"  {line}\n" for line in lines)


def _quoted(path: str) -> str:
    return '"' + path.replace('"', "") + '"'


class OpenSshProcess:
    """A command run by the OpenSSH client; its own failures (exit 255 with its message) become
    our errors, the remote command's exit code and output pass through."""

    def __init__(self, argv: list[str], who: str, deadline: float) -> None:
        self.who, self.deadline = who, deadline
        self.popen = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # our Ctrl-C is ours to handle, not the client's
        )
        for pipe in (self.popen.stdin, self.popen.stdout):
            with contextlib.suppress(OSError, AttributeError):  # Linux only; a hint
                fcntl.fcntl(pipe.fileno(), fcntl.F_SETPIPE_SZ, PIPE_SIZE)
        self._tail = b""

    def write(self, data: bytes | memoryview) -> None:
        self.popen.stdin.write(data)
        self.popen.stdin.flush()  # a short line may be waited for (a push's offer)

    def stdin_pipe(self) -> int:
        return self.popen.stdin.fileno()

    def close_stdin(self) -> None:
        with contextlib.suppress(BrokenPipeError):
            self.popen.stdin.close()

    def read_stdout(self, size: int) -> bytes:
        return self.popen.stdout.read1(size)

    def read_stderr(self, size: int) -> bytes:
        chunk = self.popen.stderr.read1(size)
        self._tail = (self._tail + chunk)[-TAIL:]
        return chunk

    def wait(self, timeout: float | None = None) -> int | None:
        try:
            code = self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        if code == 255:
            self._raise_own_error()
        return 128 - code if code < 0 else code

    def _raise_own_error(self) -> None:
        lines = self._tail.decode("utf-8", "replace").splitlines()
        own = [x for x in lines if OWN_ERROR.match(x)]
        if not own:
            return
        if any(x.startswith("Timeout, server") for x in own):
            raise lost(self.who, self.deadline)
        if any("timed out" in x for x in own):
            raise NoAnswerError(self.who, self.deadline)
        if any("Host key verification failed" in x for x in own):
            raise HostKeyError(f"{self.who}: the OpenSSH client refused the host key: {own[0]}")
        raise UnreachableError(f"{self.who}: bulk copy through the OpenSSH client: {own[-1]}")

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()

    def discard(self) -> None:
        """Killed before it was used: reaped, its pipes closed."""
        self.kill()
        self.popen.wait()
        for pipe in (self.popen.stdin, self.popen.stdout, self.popen.stderr):
            pipe.close()
