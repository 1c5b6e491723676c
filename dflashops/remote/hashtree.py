"""Runs inside a target with its python3 (stdlib only): describe files under a directory.

argv: BASE [--all] [--follow] [--stat]. stdin: a JSON list of paths relative to BASE (ignored
with --all). With --follow a link is described by what it points to; without it, a path under
a link (inside BASE) is "-", as a copy would not write there. With --stat a file is described
by size and mtime only ("mtime" instead of "sha256"), without reading it.
stdout: one JSON object {path: {"t": "f", "sha256": hex, "size": n, "mode": m} | {"t": "l",
"to": target} | {"t": "d", "mode": m} | {"t": "s"} | {"t": "-"}}: "s" for anything else (a fifo,
a device: never opened), "-" for a path that does not exist.
"""

import json
import os
import sys

from dflashops.remote.describe import describe


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
