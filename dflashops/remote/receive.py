"""Runs inside a target with its python3 (stdlib only): unpack a tar stream nobody vouches for,
hashing each file's bytes as they are written.

argv: BASE [--sha256]          a copy (push, sync): regular files, directories and symlinks
      BASE --unsealed          a copy from a plain `tar -c` (a relay between targets): files land
                               once written, with no seal to wait for
      BASE --offer [--sha256]  the same, after saying what BASE holds of the sender's paths
      BASE --checkpoint FINAL  a checkpoint into its partial directory BASE, then placed at FINAL
      BASE --plan FINAL        which files of the partial directory BASE verify already

The stream is refused (exit 1, the entry named) at the first entry that has an absolute name,
a "..", a NUL or a name longer than the file system takes; that appears twice; that would go
through a link or a file sent earlier in the stream; or that is not a regular file, directory
or symlink (hard links, devices, fifos...; for a checkpoint, only the regular files its manifest
lists). A malformed stream (bad header checksum, oversized pax header) is refused too.
setuid, setgid and sticky bits are dropped with a warning on stderr; owners are never taken
from the stream, and nothing is written through a link already at the destination.

Each file is written under a name unique to this receiver (.dfo-PID-RANDOM.part in its
directory), hashed as it is written (on threads of their own), its size on disk checked, and only
then renamed into place: two receivers into one directory never mix their bytes, and a failure
removes the file it was writing. In a copy, each file's data is followed by the sender's seal (a
pax global header with the digest and size it read): the file is renamed into place only when
the seal agrees with what was written here, so a file corrupted on the way never reaches its
name (the report lists it with "placed": false). A checkpoint's files are hashed with sha256 (its manifest's);
a copy's with CRC-32 (the sender's in-flight check of the same bytes, a tenth of sha256's CPU;
the bytes travel over SSH, which authenticates them), or sha256 with --sha256.
stdout (a copy): {path: {"t": "f", "crc32" (or "sha256"): hex, "size": n, "mode": m} | {"t":
"l", "to": target} | {"t": "d"}}.

An offer (push: what differs, in one call): stdin starts with one JSON line {"offer": [path,
...], "checksum": bool}; the receiver answers with one line on stdout, {path: what BASE holds
there} as describe.py says it (sha256 only with checksum, else size and mtime), and then takes
the tar of what the sender found different, as a copy does.

A checkpoint: stdin starts with one JSON line {"manifest": TEXT} (its MANIFEST.sha256), then
the tar. BASE is the one partial directory of FINAL: a receiver holds a lock (flock) on it
while it writes; each file that matches the manifest is noted in BASE/.dflashops-verified, so
an interrupted copy resumes where it stopped; once every file verifies, the manifest is
written and BASE is renamed to FINAL (a bad copy at FINAL is swapped out first), never into
it. Partial directories nobody holds and nobody touched for a day are removed; a full disk
removes BASE. stdout: {"placed": true | "already" | false, "verified": {name: sha256},
"received": [...], "kept": [...], "bad": [...], "stale": [{"path": p, "bytes": n}]}.
"""

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import queue
import re
import secrets
import shutil
import signal
import stat
import sys
import threading
import time
import zlib

from dflashops.remote.describe import describe
from dflashops.remote.layout import MANIFEST
from dflashops.remote.shared import flock_now

BLOCK = 512
CHUNK = 1 << 20
BUFFERS = 8  # chunks read ahead of the writer and the hasher
PAX_LIMIT = 1 << 20
NAME_MAX, PATH_MAX = 255, 4096
MARKER = ".dflashops-verified"
SEAL_DIGEST, SEAL_SIZE = "DFLASHOPS.digest", "DFLASHOPS.size"  # transfer.py's seal()
PART = re.compile(r"^\.dfo-(\d+)-[0-9a-f]+\.part$")
PARTIAL = re.compile(r"^\.(partial|tmp|old)-step_\d+")
SHA256 = re.compile(r"^[0-9a-f]{64}$")
PART_STALE_AFTER = 600  # a .part of a receiver that is gone, untouched this long
STALE_AFTER = 24 * 3600  # a partial directory nobody holds, untouched this long
LOCK_PATIENCE = 60  # waiting for another copy into the same partial directory, while it writes
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
KINDS = {
    b"0": "file", b"\0": "file", b"1": "hard link", b"2": "symlink", b"3": "character device",
    b"4": "block device", b"5": "directory", b"6": "fifo", b"7": "contiguous file",
}  # fmt: skip
COPYABLE = ("file", "directory", "symlink")


class Crc32:
    """zlib's CRC-32 with hashlib's face (update, hexdigest, name)."""

    name = "crc32"

    def __init__(self):
        self.value = 0

    def update(self, data):
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self):
        return f"{self.value:08x}"


class Refused(Exception):
    """A stream we do not take (hostile or malformed): nothing more of it is read."""


class Failed(Exception):
    """The copy could not be done here (the message says why)."""


def warn(text):
    sys.stderr.write(f"receive: warning: {text}\n")


def unlink(path):
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


# ---------------------------------------------------------------- the tar stream


def read_exact(stream, n):
    parts, left = [], n
    while left:
        chunk = stream.read(min(left, CHUNK))
        if not chunk:
            raise EOFError("the tar stream ended early")
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def read_into(stream, view):
    """Read exactly len(view) bytes of a file's data into `view`; its length."""
    got = 0
    while got < len(view):
        n = stream.readinto(view[got:])
        if not n:
            raise EOFError("the tar stream ended inside a file")
        got += n
    return got


def octal(field, what):
    text = field.rstrip(b"\0 ").strip()
    try:
        return int(text, 8) if text else 0
    except ValueError:
        raise Refused(f"a malformed tar header ({what} {field!r})") from None


def pax_records(data):
    out, pos = {}, 0
    try:
        while pos < len(data):
            space = data.index(b" ", pos)
            length = int(data[pos:space])
            record = data[space + 1 : pos + length]
            if length <= space - pos or not record.endswith(b"\n"):
                raise ValueError
            key, eq, value = record[:-1].partition(b"=")
            if not eq:
                raise ValueError
            out[key.decode()] = value
            pos += length
    except ValueError:  # UnicodeDecodeError is one
        raise Refused("a malformed pax extended header") from None
    return out


def checksum_ok(header):
    """The header's checksum, with its own field as spaces: unsigned, or signed as some old
    tars wrote it."""
    stored = octal(header[148:156], "checksum")
    rest = header[:148] + header[156:]
    if stored == sum(rest) + 8 * 32:
        return True
    return stored == sum(b - 256 if b > 127 else b for b in rest) + 8 * 32


class Seal:
    """The sender's digest and size of the file just sent, in a pax global header after its
    data (a copy's stream: the sender learns them only as it reads the file)."""

    def __init__(self, records):
        self.digest = records.get(SEAL_DIGEST, b"").decode("ascii", "replace")
        try:
            self.size = int(records.get(SEAL_SIZE, b"-1"))
        except ValueError:
            raise Refused("a malformed seal (pax global header) in the stream") from None


class Member:
    def __init__(self, name, kind, size, mode, mtime_ns, link):
        self.name, self.kind, self.size = name, kind, size
        self.mode, self.mtime_ns, self.link = mode, mtime_ns, link

    @property
    def word(self):
        return KINDS.get(self.kind, f"entry of type {self.kind!r}")


def members(stream):
    """The stream's entries (and a copy's seals), up to its end-of-archive block. The caller
    reads each file's data (and its padding) before asking for the next entry."""
    pax, offset = {}, 0
    while True:
        header = read_exact(stream, BLOCK)
        if header == b"\0" * BLOCK:
            return
        if not checksum_ok(header):
            raise Refused(f"not a tar stream (bad header checksum at entry {offset})")
        kind, size = header[156:157], octal(header[124:136], "size")
        if kind in (b"x", b"g"):
            if size > PAX_LIMIT:
                raise Refused(f"a pax header of {size} bytes (at most {PAX_LIMIT})")
            data = read_exact(stream, size + (-size % BLOCK))[:size]
            if kind == b"x":
                pax = pax_records(data)
            elif SEAL_DIGEST in (records := pax_records(data)):
                yield Seal(records)
            continue
        offset += 1
        name = header[0:100].split(b"\0", 1)[0]
        prefix = header[345:500].split(b"\0", 1)[0] if header[257:263] == b"ustar\0" else b""
        name = pax.get("path", prefix + b"/" + name if prefix else name)
        link = pax.get("linkpath", header[157:257].split(b"\0", 1)[0])
        try:
            size = int(pax["size"]) if "size" in pax else size
            mtime = pax.get("mtime", header[136:148].rstrip(b"\0 ").strip() or b"0")
            mtime_ns = int(float(mtime) * 1e9) if "mtime" in pax else int(mtime, 8) * 10**9
        except ValueError:
            raise Refused("a malformed size or mtime in a tar header") from None
        if size < 0:
            raise Refused("a negative size in a tar header")
        mode = octal(header[100:108], "mode")
        text = name.decode("utf-8", "surrogateescape")
        yield Member(text, kind, size, mode, mtime_ns, link.decode("utf-8", "surrogateescape"))
        pax = {}


def check_name(name):
    """(parts, rel) of a stream name, None for the root itself; refused unless it is a plain
    relative name the file system can hold."""
    shown = name if len(name) <= 120 else name[:60] + "..." + name[-40:]
    if "\0" in name:
        raise Refused(f"{shown!r}: a NUL in a name")
    if name.startswith("/"):
        raise Refused(f"{shown!r}: an absolute name")
    if ".." in name.split("/"):
        raise Refused(f"{shown!r}: a '..' in a name")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if not parts:
        return None
    sizes = [len(p.encode("utf-8", "surrogateescape")) for p in parts]
    if max(sizes) > NAME_MAX or sum(sizes) + len(sizes) > PATH_MAX:
        raise Refused(f"{shown!r}: a name longer than the file system takes")
    return parts, "/".join(parts)


# ---------------------------------------------------------------- writing what arrives


def real_dirs(base, parts):
    """Make base/parts[0]/.../parts[-2] real directories: a symlink or a file in the way is
    replaced (the stream says a directory is there), so nothing is written through a link."""
    path = base
    for part in parts[:-1]:
        path = os.path.join(path, part)
        if os.path.islink(path) or (os.path.lexists(path) and not os.path.isdir(path)):
            os.unlink(path)
        if not os.path.isdir(path):
            os.mkdir(path)
    return os.path.join(path, parts[-1])


def make_dir(path, mode):
    if os.path.islink(path) or (os.path.lexists(path) and not os.path.isdir(path)):
        os.unlink(path)
    os.makedirs(path, exist_ok=True)
    os.chmod(path, mode)


def make_link(path, to):
    if os.path.isdir(path) and not os.path.islink(path):
        raise IsADirectoryError(f"{path} is a directory; a link cannot replace it")
    unlink(path)
    os.symlink(to, path)


def pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def sweep_parts(folder, everything=False):
    """Remove .part files of receivers that are gone (all of them when `everything`: the
    caller holds the folder's lock)."""
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        m = PART.match(name)
        if not m or int(m.group(1)) == os.getpid():
            continue
        path = os.path.join(folder, name)
        try:
            idle = time.time() - os.lstat(path).st_mtime
        except OSError:
            continue
        if everything or (idle > PART_STALE_AFTER and not pid_alive(int(m.group(1)))):
            unlink(path)


class Unpacker:
    """Unpacks a stream under `base`. Subclasses say what they accept and how a file lands.
    Each chunk of a file is read into one of a few buffers allocated once, and passes three
    threads: this one reads it from the stream, a writer writes it to the file, a hasher
    hashes it and gives the buffer back (the reads, writes, hashlib and zlib all let go of the
    GIL, so the three overlap on as many cores as there are). No memory is allocated per chunk
    (fresh pages cost more than the copy itself, most of all in a VM). The writer checks a
    file's size on disk once its last chunk is written; the hasher lands it once hashed (where
    files are `sealed`, once the seal that follows its data in the stream agrees)."""

    durable = False  # fsync each file before it lands
    sealed = False  # each file is followed by the sender's Seal and lands only if they agree
    new_digest = hashlib.sha256

    def __init__(self, base):
        self.base = base
        self.seen = {}
        self.swept = set()
        self.writes = queue.Queue()  # (Part, buffer, size), a Part whose bytes all came, None
        self.hashes = queue.Queue()  # (digest, buffer, size), a Written, None
        self.free = queue.Queue()  # at most BUFFERS chunks are in flight: each holds a buffer
        for _ in range(BUFFERS):
            self.free.put(bytearray(CHUNK))
        self.error = None
        self.unsealed = None  # the Written waiting for its seal
        self.threads = [threading.Thread(target=loop, daemon=True)
                        for loop in (self.writer, self.hasher)]  # fmt: skip

    def run(self, stream):
        for thread in self.threads:
            thread.start()
        try:
            for member in members(stream):
                self.check_threads()
                if isinstance(member, Seal):
                    self.writes.put(member)  # after its file, through the writer to the hasher
                else:
                    self.entry(stream, member)
        finally:
            self.writes.put(None)
            for thread in self.threads:
                thread.join()
        self.check_threads()

    def check_threads(self):
        if self.error is not None:
            raise self.error

    def fail(self, exc):
        if self.error is None:
            self.error = exc

    def writer(self):
        while (job := self.writes.get()) is not None:
            if isinstance(job, tuple):
                part, buffer, size = job
                try:
                    if self.error is None:
                        part.write(memoryview(buffer)[:size])
                        self.hashes.put((part.digest, buffer, size))
                        continue
                except BaseException as exc:  # noqa: BLE001 (raised on the main thread)
                    self.fail(exc)
                self.free.put(buffer)
            elif isinstance(job, Seal):
                self.hashes.put(job)
            else:
                try:
                    if self.error is None and not job.abandoned:
                        self.hashes.put(job.finish(self.durable))
                        continue
                except BaseException as exc:  # noqa: BLE001 (raised on the main thread)
                    self.fail(exc)
                job.discard()
        self.hashes.put(None)

    def hasher(self):
        while (job := self.hashes.get()) is not None:
            if isinstance(job, tuple):
                digest, buffer, size = job
                if self.error is None:
                    digest.update(memoryview(buffer)[:size])
                self.free.put(buffer)
            elif isinstance(job, Seal):
                self.unseal(job)
            elif self.sealed:
                self.unseal(None)  # a file whose seal never came
                self.unsealed = job
            else:
                self.land_or_drop(job)
        self.unseal(None)

    def unseal(self, seal):
        """Land the file waiting for `seal` if the seal agrees with what was written; else
        it never reaches its name (`refuse_seal` says so)."""
        job, self.unsealed = self.unsealed, None
        if job is None:
            return
        info = job.info()
        if seal is not None and (seal.digest, seal.size) == (info[job.digest.name], info["size"]):
            self.land_or_drop(job)
            return
        unlink(job.tmp)
        self.refuse_seal(job.rel, info)

    def land_or_drop(self, job):
        try:
            if self.error is None:
                self.land(job.rel, job.tmp, job.path, job.info())
        except BaseException as exc:  # noqa: BLE001 (raised on the main thread)
            self.fail(exc)
        finally:
            unlink(job.tmp)

    def entry(self, stream, member):
        checked = check_name(member.name)
        if checked is None:
            if member.word != "directory":
                raise Refused(f"a {member.word} with no name")
            return  # the root itself ("./")
        parts, rel = checked
        if rel in self.seen:
            raise Refused(f"{rel}: appears twice in the stream")
        for i in range(1, len(parts)):
            above = "/".join(parts[:i])
            if self.seen.get(above) in ("symlink", "file"):
                raise Refused(
                    f"{rel}: would be written through the {self.seen[above]} {above} sent "
                    "earlier in the stream"
                )
        self.accept(rel, member)
        self.seen[rel] = member.word
        if member.mode & 0o7000:
            warn(f"{rel}: setuid, setgid and sticky bits dropped (mode {member.mode & 0o7777:o})")
        mode = member.mode & 0o777
        path = real_dirs(self.base, parts)
        if member.word == "directory":
            make_dir(path, mode)
            self.landed_dir(rel)
        elif member.word == "symlink":
            make_link(path, member.link)
            self.landed_link(rel, path)
        else:
            self.write(stream, rel, path, member, mode)

    def accept(self, rel, member):
        """Raise Refused for an entry this copy does not take."""
        raise NotImplementedError

    def land(self, rel, tmp, path, info):
        """Put file `tmp` (hashed: `info`) in place at `path`, or not."""
        raise NotImplementedError

    def refuse_seal(self, rel, info):
        """A sealed file (hashed: `info`) did not agree with its seal, or had none: not placed."""

    def landed_dir(self, rel):
        """A directory arrived (for a subclass's report)."""

    def landed_link(self, rel, path):
        """A symlink arrived (for a subclass's report)."""

    def write(self, stream, rel, path, member, mode):
        """Read a file's data into buffers for the writer, which writes them to a .part file
        beside `path`; the hasher lands it."""
        if os.path.isdir(path) and not os.path.islink(path):
            raise IsADirectoryError(
                f"{path} is a directory: to copy into it, end the destination with /"
            )
        folder = os.path.dirname(path)
        if folder not in self.swept:
            self.swept.add(folder)
            sweep_parts(folder)
        tmp = os.path.join(folder, f".dfo-{os.getpid()}-{secrets.token_hex(6)}.part")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        part = Part(rel, tmp, path, member, mode, self.new_digest())
        try:
            part.fd = os.open(tmp, flags, 0o600)
            left = member.size
            while left:
                buffer = self.free.get()
                self.check_threads()
                try:
                    size = read_into(stream, memoryview(buffer)[: min(left, CHUNK)])
                except BaseException:
                    self.free.put(buffer)
                    raise
                self.writes.put((part, buffer, size))
                left -= size
        except BaseException as exc:
            part.abandoned = True
            if isinstance(exc, OSError) and exc.filename in (None, tmp):
                raise OSError(exc.errno, exc.strerror, path) from None
            raise
        finally:
            self.writes.put(part)  # the writer finishes it, or closes and removes it
        pad = -member.size % BLOCK
        if pad:
            read_exact(stream, pad)


class Part:
    """A file being written to its .part file by the writer thread."""

    def __init__(self, rel, tmp, path, member, mode, digest):
        self.rel, self.tmp, self.path, self.member, self.mode = rel, tmp, path, member, mode
        self.digest = digest
        self.fd = None
        self.abandoned = False

    def write(self, view):
        try:
            while view:
                view = view[os.write(self.fd, view) :]
        except OSError as exc:
            raise OSError(exc.errno, exc.strerror, self.path) from None

    def finish(self, durable):
        """Close the file once its last chunk is written: a Written to land."""
        try:
            if durable:
                os.fsync(self.fd)
            on_disk = os.fstat(self.fd).st_size
            os.close(self.fd)
            self.fd = None
            os.chmod(self.tmp, self.mode)
            mtime = self.member.mtime_ns
            os.utime(self.tmp, ns=(mtime, mtime))
        except OSError as exc:
            self.discard()
            raise OSError(exc.errno, exc.strerror, self.path) from None
        return Written(self.rel, self.tmp, self.path, self.digest, on_disk)

    def discard(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        unlink(self.tmp)


class Written:
    """A file written to its .part file: landed once its last chunk is hashed."""

    def __init__(self, rel, tmp, path, digest, size):
        self.rel, self.tmp, self.path, self.digest, self.size = rel, tmp, path, digest, size

    def info(self):
        return {"t": "f", self.digest.name: self.digest.hexdigest(), "size": self.size}


# ---------------------------------------------------------------- a copy (push, sync)


class CopyUnpacker(Unpacker):
    new_digest = Crc32
    sealed = True

    def __init__(self, base, sha256=False, sealed=True):
        super().__init__(base)
        self.found = {}
        self.sealed = sealed
        if sha256:
            self.new_digest = hashlib.sha256

    def accept(self, rel, member):
        if member.word not in COPYABLE:
            raise Refused(
                f"{rel}: a {member.word} is refused (only regular files, directories and "
                "symlinks are copied)"
            )

    def land(self, rel, tmp, path, info):
        os.replace(tmp, path)
        self.found[rel] = {**info, "mode": os.lstat(path).st_mode & 0o7777}

    def refuse_seal(self, rel, info):
        self.found[rel] = {**info, "placed": False}

    def landed_dir(self, rel):
        self.found[rel] = {"t": "d"}

    def landed_link(self, rel, path):
        self.found[rel] = {"t": "l", "to": os.readlink(path)}


def receive_copy(base, stream, sha256=False, sealed=True):
    os.makedirs(base, exist_ok=True)
    unpacker = CopyUnpacker(base, sha256, sealed)
    unpacker.run(stream)
    return unpacker.found


# ---------------------------------------------------------------- a checkpoint


def header_line(stream):
    """The stream's first line (a JSON document in front of the tar)."""
    line = stream.readline(16 * PAX_LIMIT + 1)
    if len(line) > 16 * PAX_LIMIT:
        raise Refused("a header line longer than 16 MiB")
    if not line.endswith(b"\n"):
        raise EOFError("the stream ended before its header line")
    return line


def answer_offer(base, stream):
    """Say on stdout what BASE holds of the paths the header line offers."""
    try:
        doc = json.loads(header_line(stream))
        rels, checksum = doc["offer"], doc.get("checksum") is True
        if not all(isinstance(rel, str) for rel in rels):
            raise TypeError
    except (ValueError, KeyError, TypeError, AttributeError):
        raise Refused(
            'the stream does not start with a header line {"offer": [PATH, ...]}'
        ) from None
    for rel in rels:
        check_name(rel)  # a path under BASE, or refused
    held = {rel: describe(base, rel, quick=not checksum) for rel in rels}
    sys.stdout.write(json.dumps(held) + "\n")
    sys.stdout.flush()


def read_manifest(stream):
    """The manifest from the stream's first line: {name: sha256} and its text."""
    line = header_line(stream)
    try:
        text = json.loads(line)["manifest"]
    except (ValueError, KeyError, TypeError):
        text = None
    if not isinstance(text, str):
        raise Refused('the stream does not start with a header line {"manifest": TEXT}')
    entries = {}
    for line in text.splitlines():
        digest, sep, name = line.partition("  ")
        name = name[1:] if name.startswith("*") else name
        if not sep or not SHA256.match(digest) or check_name(name) is None:
            raise Refused(f"{MANIFEST} is not in sha256sum format: {line[:120]!r}")
        if name in entries or name in (MANIFEST, MARKER):
            raise Refused(f"{MANIFEST} lists {name} twice, or a name it cannot list")
        entries[name] = digest
    if not entries:
        raise Refused(f"{MANIFEST} is empty")
    return entries, text


def load_verified(base, manifest):
    """{name: sha256} of the files of BASE noted as verified that are still as they were."""
    try:
        with open(os.path.join(base, MARKER), encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, ValueError):
        return {}
    out = {}
    for line in lines:
        try:
            rec = json.loads(line)
            name, digest = rec["name"], rec["sha256"]
            if manifest.get(name) != digest:
                continue
            st = os.lstat(os.path.join(base, name))
        except (ValueError, KeyError, TypeError, OSError):
            continue  # a torn last line, a file gone since
        if stat.S_ISREG(st.st_mode) and [st.st_size, st.st_mtime_ns] == [
            rec.get("size"),
            rec.get("mtime_ns"),
        ]:
            out[name] = digest
    return out


def tree_bytes(path):
    total = 0
    for root, _dirs, names in os.walk(path):
        for name in names:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def activity(path):
    """What changes while someone writes under `path`: the newest mtime and the total size."""
    newest, total = 0, 0
    for root, _dirs, names in os.walk(path):
        for name in [".", *names]:
            try:
                st = os.lstat(os.path.join(root, name))
            except OSError:
                continue
            newest, total = max(newest, st.st_mtime_ns), total + st.st_size
    return newest, total


def try_lock(path):
    """An fd holding an exclusive flock on directory `path`, or None when someone holds it."""
    return flock_now(os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC))


def sweep_partials(root, keep):
    """Remove partial directories under ROOT/*/ that nobody holds and nobody touched for a day
    (copies cut short long ago, also ones left by older versions)."""
    removed = []
    try:
        runs = os.listdir(root)
    except OSError:
        return removed
    for run in runs:
        folder = os.path.join(root, run)
        try:
            names = os.listdir(folder) if not os.path.islink(folder) else []
        except OSError:
            continue
        for name in names:
            path = os.path.join(folder, name)
            if path == keep or not PARTIAL.match(name) or os.path.islink(path):
                continue
            if not os.path.isdir(path) or time.time() - activity(path)[0] / 1e9 < STALE_AFTER:
                continue
            fd = try_lock(path)
            if fd is None:
                continue
            try:
                size = tree_bytes(path)
                shutil.rmtree(path, ignore_errors=True)
            finally:
                os.close(fd)
            removed.append({"path": path, "bytes": size})
    return removed


def holds_manifest(final, text):
    try:
        with open(os.path.join(final, MANIFEST), "rb") as f:
            return f.read() == text.encode()
    except OSError:
        return False


def lock_partial(base, final, text):
    """Hold BASE's lock (made if missing); None when another copy put FINAL in place while we
    waited."""
    for _ in range(10):
        with contextlib.suppress(FileExistsError):
            os.mkdir(base, 0o700)
        try:
            fd = wait_for_lock(base)
        except FileNotFoundError:
            fd = None  # BASE was renamed (placed) or removed meanwhile
        if fd is not None:
            if same_file(fd, base):
                return fd
            os.close(fd)
        if holds_manifest(final, text):
            return None
    raise Failed(f"{base} keeps being replaced by other copies; run this again")


def same_file(fd, path):
    try:
        here = os.lstat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (here.st_dev, here.st_ino) == (held.st_dev, held.st_ino)


def wait_for_lock(base):
    """An fd holding BASE's lock; a copy that holds it is waited for while it writes."""
    seen, since = activity(base), time.monotonic()
    while (fd := try_lock(base)) is None:
        now = activity(base)
        if now != seen:
            seen, since = now, time.monotonic()
        elif time.monotonic() - since > LOCK_PATIENCE:
            raise Failed(
                f"another copy into {base} holds it and wrote nothing for {LOCK_PATIENCE} s; "
                "run this again when it has ended"
            )
        time.sleep(0.2)
    return fd


def rename_noreplace(old, new):
    """Rename `old` to `new` only if `new` does not exist (never into it)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (ImportError, OSError, AttributeError):
        renameat2 = None
    if renameat2 is not None:
        at_fdcwd, noreplace = -100, 1
        if renameat2(at_fdcwd, os.fsencode(old), at_fdcwd, os.fsencode(new), noreplace) == 0:
            return
        code = ctypes.get_errno()
        if code not in (errno.EINVAL, errno.ENOSYS):
            raise OSError(code, os.strerror(code), new)
    if os.path.lexists(new):  # no renameat2 here: the caller's lock keeps other copies out
        raise FileExistsError(errno.EEXIST, "exists already", new)
    os.rename(old, new)


def place(base, final):
    """Rename BASE to FINAL, swapping out whatever is at FINAL, under the lock of their parent
    (so two copies of one checkpoint finish one after the other)."""
    parent = os.path.dirname(final)
    fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    old = None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        if os.path.lexists(final):
            old = os.path.join(parent, f".old-{os.path.basename(final)}-{secrets.token_hex(4)}")
            os.rename(final, old)
        try:
            rename_noreplace(base, final)
        except OSError:
            if old is not None and not os.path.lexists(final):
                os.rename(old, final)
                old = None
            raise
    finally:
        os.close(fd)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


class CheckpointUnpacker(Unpacker):
    """Files the manifest lists; each one that verifies is noted in BASE's marker file."""

    durable = True

    def __init__(self, base, manifest, verified):
        super().__init__(base)
        self.manifest, self.verified = manifest, verified
        self.received, self.bad = [], []
        self.marker = open(os.path.join(base, MARKER), "a", encoding="utf-8")  # noqa: SIM115

    def accept(self, rel, member):
        if member.word != "file":
            raise Refused(f"{rel}: a {member.word} in a checkpoint (only regular files)")
        if rel not in self.manifest:
            raise Refused(f"{rel}: not in the checkpoint's {MANIFEST}")

    def land(self, rel, tmp, path, info):
        if info["sha256"] != self.manifest[rel]:
            self.bad.append(rel)  # the .part is removed: the next try sends it again
            return
        os.replace(tmp, path)
        st = os.lstat(path)
        record = {"name": rel, "sha256": info["sha256"], "size": st.st_size,
                  "mtime_ns": st.st_mtime_ns}  # fmt: skip
        self.marker.write(json.dumps(record) + "\n")
        self.marker.flush()
        os.fsync(self.marker.fileno())
        self.verified[rel] = info["sha256"]
        self.received.append(rel)


def tidy(base, manifest):
    """Remove from BASE what the manifest does not list (left by a copy of another version)."""
    keep = set(manifest) | {MARKER}
    above = {"/".join(n.split("/")[:i]) for n in manifest for i in range(1, n.count("/") + 1)}
    for root, dirs, names in os.walk(base):
        for name in dirs + names:
            path = os.path.join(root, name)
            rel = os.path.relpath(path, base).replace(os.sep, "/")
            if rel in keep or rel in above:
                continue
            if name in dirs and not os.path.islink(path):
                shutil.rmtree(path)
                dirs.remove(name)
            else:
                unlink(path)


def write_manifest(base, text):
    tmp = os.path.join(base, f".dfo-{os.getpid()}-{secrets.token_hex(6)}.part")
    with open(tmp, "wb") as f:
        f.write(text.encode())
        f.flush()
        os.fsync(f.fileno())
    os.chmod(tmp, 0o644)
    os.replace(tmp, os.path.join(base, MANIFEST))


def receive_checkpoint(base, final, stream):
    manifest, text = read_manifest(stream)
    os.makedirs(os.path.dirname(base), exist_ok=True)
    stale = sweep_partials(os.path.dirname(os.path.dirname(final)), keep=base)
    fd = lock_partial(base, final, text)
    if fd is None:
        return {"placed": "already", "verified": dict(manifest), "received": [], "kept": [],
                "bad": [], "stale": stale}  # fmt: skip
    try:
        return {**fill(base, final, stream, manifest, text), "stale": stale}
    except OSError as exc:
        if exc.errno not in NO_SPACE:
            raise
        shutil.rmtree(base, ignore_errors=True)
        raise Failed(
            f"no space left on the device of {base} (writing {exc.filename}); "
            "the partial copy was removed, nothing was kept"
        ) from None
    finally:
        os.close(fd)


def fill(base, final, stream, manifest, text):
    """Receive into BASE (whose lock the caller holds) what is not there yet; place it once
    every file verifies."""
    for root, _dirs, _names in os.walk(base):
        sweep_parts(root, everything=True)
    verified = load_verified(base, manifest)
    kept = sorted(verified)
    unpacker = CheckpointUnpacker(base, manifest, verified)
    try:
        unpacker.run(stream)
    finally:
        unpacker.marker.close()
    received = unpacker.received
    report = {
        "placed": False,
        "verified": verified,
        "received": received,
        "kept": [n for n in kept if n not in received],
        "bad": sorted(unpacker.bad),
    }
    if set(verified) != set(manifest):
        return report
    tidy(base, manifest)
    write_manifest(base, text)
    unlink(os.path.join(base, MARKER))
    place(base, final)
    return {**report, "placed": True}


def plan(base, final, stream):
    """Which files of BASE verify already (from its notes; nothing is locked or changed)."""
    manifest, _text = read_manifest(stream)
    verified = load_verified(base, manifest) if os.path.isdir(base) else {}
    size = sum(os.lstat(os.path.join(base, n)).st_size for n in verified)
    return {"verified": sorted(verified), "bytes": size}


# ---------------------------------------------------------------- main


def error_text(exc):
    if isinstance(exc, OSError) and exc.filename is not None:
        if exc.errno in NO_SPACE:
            return f"no space left on the device of {exc.filename}"
        return f"{exc.filename}: {exc.strerror}"
    return str(exc)


def interrupted(signum, _frame):
    raise Failed(f"stopped by signal {signum}")


def main():
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, interrupted)
    base, mode = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None
    stream = sys.stdin.buffer
    try:
        if mode == "--checkpoint":
            doc = receive_checkpoint(base, sys.argv[3], stream)
        elif mode == "--plan":
            doc = plan(base, sys.argv[3], stream)
        else:
            if mode == "--offer":
                answer_offer(base, stream)
            doc = receive_copy(
                base,
                stream,
                sha256="--sha256" in sys.argv[2:],
                sealed="--unsealed" not in sys.argv[2:],
            )
    except Refused as exc:
        sys.stderr.write(f"receive: refused: {exc}\n")
        sys.exit(1)
    except (OSError, EOFError, Failed) as exc:
        sys.stderr.write(f"receive: {error_text(exc)}\n")
        sys.exit(1)
    json.dump(doc, sys.stdout)


main()
