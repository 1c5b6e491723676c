"""known_hosts files read as OpenSSH reads them: hashed names, `*`/`?` wildcards and `!`
negation, `[host]:port`, `@revoked` keys (refused even where another line trusts them) and
`@cert-authority` lines (skipped: host certificates are not offered to paramiko, so the plain
keys decide). A line we cannot read is skipped, as OpenSSH skips it; it never breaks a connection.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import paramiko

    from dflashops.ssh.config import Resolved

TRUSTED, REVOKED, CHANGED, UNKNOWN = "trusted", "revoked", "changed", "unknown"


def pinned_keys_file() -> Path:
    """Where `hosts trust` pins keys when a host names no known_hosts file of its own."""
    return Path.home() / ".config" / "dflashops" / "known_hosts"


def host_key_files(target: Resolved) -> list[Path]:
    """Every file whose keys we trust for `target`: the config's UserKnownHostsFile (by
    default ~/.ssh/known_hosts) and GlobalKnownHostsFile, ours, and the host's own."""
    files = [Path(p) for p in target.known_hosts] or [Path.home() / ".ssh" / "known_hosts"]
    files.append(pinned_keys_file())
    if target.endpoint.known_hosts:
        files.append(Path(target.endpoint.known_hosts))
    return [f for f in dict.fromkeys(files) if f.is_file()]


@dataclass(frozen=True)
class Entry:
    where: str  # "file:line"
    marker: str  # "", "@revoked" or "@cert-authority"
    hosts: str  # the line's first field: patterns, or one |1|salt|hash
    keytype: str
    blob: bytes

    def matches(self, name: str) -> bool:
        """Whether this line is about `name` ("host" or "[host]:port"), as OpenSSH matches."""
        name = name.lower()
        if self.hosts.startswith("|1|"):
            return _hashed_match(self.hosts, name)
        hit = False
        for pattern in self.hosts.lower().split(","):
            negated = pattern.startswith("!")
            if _glob(name, pattern.removeprefix("!")):
                if negated:
                    return False
                hit = True
        return hit


def _glob(name: str, pattern: str) -> bool:
    """OpenSSH's patterns: `*` and `?` only (a `[` is literal, as in `[host]:2222`)."""
    regex = "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern)
    return re.fullmatch(regex, name, re.DOTALL) is not None


def _hashed_match(field: str, name: str) -> bool:
    try:
        _, _, salt, digest = field.split("|")
        mac = hmac.new(base64.b64decode(salt), name.encode(), hashlib.sha1).digest()
        return hmac.compare_digest(mac, base64.b64decode(digest))
    except (ValueError, binascii.Error):
        return False


@dataclass(frozen=True)
class Verdict:
    state: str  # TRUSTED, REVOKED, CHANGED or UNKNOWN
    entry: Entry | None = None  # the line that decided it


class KnownHosts:
    def __init__(self, entries: list[Entry]) -> None:
        self.entries = entries

    @classmethod
    def load(cls, files: list[Path]) -> KnownHosts:
        entries: list[Entry] = []
        for path in files:
            try:
                text = path.read_text(errors="replace")
            except OSError:
                continue
            for number, line in enumerate(text.splitlines(), 1):
                entry = _parse(line, f"{path}:{number}")
                if entry is not None:
                    entries.append(entry)
        return cls(entries)

    def about(self, name: str) -> list[Entry]:
        return [e for e in self.entries if e.matches(name)]

    def key_types(self, name: str) -> list[str]:
        """The key types pinned for `name`, first seen first (to ask the server for those)."""
        found = [e.keytype for e in self.about(name) if not e.marker]
        return list(dict.fromkeys(found))

    def verdict(self, name: str, key: paramiko.PKey) -> Verdict:
        blob = key.asbytes()
        lines = self.about(name)
        revoked = next((e for e in lines if e.marker == "@revoked" and e.blob == blob), None)
        if revoked is not None:
            return Verdict(REVOKED, revoked)
        plain = [e for e in lines if not e.marker]
        same = next((e for e in plain if e.blob == blob), None)
        if same is not None:
            return Verdict(TRUSTED, same)
        other = next((e for e in plain if _family(e.keytype) == _family(key.get_name())), None)
        return Verdict(CHANGED, other) if other is not None else Verdict(UNKNOWN)


def fingerprint(blob: bytes) -> str:
    """OpenSSH's SHA256 fingerprint of a public key blob."""
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")


def _parse(line: str, where: str) -> Entry | None:
    fields = line.split()
    if not fields or fields[0].startswith("#"):
        return None
    marker = ""
    if fields[0].startswith("@"):
        marker, fields = fields[0], fields[1:]
        if marker not in ("@revoked", "@cert-authority"):
            return None
    if len(fields) < 3:
        return None
    try:
        blob = base64.b64decode(fields[2], validate=True)
    except (ValueError, binascii.Error):
        return None
    return Entry(where, marker, fields[0], fields[1], blob)


def _family(keytype: str) -> str:
    """ssh-rsa keys are offered as rsa-sha2-256/512 too: one family for comparing types."""
    return "ssh-rsa" if keytype.startswith("rsa-sha2-") else keytype


def preferred_key_types(pinned: list[str], offered: tuple[str, ...]) -> tuple[str, ...]:
    """Host key algorithms with those of the pinned keys first, so the server shows the key we
    know (what OpenSSH does for a known host)."""
    wanted: list[str] = []
    for keytype in pinned:
        family = ("rsa-sha2-512", "rsa-sha2-256", "ssh-rsa") if keytype == "ssh-rsa" else (keytype,)
        wanted += [t for t in family if t in offered and t not in wanted]
    return tuple(wanted) + tuple(t for t in offered if t not in wanted)
