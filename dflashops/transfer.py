"""Files in and out of any target over `Machine.run`: a tar stream in, checked after.

Nothing is trusted on an exit code alone (a failed `pct push` may exit 0): every file that
goes in is hashed while it is read here and hashed again inside the target as it is written,
and the two must agree, with the size. The in-flight digest of a copy is CRC-32 (a tenth of
sha256's CPU: a copy of a GB on two shared cores was CPU-bound by its two sha256 passes; the
bytes travel over SSH, which authenticates them), sha256 with `checksum` (push --checksum);
checkpoints are checked with sha256 against their own manifest (runs/evaluation/pulls.py).
Every bulk byte stream (a tar in, a file out, one target's tar into another) runs through
`stream`, the one place that says how bulk bytes travel.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import posixpath
import secrets
import stat
import tarfile
import threading
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from dflashops import remote as helpers
from dflashops.errors import OpsError, TransferError, UsageError
from dflashops.targets.base import CHUNK, FileSpan, Machine, Result, Sink, Stdin

if TYPE_CHECKING:
    from dflashops.render import Meter

Progress = Callable[[int], None]
BLOCK = tarfile.BLOCKSIZE


@dataclass
class Entry:
    """One path of a local tree, as it will be sent."""

    rel: str  # posix path relative to the tree's root ("." for a single file sent alone)
    path: Path
    kind: str  # "f", "l", "d"
    size: int = 0
    mode: int = 0o644
    link: str = ""
    sha256: str = ""  # with a checksum copy (push --checksum), before and while it is sent
    crc32: str = ""  # as it was sent


@dataclass
class Sent:
    entries: list[Entry]
    bytes: int
    warnings: list[str] = field(default_factory=list)  # what the receiver changed or skipped

    @property
    def files(self) -> int:
        return sum(1 for e in self.entries if e.kind == "f")


def remote_path(machine: Machine, path: str) -> str:
    """A target path: absolute as given, else under the target's workspace."""
    if path.startswith("/"):
        return posixpath.normpath(path)
    return posixpath.normpath(posixpath.join(machine.target.workspace, path))


def scan(local: Path) -> list[Entry]:
    """The entries of a local file or directory tree, in a stable order.

    Links are followed where a copy of the link would not work on the other side: the path
    given itself, and links inside the tree that point out of it (a Hugging Face snapshot is
    links into ../../blobs). Links within the tree stay links."""
    real = local.resolve()
    if not real.is_dir():
        return [_entry(real, local.name, real.stat())]
    entries: list[Entry] = []
    _walk(real, real, "", {real}, entries)
    return entries


def _walk(root: Path, folder: Path, prefix: str, seen: set[Path], out: list[Entry]) -> None:
    for path in sorted(folder.iterdir(), key=lambda p: p.name):
        rel = f"{prefix}{path.name}"
        st = path.lstat()
        if stat.S_ISLNK(st.st_mode):
            points_to = Path(os.path.normpath(path.parent / os.readlink(path)))
            inside = points_to == root or root in points_to.parents
            if inside or not path.exists():
                out.append(_entry(path, rel, st))  # an in-tree (or dangling) link stays a link
                continue
            path = path.resolve()
            st = path.stat()
        out.append(_entry(path, rel, st))
        if stat.S_ISDIR(st.st_mode):
            real = path.resolve()
            if real in seen:
                raise UsageError(f"{path}: a link loop; cannot copy it")
            _walk(root, path, f"{rel}/", seen | {real}, out)


def _entry(path: Path, rel: str, st: os.stat_result) -> Entry:
    mode = stat.S_IMODE(st.st_mode) & 0o777  # never setuid, setgid or sticky bits
    if stat.S_ISLNK(st.st_mode):
        return Entry(rel, path, "l", link=os.readlink(path))
    if stat.S_ISDIR(st.st_mode):
        return Entry(rel, path, "d", mode=mode)
    if not stat.S_ISREG(st.st_mode):
        raise UsageError(f"{path}: not a regular file, directory or symlink; cannot copy it")
    return Entry(rel, path, "f", size=st.st_size, mode=mode)


def tar_stream(
    entries: list[Entry], progress: Progress | None = None, *, sha256: bool = False
) -> Iterator[bytes | FileSpan]:
    """A POSIX tar of `entries`, each file's CRC-32 (and with `sha256` its sha256) taken as it
    is read and sent after its data as its seal. A file's bytes come as FileSpans over one
    buffer, valid until the next item."""
    buffer = memoryview(bytearray(CHUNK))
    for entry in entries:
        info = tarfile.TarInfo(entry.rel)
        info.mode = entry.mode
        info.mtime = int(entry.path.lstat().st_mtime)
        if entry.kind == "l":
            info.type, info.linkname = tarfile.SYMTYPE, entry.link
        elif entry.kind == "d":
            info.type = tarfile.DIRTYPE
        else:
            info.size = entry.size
        yield info.tobuf(format=tarfile.PAX_FORMAT, encoding="utf-8", errors="surrogateescape")
        if entry.kind == "f":
            yield from _file_spans(entry, buffer, progress, sha256)
            yield seal(entry.sha256 if sha256 else entry.crc32, entry.size)
    yield b"\0" * (2 * BLOCK)


def seal(digest: str, size: int) -> bytes:
    """What the sender read of a file it has just sent (a pax global header after its data):
    the receiver renames the file into place only if it wrote the same (remote/receive.py)."""
    records = {"DFLASHOPS.digest": digest, "DFLASHOPS.size": str(size)}
    return tarfile.TarInfo.create_pax_global_header(records)


def _file_spans(
    entry: Entry, buffer: memoryview, progress: Progress | None, sha256: bool
) -> Iterator[bytes | FileSpan]:
    digest = hashlib.sha256() if sha256 else None
    crc, offset = 0, 0
    with open(entry.path, "rb", buffering=0) as f:
        while offset < entry.size:
            n = f.readinto(buffer[: min(CHUNK, entry.size - offset)])
            if not n:
                raise TransferError(f"{entry.path}: file shrank while being sent; try again")
            data = buffer[:n]
            if digest is not None:
                digest.update(data)
            else:
                crc = zlib.crc32(data, crc)
            if progress:
                progress(n)
            yield FileSpan(str(entry.path), f.fileno(), offset, data)
            offset += n
    if digest is not None:
        entry.sha256 = digest.hexdigest()
    entry.crc32 = f"{crc:08x}"
    pad = -entry.size % BLOCK
    if pad:
        yield b"\0" * pad


def describe_remote(
    machine: Machine,
    base: str,
    rels: list[str] | None,
    *,
    follow: bool = False,
    quick: bool = False,
) -> dict[str, dict]:
    """Hash paths under `base` inside the target (all of them when `rels` is None); with
    `follow`, a link is described by what it points to; with `quick`, files by size and mtime."""
    wanted = (("--all", rels is None), ("--follow", follow), ("--stat", quick))
    flags = [flag for flag, on in wanted if on]
    stdin = json.dumps(rels or []).encode()
    result = helpers.run(machine, "hashtree.py", base, *flags, stdin=stdin, what=f"reading {base}")
    return json.loads(result.stdout) if result.stdout else {}


def put(
    machine: Machine,
    local: Path,
    remote: str,
    *,
    progress: Progress | None = None,
    entries: list[Entry] | None = None,
) -> Sent:
    """Copy a local file or directory to `remote` (created with its parents), then verify.

    A directory's contents land in `remote`; a file becomes `remote`, or goes into it when
    `remote` ends with '/'. `entries` (from `scan` or `changes`) limits what is sent.
    """
    base, entries = _layout(machine, local, remote, entries)
    receive = helpers.argv("receive.py", base)
    result = stream(machine, receive, stdin=tar_stream(entries, progress))
    sent = Sent(entries, sum(e.size for e in entries), receiver_warnings(result))
    if machine.dry_run:
        return sent
    helpers.check(machine, result, f"copy into {base}", TransferError)
    check_arrived(machine, base, entries, json.loads(result.stdout))
    return sent


def _layout(
    machine: Machine, local: Path, remote: str, entries: list[Entry] | None = None
) -> tuple[str, list[Entry]]:
    """Where a copy of `local` lands in the target, and its entries (all, unless given)."""
    if not local.exists():
        dangling = " (a link to nothing)" if local.is_symlink() else ""
        raise UsageError(f"{local}: no such file or directory{dangling}")
    dest = remote_path(machine, remote)
    if local.is_dir():
        return dest, entries if entries is not None else scan(local)
    name = local.name if remote.endswith("/") else posixpath.basename(dest)
    base = dest if remote.endswith("/") else posixpath.dirname(dest)
    real = local.resolve()
    return base, entries if entries is not None else [_entry(real, name, real.stat())]


@dataclass
class Changes:
    """What a copy has to send: the entries that differ in the target, and how many files
    are the same there already."""

    dest: str
    changed: list[Entry]
    unchanged: int


def push(
    machine: Machine,
    local: Path,
    remote: str,
    *,
    checksum: bool = False,
    progress: Meter | None = None,
) -> tuple[Changes, Sent]:
    """Copy what differs of `local` into `remote` (created with its parents), then verify, in
    one call: the receiver first says what it holds of each path, then only what differs
    follows. Files are compared by size, mtime and mode (rsync's quick check), or by sha256 on
    both sides with `checksum`; links by target, directories by mode. `progress` learns its
    total once that answer has come. Under --dry-run nothing is read there: all is sent."""
    base, entries = _layout(machine, local, remote)
    dest = remote_path(machine, remote)
    if checksum:
        for e in entries:
            if e.kind == "f":
                e.sha256 = _sha256(e.path)
    receive = helpers.argv("receive.py", base, "--offer", *(["--sha256"] if checksum else []))
    if machine.dry_run:
        stream(machine, receive)  # shown, not run
        return _changes(dest, entries, {}, checksum), Sent(entries, sum(e.size for e in entries))
    answer = _Answer()
    todo: list[Changes] = []

    def offer_then_tar() -> Iterator[bytes]:
        yield json.dumps({"offer": [e.rel for e in entries], "checksum": checksum}).encode() + b"\n"
        theirs = answer.wait()
        if theirs is None:
            return  # the receiver ended without answering: its exit code says why
        todo.append(_changes(dest, entries, theirs, checksum))
        if progress is not None:
            progress.set_total(sum(e.size for e in todo[0].changed))
        yield from tar_stream(todo[0].changed, progress, sha256=checksum)

    result = stream(machine, receive, stdin=offer_then_tar(), stdout=answer, watch_sink=True)
    helpers.check(machine, result, f"copy into {base}", TransferError)
    if not todo:
        raise TransferError(f"{machine.name}: the receiver in {base} did not say what it holds")
    sent = todo[0].changed
    check_arrived(machine, base, sent, answer.rest())
    return todo[0], Sent(sent, sum(e.size for e in sent), receiver_warnings(result))


class _Answer:
    """The receiver's stdout during a push: its first line (what it holds) is awaited by the
    sending side; the rest is its report."""

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.held: dict | None = None
        self.done = threading.Event()

    def __call__(self, chunk: bytes) -> None:
        self.buffer += chunk
        if self.held is None and b"\n" in self.buffer:
            line, _, rest = bytes(self.buffer).partition(b"\n")
            self.buffer = bytearray(rest)
            try:
                self.held = json.loads(line)
            except ValueError:
                self.held = {}
            self.done.set()

    def ended(self) -> None:
        self.done.set()

    def wait(self) -> dict | None:
        self.done.wait()
        return self.held

    def rest(self) -> dict:
        try:
            return json.loads(self.buffer) if self.buffer.strip() else {}
        except ValueError:
            return {}


def _changes(dest: str, entries: list[Entry], theirs: dict, checksum: bool) -> Changes:
    changed = [e for e in entries if not _same(e, theirs.get(e.rel, {"t": "-"}), checksum)]
    files = sum(1 for e in entries if e.kind == "f")
    unchanged = files - sum(1 for e in changed if e.kind == "f")
    return Changes(dest, changed, unchanged)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def stream(
    machine: Machine,
    argv: list[str],
    *,
    stdin: Stdin = None,
    stdout: Sink | None = None,
    watch_sink: bool = False,
) -> Result:
    """Run `argv` in `machine` with bulk bytes in or out: the one place they travel."""
    return machine.run(argv, stdin=stdin, stdout=stdout, bulk=True, watch_sink=watch_sink)


def receiver_warnings(result: Result) -> list[str]:
    """The receiver's warnings (bits it dropped), from its stderr."""
    lines = result.stderr.decode("utf-8", "replace").splitlines()
    return [line.removeprefix("receive: warning: ") for line in lines if "warning: " in line]


def check_arrived(machine: Machine, base: str, entries: list[Entry], found: dict) -> None:
    """Compare what was sent with what the target read back from its own disk."""
    bad = [e.rel for e in entries if not _matches(e, found.get(e.rel, {"t": "-"}))]
    digest = (
        "crc32" if any("crc32" in f for f in found.values() if isinstance(f, dict)) else "sha256"
    )
    if bad:
        shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise TransferError(
            f"{machine.name}: {len(bad)} of {len(entries)} paths under {base} differ after the "
            f"copy ({digest}): {shown}; the copy is not trustworthy: run it again"
        )


def _matches(entry: Entry, found: dict) -> bool:
    """`found` (the receiver's report, or hashtree's description) is `entry`: for a file its
    size and digest (the receiver's CRC-32 or sha256, hashtree's sha256)."""
    if found.get("t") != entry.kind or found.get("placed") is False:
        return False
    if entry.kind == "f":
        digest = ("crc32", entry.crc32) if "crc32" in found else ("sha256", entry.sha256)
        return found.get(digest[0]) == digest[1] and found.get("size") == entry.size
    if entry.kind == "l":
        return found.get("to") == entry.link
    return True


def _same(entry: Entry, found: dict, checksum: bool = False) -> bool:
    """True when `found` (hashtree's description) is `entry` already."""
    if entry.kind == "l" or found.get("t") != entry.kind:
        return _matches(entry, found)
    if found.get("mode") != entry.mode:
        return False
    if entry.kind == "f" and checksum:
        return _matches(entry, found)
    if entry.kind == "f":
        mtime = int(entry.path.stat().st_mtime)
        return (found.get("size"), found.get("mtime")) == (entry.size, mtime)
    return True


def get_file(machine: Machine, remote: str, local: Path) -> int:
    """Copy one file out of the target (a link is followed), verified by sha256 against the
    target's own hash of it; `local` appears only once the copy is verified."""
    src = remote_path(machine, remote)
    local.parent.mkdir(parents=True, exist_ok=True)
    # unique: two copies into one place never share it
    partial = local.with_name(f".{local.name}.{os.getpid()}-{secrets.token_hex(4)}.part")
    digest = hashlib.sha256()
    size = 0
    try:
        with open(partial, "xb") as f:

            def take(chunk: bytes) -> None:
                nonlocal size
                digest.update(chunk)
                size += len(chunk)
                f.write(chunk)

            result = stream(machine, ["cat", "--", src], stdout=take)
        if machine.dry_run:
            return 0
        if not result.ok:
            raise TransferError(f"{machine.name}: cannot read {src}: {result.error_text}")
        name = posixpath.basename(src)
        theirs = describe_remote(machine, posixpath.dirname(src), [name], follow=True)[name]
        if theirs.get("sha256") != digest.hexdigest() or theirs.get("size") != size:
            raise TransferError(f"{machine.name}: {src} changed or was corrupted while copied out")
        partial.replace(local)
    finally:
        partial.unlink(missing_ok=True)
    return size


def read_text(machine: Machine, remote: str) -> str:
    """A small remote text file, or an error naming it."""
    buffer = io.BytesIO()
    result = machine.run(["cat", "--", remote_path(machine, remote)], stdout=buffer.write)
    if not result.ok:
        raise OpsError(f"{machine.name}: cannot read {remote}: {result.error_text}")
    return buffer.getvalue().decode("utf-8", "replace")


@dataclass
class Synced:
    sent: list[Entry]
    unchanged: int
    deleted: list[str]


def sync(
    machine: Machine,
    local: Path,
    remote: str,
    *,
    skip: Callable[[str], bool] = lambda rel: False,
    progress: Progress | None = None,
) -> Synced:
    """Make `remote` hold exactly the local tree: send changed paths only, delete stale ones."""
    dest = remote_path(machine, remote)
    entries = [e for e in scan(local) if not skip(e.rel)]
    # rsync's quick check: a file of the same size and mtime is taken as unchanged; what is
    # sent is verified as always
    theirs = describe_remote(machine, dest, None, quick=True)
    todo = _changes(dest, entries, theirs, checksum=False)
    changed = todo.changed
    kinds = {e.rel: e.kind for e in entries}

    def stale_there(rel: str, found: dict) -> bool:
        """Gone here, or changed between file, directory and link: removed there first."""
        return not skip(rel) and kinds.get(rel) != found["t"]

    stale = sorted(rel for rel, found in theirs.items() if stale_there(rel, found))
    stale = [rel for rel in stale if not any(rel.startswith(s + "/") for s in stale)]
    if stale:
        result = machine.run(["rm", "-rf", "--", *(posixpath.join(dest, rel) for rel in stale)])
        if not result.ok:
            raise OpsError(f"{machine.name}: could not remove stale files: {result.error_text}")
    if changed or not theirs:
        put(machine, local, remote, progress=progress, entries=changed)
    return Synced(sent=changed, unchanged=todo.unchanged, deleted=stale)
