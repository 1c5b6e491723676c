"""Hostile tar streams (issue 9, item 8) and what to look for after one: special files."""

from __future__ import annotations

import io
import os
import stat
import tarfile
import zlib
from pathlib import Path

from dflashops.transfer import seal


def member(name: str, kind: bytes = tarfile.REGTYPE, data: bytes = b"", **fields) -> tuple:
    info = tarfile.TarInfo(name)
    info.type, info.size, info.mode = kind, len(data), fields.pop("mode", 0o644)
    for key, value in fields.items():
        setattr(info, key, value)
    return info, data


def tar_of(*members: tuple) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return out.getvalue()


def copy_tar_of(*members: tuple, seals: dict[str, tuple[str, int]] | None = None) -> bytes:
    """A copy's stream as push sends it: each file's data followed by its seal (its CRC-32 and
    size, or what `seals` says for that name)."""
    out = b""
    for info, data in members:
        out += _entry_bytes(info, data)
        if info.isreg():
            digest, size = (seals or {}).get(info.name, (f"{zlib.crc32(data):08x}", len(data)))
            out += seal(digest, size)
    return out + b"\0" * (2 * tarfile.BLOCKSIZE)


def _entry_bytes(info: tarfile.TarInfo, data: bytes) -> bytes:
    head = info.tobuf(format=tarfile.PAX_FORMAT, encoding="utf-8", errors="surrogateescape")
    return head + data + b"\0" * (-len(data) % tarfile.BLOCKSIZE)


def with_bad_checksum(stream: bytes) -> bytes:
    return stream[:148] + b"0000000\0" + stream[156:]


def pax_named(path: str) -> bytes:
    """A file whose pax header names it `path` (the header's own name field says "ok")."""
    info = tarfile.TarInfo("ok")
    info.pax_headers = {"path": path}
    return tar_of((info, b""))


def with_huge_pax_header() -> bytes:
    info = tarfile.TarInfo("x" * 10)
    info.pax_headers = {"comment": "y" * (2 << 20)}
    return tar_of((info, b""))


# (case, stream, the refusal it gets)
HOSTILE = [
    ("absolute name", tar_of(member("/tmp/pwned", data=b"x")), "an absolute name"),
    ("dot-dot", tar_of(member("../pwned", data=b"x")), "a '..' in a name"),
    ("dot-dot inside", tar_of(member("a/../../pwned", data=b"x")), "a '..' in a name"),
    (
        "a link, then a file through it",
        tar_of(member("esc", tarfile.SYMTYPE, linkname="/tmp"), member("esc/pwned", data=b"x")),
        "would be written through the symlink esc sent earlier",
    ),
    (
        "a relative link out, then a file through it",
        tar_of(member("up", tarfile.SYMTYPE, linkname="../.."), member("up/tmp/pwned", data=b"x")),
        "would be written through the symlink up",
    ),
    ("a hard link out", tar_of(member("hl", tarfile.LNKTYPE, linkname="/etc/passwd")),
     "a hard link is refused"),
    ("a character device", tar_of(member("null", tarfile.CHRTYPE, devmajor=1, devminor=3)),
     "a character device is refused"),
    ("a block device", tar_of(member("sda", tarfile.BLKTYPE, devmajor=8, devminor=0)),
     "a block device is refused"),
    ("a fifo", tar_of(member("fifo", tarfile.FIFOTYPE)), "a fifo is refused"),
    ("a name component over 255 bytes", tar_of(member("n" * 300, data=b"x")),
     "a name longer than the file system takes"),
    ("a path over 4096 bytes", tar_of(member("/".join(["d" * 200] * 25), data=b"x")),
     "a name longer than the file system takes"),
    ("one name twice", tar_of(member("dup", data=b"first"), member("dup", data=b"second")),
     "dup: appears twice in the stream"),
    ("a file, then a file under it", tar_of(member("f", data=b"x"), member("f/g", data=b"y")),
     "would be written through the file f"),
    ("a NUL in a pax name", pax_named("ok\0/../../pwned"), "a NUL in a name"),
    ("an absolute pax name", pax_named("/tmp/pwned"), "an absolute name"),
    ("not a tar (bad checksum)", with_bad_checksum(tar_of(member("a", data=b"x"))),
     "bad header checksum"),
    ("a pax header of 2 MiB", with_huge_pax_header(), "a pax header of"),
]  # fmt: skip


def special_files(root: Path) -> list[str]:
    """Everything under root that is not a regular file, a directory or a symlink, or that has
    a setuid, setgid or sticky bit."""
    found = []
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            st = os.lstat(os.path.join(folder, name))
            plain = stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode) or stat.S_ISLNK(st.st_mode)
            if not plain or (not stat.S_ISLNK(st.st_mode) and st.st_mode & 0o7000):
                found.append(os.path.join(folder, name))
    return found


EVIL_TAR = """#!/usr/bin/python3
# An attacker's `tar` in the source container: whatever it is asked for, it sends a stream that
# tries to write outside the destination.
import io, sys, tarfile
out = io.BytesIO()
with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
    link = tarfile.TarInfo("config.json")
    link.type, link.linkname = tarfile.SYMTYPE, "/tmp"
    tar.addfile(link)
    data = b"pwned"
    info = tarfile.TarInfo("config.json/pwned")
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))
sys.stdout.buffer.write(out.getvalue())
"""
