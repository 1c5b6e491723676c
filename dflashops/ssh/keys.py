"""Logging in with public keys as OpenSSH does: the identity files named in hosts.yaml or
~/.ssh/config first (ssh-agent's copy when the agent holds one; else the file, whose
passphrase is asked on a terminal), then the agent's other keys (unless IdentitiesOnly), then
~/.ssh's default keys when no identity is named."""

from __future__ import annotations

import base64
import getpass
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from dflashops.errors import UnreachableError
from dflashops.ssh.paramiko_lib import load_paramiko

if TYPE_CHECKING:
    import paramiko

    from dflashops.ssh.config import Resolved

DEFAULT_KEYS = ("id_ed25519", "id_ecdsa", "id_rsa", "id_dsa")
OPENSSH_MAGIC = b"openssh-key-v1\0"
PROMPTS = 3

_unlocked: dict[str, paramiko.PKey] = {}  # path -> key, once per command whatever the threads
_prompt_lock = threading.Lock()


@dataclass
class Login:
    """How a login went: `typed` when a passphrase typed by the user unlocked the key used
    (the OpenSSH client, run in batch mode, could not use that key)."""

    typed: bool = False
    locked: list[str] = field(default_factory=list)  # encrypted keys nothing could unlock
    tried: list[str] = field(default_factory=list)


def log_in(transport: paramiko.Transport, target: Resolved) -> Login:
    """Authenticate `transport` as `target.user`, or raise UnreachableError saying why not."""
    paramiko = load_paramiko()
    login = Login()
    agent = _agent_keys(paramiko)
    for what, key, typed in _candidates(paramiko, target, agent, login):
        login.tried.append(what)
        try:
            transport.auth_publickey(target.user, key)
        except paramiko.BadAuthenticationType:
            break  # the server takes no public keys at all
        except paramiko.AuthenticationException:
            continue
        except (paramiko.SSHException, EOFError, OSError):
            break  # sshd hung up (MaxAuthTries)
        if transport.is_authenticated():
            login.typed = typed
            return login
    raise UnreachableError(f"{target.label}: {_refusal(target, login)}")


def _refusal(target: Resolved, login: Login) -> str:
    locked = [p for p in login.locked if p not in login.tried]
    if locked and not login.tried:
        path = locked[0]
        return (
            f"the key {path} has a passphrase and no ssh-agent holds it; add it to the agent "
            f"(`ssh-add {path}`) or run this on a terminal to be asked for it"
        )
    tried = ", ".join(login.tried) or "no key (none found)"
    if target.identities:
        hint = f"is the public key in ~{target.user}/.ssh/authorized_keys there?"
    else:
        hint = f"set 'identity' for {target.endpoint.name} in hosts.yaml or IdentityFile in ~/.ssh/config"
    extra = f"; {', '.join(locked)} has a passphrase and no ssh-agent holds it" if locked else ""
    return f"authentication refused for {target.user} (tried {tried}){extra}; {hint}"


def _candidates(paramiko, target: Resolved, agent: dict[bytes, object], login: Login):  # noqa: ANN001, ANN202
    """(description, key, typed) in the order they are offered."""
    offered: set[bytes] = set()
    explicit = [Path(p) for p in target.identities]
    defaults = [Path.home() / ".ssh" / n for n in DEFAULT_KEYS]
    files = explicit or [p for p in defaults if p.is_file()]
    for path in files:
        public = _public_blob(path)
        if public is not None and public in agent:
            offered.add(public)
            yield f"{path} (from ssh-agent)", agent[public], False
            continue
        key, typed = _from_file(paramiko, target, path, ask=bool(explicit), login=login)
        if key is not None and key.asbytes() not in offered:
            offered.add(key.asbytes())
            yield str(path), key, typed
    if explicit and target.identities_only:
        return
    for blob, key in agent.items():
        if blob not in offered:
            offered.add(blob)
            yield f"ssh-agent key {key.get_name()} {key.fingerprint}", key, False


def _from_file(paramiko, target: Resolved, path: Path, *, ask: bool, login: Login):  # noqa: ANN001, ANN202
    """(key, typed): the key in `path`, unlocked with a passphrase asked on our terminal when it
    has one (only for keys named explicitly, as OpenSSH asks only for keys it offers)."""
    try:
        if not _encrypted(path):
            return paramiko.PKey.from_path(path), False
    except FileNotFoundError:
        if ask:
            raise UnreachableError(f"{target.label}: identity {path}: no such file") from None
        return None, False
    except (OSError, ValueError, TypeError, paramiko.SSHException) as exc:
        raise UnreachableError(f"{target.label}: identity {path}: cannot read it ({exc})") from None
    if not ask or sys.stdin is None or not sys.stdin.isatty():
        login.locked.append(str(path))
        return None, False
    with _prompt_lock:
        if str(path) in _unlocked:
            return _unlocked[str(path)], True
        for _ in range(PROMPTS):
            secret = getpass.getpass(f"Enter passphrase for key '{path}': ")
            try:
                key = paramiko.PKey.from_path(path, secret.encode())
            except (ValueError, TypeError, paramiko.SSHException):
                sys.stderr.write("Bad passphrase, try again.\n")
                continue
            _unlocked[str(path)] = key
            return key, True
    raise UnreachableError(f"{target.label}: wrong passphrase for {path} ({PROMPTS} tries)")


def _encrypted(path: Path) -> bool:
    """Whether a private key file needs a passphrase (read from its header, not guessed)."""
    text = path.read_bytes()
    if b"BEGIN OPENSSH PRIVATE KEY" in text:
        cipher = _openssh_fields(text)[0]
        return cipher != b"none"
    return b"ENCRYPTED" in text.split(b"\n\n", 1)[0] or b"BEGIN ENCRYPTED PRIVATE KEY" in text


def _openssh_fields(text: bytes) -> tuple[bytes, bytes]:
    """(cipher name, first public key blob) from an openssh-key-v1 file's clear header."""
    body = b"".join(
        line.strip() for line in text.splitlines() if line.strip() and not line.startswith(b"-")
    )
    data = base64.b64decode(body)
    if not data.startswith(OPENSSH_MAGIC):
        raise ValueError("not an openssh-key-v1 key")
    pos = len(OPENSSH_MAGIC)
    fields = []
    for _ in range(3):  # cipher name, kdf name, kdf options
        size = int.from_bytes(data[pos : pos + 4], "big")
        fields.append(data[pos + 4 : pos + 4 + size])
        pos += 4 + size
    pos += 4  # number of keys
    size = int.from_bytes(data[pos : pos + 4], "big")
    return fields[0], data[pos + 4 : pos + 4 + size]


def _public_blob(path: Path) -> bytes | None:
    """The public half of a key file without its passphrase: KEY.pub, else the clear header."""
    pub = Path(f"{path}.pub")
    try:
        if pub.is_file():
            return base64.b64decode(pub.read_text().split()[1])
        text = path.read_bytes()
        if b"BEGIN OPENSSH PRIVATE KEY" in text:
            return _openssh_fields(text)[1]
    except (OSError, IndexError, ValueError):
        return None
    return None


def _agent_keys(paramiko) -> dict[bytes, object]:  # noqa: ANN001
    try:
        agent = paramiko.Agent()
        return {key.asbytes(): key for key in agent.get_keys()}
    except (paramiko.SSHException, OSError):
        return {}
