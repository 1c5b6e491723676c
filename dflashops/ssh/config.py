"""What ~/.ssh/config makes of an inventory host, read as OpenSSH reads it.

Where the OpenSSH client is installed, `ssh -G` resolves it (Include, Match exec/host/user,
/etc/ssh/ssh_config: OpenSSH's own rules). Elsewhere paramiko's parser does, with `Include`
expanded here and `Match exec` run by the shell. What the inventory sets wins either way; the
user is root unless the inventory or the config names another (the contract's default).
"""

from __future__ import annotations

import functools
import getpass
import glob
import os
import pwd
import re
import shutil
import socket
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from dflashops.errors import UsageError
from dflashops.inventory import ADDRESS_RE, NOT_A_USER, NOT_AN_ADDRESS, USER_RE, Endpoint
from dflashops.ssh.paramiko_lib import load_paramiko

DEFAULT_IDENTITIES = tuple(
    f"~/.ssh/{name}"
    for name in ("id_rsa", "id_ecdsa", "id_ecdsa_sk", "id_ed25519", "id_ed25519_sk", "id_xmss",
                 "id_dsa")
)  # fmt: skip
SYSTEM_CONFIG = Path("/etc/ssh/ssh_config")
SSH_G_TIMEOUT_S = 30


@dataclass(frozen=True)
class Resolved:
    """An endpoint with the ssh configuration applied: what we really connect to."""

    endpoint: Endpoint
    hostname: str
    port: int
    user: str
    identities: tuple[str, ...]  # identity files named by the inventory or the config
    jump: str | None
    proxy_command: str | None
    identities_only: bool = False
    known_hosts: tuple[str, ...] = ()  # UserKnownHostsFile and GlobalKnownHostsFile

    @property
    def key_name(self) -> str:
        return self.hostname if self.port == 22 else f"[{self.hostname}]:{self.port}"

    @property
    def label(self) -> str:
        return f"{self.endpoint.name} ({self.user}@{self.hostname}:{self.port})"


def user_config() -> Path:
    return Path.home() / ".ssh" / "config"


def client() -> str | None:
    """The OpenSSH client, where it is installed."""
    return shutil.which("ssh")


def resolve(endpoint: Endpoint) -> Resolved:
    """Apply the ssh configuration: what the inventory sets wins, then the config, then
    ssh's defaults (user root, port 22). The address and the user go into `ssh -G`'s command
    line, `Match exec` and ProxyCommand tokens (run by /bin/sh): checked here, whoever made
    the endpoint."""
    if not ADDRESS_RE.match(endpoint.address):
        raise UsageError(f"{endpoint.name}: address {endpoint.address!r} {NOT_AN_ADDRESS}")
    if endpoint.user is not None and not USER_RE.match(endpoint.user):
        raise UsageError(f"{endpoint.name}: user {endpoint.user!r} {NOT_A_USER}")
    return _resolve(endpoint, str(Path.home()), bool(client()))


@functools.lru_cache(maxsize=256)
def _resolve(endpoint: Endpoint, home: str, openssh: bool) -> Resolved:
    found = _by_openssh(endpoint) if openssh else _by_paramiko(endpoint)
    hostname = found.get("hostname", [endpoint.address])[0]
    port = endpoint.port or int(found.get("port", ["22"])[0])
    user = endpoint.user or found.get("user", ["root"])[0]
    tokens = _Tokens(hostname, port, user, endpoint.address, expand=openssh)
    named = [p for p in found.get("identityfile", []) if p not in DEFAULT_IDENTITIES]
    identities = (str(endpoint.identity),) if endpoint.identity else ()
    if not identities:
        identities = tuple(str(Path(tokens(p)).expanduser()) for p in named)
    jump = endpoint.jump or _setting(found, "proxyjump")
    proxy = _setting(found, "proxycommand")
    known = [*found.get("userknownhostsfile", []), *found.get("globalknownhostsfile", [])]
    return Resolved(
        endpoint=endpoint,
        hostname=hostname,
        port=port,
        user=user,
        identities=identities,
        jump=jump,
        proxy_command=tokens(proxy) if proxy else None,
        identities_only=_setting(found, "identitiesonly") == "yes",
        known_hosts=tuple(dict.fromkeys(_home_path(p) for p in known)),
    )


def _setting(found: dict[str, list[str]], key: str) -> str | None:
    value = (found.get(key) or [None])[0]
    return None if value is None or value.strip().lower() == "none" else value


# ------------------------------------------------------------------ OpenSSH: ssh -G


def _by_openssh(endpoint: Endpoint) -> dict[str, list[str]]:
    """`ssh -G` over the user's and the system's config, with `User root` as the last default.
    (-F keeps OpenSSH from reading the real user's files when $HOME points elsewhere.)"""
    lines = [f'Include "{p}"' for p in (user_config(), SYSTEM_CONFIG) if p.is_file()]
    lines += ["Host *", "  User root", ""]
    with tempfile.NamedTemporaryFile("w", prefix="dflashops-", suffix=".conf") as wrapper:
        wrapper.write("\n".join(lines))
        wrapper.flush()
        argv = [client() or "ssh", "-G", "-F", wrapper.name]
        if endpoint.user:
            argv += ["-l", endpoint.user]
        if endpoint.port:
            argv += ["-p", str(endpoint.port)]
        try:
            done = subprocess.run(
                [*argv, "--", endpoint.address], capture_output=True, text=True,
                stdin=subprocess.DEVNULL, timeout=SSH_G_TIMEOUT_S,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            raise UsageError(
                f"{user_config()}: reading it for {endpoint.name} took over {SSH_G_TIMEOUT_S} s "
                "(a `Match exec` command that hangs?)"
            ) from None
    if done.returncode != 0:
        lines = [x for x in done.stderr.splitlines() if x.strip()]
        why = lines[0] if lines else f"ssh -G exited {done.returncode}"
        raise UsageError(f"ssh configuration for {endpoint.name}: {why.replace(wrapper.name, '')}")
    found: dict[str, list[str]] = {}
    for line in done.stdout.splitlines():
        key, _, value = line.partition(" ")
        if key in ("userknownhostsfile", "globalknownhostsfile"):
            found.setdefault(key, []).extend(value.split())
        else:
            found.setdefault(key, []).append(value)
    return found


def _home_path(path: str) -> str:
    """OpenSSH expands ~ with the passwd entry's home; ours is $HOME (tests move it)."""
    path = os.path.expanduser(path)
    real = pwd.getpwuid(os.getuid()).pw_dir.rstrip("/")
    home = str(Path.home())
    if real and real != home and (path == real or path.startswith(real + "/")):
        return home + path[len(real) :]
    return path


class _Tokens:
    """OpenSSH's %-tokens in ProxyCommand and IdentityFile (ssh -G leaves them unexpanded;
    paramiko's parser has expanded them already)."""

    def __init__(self, host: str, port: int, user: str, original: str, *, expand: bool) -> None:
        self.expand = expand
        local = socket.gethostname()
        self.table = {
            "%": "%", "h": host, "p": str(port), "r": user, "n": original,
            "u": getpass.getuser(), "d": str(Path.home()), "L": local.split(".")[0], "l": local,
        }  # fmt: skip

    def __call__(self, text: str) -> str:
        if not self.expand:
            return text

        def one(match: re.Match) -> str:
            token = match.group(1)
            if token not in self.table:
                raise UsageError(f"{user_config()}: unknown token %{token} in {text!r}")
            return self.table[token]

        return re.sub(r"%(.)", one, text)


# ------------------------------------------------------------------ no OpenSSH: paramiko


def _by_paramiko(endpoint: Endpoint) -> dict[str, list[str]]:
    paramiko = load_paramiko()
    path = user_config()
    if not path.is_file():
        return {}
    _shell_for_match_exec(paramiko)
    text = "\n".join(_inline_includes(path, depth=0))
    try:
        found = paramiko.SSHConfig.from_text(text).lookup(endpoint.address)
    except Exception as exc:  # paramiko's ConfigParseError and friends
        raise UsageError(f"{path}: {exc}") from None
    out = {k: (v if isinstance(v, list) else [str(v)]) for k, v in found.items()}
    out.setdefault("userknownhostsfile", ["~/.ssh/known_hosts", "~/.ssh/known_hosts2"])
    out.setdefault(
        "globalknownhostsfile", ["/etc/ssh/ssh_known_hosts", "/etc/ssh/ssh_known_hosts2"]
    )
    if isinstance(found.get("userknownhostsfile"), str):
        out["userknownhostsfile"] = found["userknownhostsfile"].split()
    return out


def _inline_includes(path: Path, depth: int) -> list[str]:
    """The file's lines with each `Include` replaced by the files it names (globs; relative
    to ~/.ssh, as OpenSSH reads them)."""
    if depth > 16:
        raise UsageError(f"{path}: Include nested too deeply (a loop?)")
    out = []
    for line in path.read_text(errors="replace").splitlines():
        words = line.strip().split(None, 1)
        if not words or words[0].lower() != "include" or len(words) < 2:
            out.append(line)
            continue
        for pattern in words[1].split():
            pattern = os.path.expanduser(pattern.strip('"'))
            if not pattern.startswith("/"):
                pattern = str(Path.home() / ".ssh" / pattern)
            for name in sorted(glob.glob(pattern)):
                out += _inline_includes(Path(name), depth + 1)
    return out


class _ShellRun:
    """Stands in for `invoke` (which paramiko wants for `Match exec`): the command runs in the
    shell, as OpenSSH runs it; exit status 0 is a match."""

    def run(self, command: str, hide: str = "", warn: bool = True):  # noqa: ANN201, ARG002
        done = subprocess.run(
            command, shell=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            timeout=SSH_G_TIMEOUT_S,
        )  # fmt: skip
        return type("Ran", (), {"ok": done.returncode == 0})()


def _shell_for_match_exec(paramiko) -> None:  # noqa: ANN001
    import paramiko.config as config

    if config.invoke is None:
        config.invoke = _ShellRun()
