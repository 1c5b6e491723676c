"""Put in front of the helpers that describe files (hashtree.py, receive.py), stdlib only: what
a path under BASE is, as a copy there would see it.

describe(): {"t": "f", "sha256": hex, "size": n, "mode": m} (with `quick`: "mtime" instead of
"sha256", the file not read) | {"t": "l", "to": target} | {"t": "d", "mode": m} | {"t": "s"}
(a fifo or a device: never opened) | {"t": "-"} (no such path, or a path under a link inside
BASE, where a copy would not write, unless `follow`).
"""

import hashlib
import os
import stat


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
