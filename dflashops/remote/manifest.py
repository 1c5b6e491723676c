"""Put in front of the checkpoint server and the follower (stdlib only): a checkpoint's
MANIFEST.sha256 read, and the names in it checked before any file is opened by them."""

import hashlib
import os
import stat


def manifest_entries(text):
    """{name: sha256} of a sha256sum-format manifest; None when it is empty or malformed."""
    entries = {}
    for line in text.splitlines():
        digest, sep, name = line.partition("  ")
        if not sep or len(digest) != 64 or not name:
            return None
        entries[name.lstrip("*")] = digest.lower()
    return entries or None


def safe_name(name):
    """A relative path inside a checkpoint: no absolute path, no '..', no empty part."""
    parts = name.split("/")
    return not name.startswith("/") and all(p not in ("", ".", "..") for p in parts)


def file_sha256(path):
    """The sha256 of a regular file (never through a link); None when it is not one."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    digest = hashlib.sha256()
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return None
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
