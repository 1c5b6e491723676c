"""Runs inside a target with its python3 (stdlib only): unpack a tar stream, then hash from disk.

argv: BASE. stdin: a POSIX tar (ustar + pax headers) of regular files, directories and
symlinks with relative names. Each file is written under a temporary name, renamed into
place, and then read back from disk and hashed on a second thread while the next file
arrives. stdout: one JSON object {path: {"t": "f", "sha256": hex, "size": n} | {"t": "l",
"to": target} | {"t": "d"}}. A write error (a full disk) exits non-zero with the reason.
"""

import hashlib
import json
import os
import queue
import sys
import threading

BLOCK = 512
CHUNK = 1 << 20


def read_exact(stream, n):
    parts, left = [], n
    while left:
        chunk = stream.read(min(left, CHUNK))
        if not chunk:
            raise EOFError("the tar stream ended early")
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def octal(field):
    field = field.rstrip(b"\0 ").strip()
    return int(field, 8) if field else 0


def pax_records(data):
    out, pos = {}, 0
    while pos < len(data):
        space = data.index(b" ", pos)
        length = int(data[pos:space])
        key, _, value = data[space + 1 : pos + length - 1].partition(b"=")
        out[key.decode()] = value
        pos += length
    return out


def safe_join(base, name):
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if not parts or ".." in parts or name.startswith("/"):
        raise ValueError(f"unsafe path in stream: {name!r}")
    return parts, "/".join(parts)


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


def hash_file(path):
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while True:
            chunk = f.read(CHUNK)
            if not chunk:
                break
            digest.update(chunk)
            size += len(chunk)
    return {"t": "f", "sha256": digest.hexdigest(), "size": size}


def hasher(jobs, found):
    while True:
        job = jobs.get()
        if job is None:
            return
        rel, path = job
        found[rel] = hash_file(path)


def write_file(stream, path, size, mode, mtime):
    if os.path.isdir(path) and not os.path.islink(path):
        raise IsADirectoryError(
            f"{path} is a directory: to copy into it, end the destination with /"
        )
    tmp = path + ".dflashops-partial"
    if os.path.lexists(tmp):
        os.unlink(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            left = size
            while left:
                chunk = stream.read(min(left, CHUNK))
                if not chunk:
                    raise EOFError("the tar stream ended inside a file")
                f.write(chunk)
                left -= len(chunk)
        os.chmod(tmp, mode)
        os.utime(tmp, (mtime, mtime))
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise
    pad = -size % BLOCK
    if pad:
        read_exact(stream, pad)


def unpack(stream, base, jobs, found):
    pax = {}
    while True:
        header = stream.read(BLOCK)
        if len(header) < BLOCK or header == b"\0" * BLOCK:
            return
        size = octal(header[124:136])
        kind = header[156:157]
        if kind in (b"x", b"g"):
            data = read_exact(stream, size + (-size % BLOCK))[:size]
            if kind == b"x":
                pax = pax_records(data)
            continue
        name = header[0:100].rstrip(b"\0")
        prefix = header[345:500].rstrip(b"\0")
        if prefix:
            name = prefix + b"/" + name
        name = pax.get("path", name).decode("utf-8", "surrogateescape")
        link = pax.get("linkpath", header[157:257].rstrip(b"\0")).decode("utf-8", "surrogateescape")
        size = int(pax["size"]) if "size" in pax else size
        mode, mtime = octal(header[100:108]) & 0o7777, octal(header[136:148])
        pax = {}
        parts, rel = safe_join(base, name)
        path = real_dirs(base, parts)
        if kind == b"5":
            make_dir(path, mode)
            found[rel] = {"t": "d"}
        elif kind == b"2":
            if os.path.isdir(path) and not os.path.islink(path):
                raise IsADirectoryError(f"{path} is a directory; a link cannot replace it")
            if os.path.lexists(path):
                os.unlink(path)
            os.symlink(link, path)
            found[rel] = {"t": "l", "to": os.readlink(path)}
        elif kind in (b"0", b"\0"):
            write_file(stream, path, size, mode, mtime)
            jobs.put((rel, path))
        else:
            raise ValueError(f"unsupported tar entry type {kind!r} for {name}")


def main():
    base = sys.argv[1]
    os.makedirs(base, exist_ok=True)
    found = {}
    jobs = queue.Queue()
    thread = threading.Thread(target=hasher, args=(jobs, found))
    thread.start()
    try:
        unpack(sys.stdin.buffer, base, jobs, found)
    except (OSError, EOFError, ValueError) as exc:
        sys.stderr.write(f"receive: {exc}\n")
        sys.exit(1)
    finally:
        jobs.put(None)
        thread.join()
    json.dump(found, sys.stdout)


main()
