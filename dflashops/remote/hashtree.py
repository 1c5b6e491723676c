"""Runs inside a target with its python3 (stdlib only): describe files under a directory.

argv: BASE [--all] [--follow] [--stat]. stdin: a JSON list of paths relative to BASE (ignored
with --all). With --follow a link is described by what it points to; with --stat a file is
described by size and mtime only ("mtime" instead of "sha256"), without reading it.
stdout: one JSON object {path: {"t": "f", "sha256": hex, "size": n} | {"t": "l", "to": target}
| {"t": "d"} | {"t": "-"}}, "-" for a path that does not exist.
"""

import hashlib
import json
import os
import stat
import sys


def describe(path, follow=False, quick=False):
    if follow:
        path = os.path.realpath(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return {"t": "-"}
    if stat.S_ISLNK(st.st_mode):
        return {"t": "l", "to": os.readlink(path)}
    if stat.S_ISDIR(st.st_mode):
        return {"t": "d"}
    if quick:
        return {"t": "f", "size": st.st_size, "mtime": int(st.st_mtime)}
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            chunk = f.read(1 << 20)
            if not chunk:
                break
            digest.update(chunk)
    return {"t": "f", "sha256": digest.hexdigest(), "size": st.st_size}


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
    out = {rel: describe(os.path.join(base, rel), follow, quick) for rel in paths}
    json.dump(out, sys.stdout)


main()
