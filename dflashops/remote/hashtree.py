"""Runs inside a target with its python3 (stdlib only): describe files under a directory.

argv: BASE [--all] [--follow] [--stat]. stdin: a JSON list of paths relative to BASE (ignored
with --all). With --follow a link is described by what it points to; without it, a path under
a link (inside BASE) is "-", as a copy would not write there. With --stat a file is described
by size and mtime only ("mtime" instead of "sha256"), without reading it.
stdout: one JSON object {path: {"t": "f", "sha256": hex, "size": n, "mode": m} | {"t": "l",
"to": target} | {"t": "d", "mode": m} | {"t": "s"} | {"t": "-"}}: "s" for anything else (a fifo,
a device: never opened), "-" for a path that does not exist.
"""

import hashlib
import json
import os
import stat
import sys


def under_link(base, rel):
    """True when a directory on the way from BASE to rel is a link."""
    path = base
    for part in rel.split("/")[:-1]:
        path = os.path.join(path, part)
        if os.path.islink(path):
            return True
    return False


def describe(base, rel, follow=False, quick=False):
    path = os.path.join(base, rel)
    if follow:
        path = os.path.realpath(path)
    elif under_link(base, rel):
        return {"t": "-"}
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return {"t": "-"}
    mode = stat.S_IMODE(st.st_mode)
    if stat.S_ISLNK(st.st_mode):
        return {"t": "l", "to": os.readlink(path)}
    if stat.S_ISDIR(st.st_mode):
        return {"t": "d", "mode": mode}
    if not stat.S_ISREG(st.st_mode):
        return {"t": "s"}  # a fifo or a device: never opened (it could block)
    if quick:
        return {"t": "f", "size": st.st_size, "mtime": int(st.st_mtime), "mode": mode}
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            chunk = f.read(1 << 20)
            if not chunk:
                break
            digest.update(chunk)
    return {"t": "f", "sha256": digest.hexdigest(), "size": st.st_size, "mode": mode}


def walk(base):
    for root, dirs, files in os.walk(base):
        for name in dirs + files:
            yield os.path.relpath(os.path.join(root, name), base)


def main():
    base = sys.argv[1]
    if "--all" in sys.argv[2:]:
        paths = list(walk(base)) if os.path.isdir(base) else []
    else:
        paths = json.load(sys.stdin)
    follow, quick = "--follow" in sys.argv[2:], "--stat" in sys.argv[2:]
    out = {rel: describe(base, rel, follow, quick) for rel in paths}
    json.dump(out, sys.stdout)


main()
