"""Trees of awkward files, and their fingerprints, for copy tests."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def make_tree(root: Path, big: int = 3 << 20) -> Path:
    root.mkdir(parents=True)
    (root / "empty").write_bytes(b"")
    (root / "blob.bin").write_bytes(os.urandom(big))
    (root / "name with spaces & $(quotes)'\"").write_text("odd name\n")
    (root / "ünïcødé.txt").write_text("ü\n")
    sub = root / "a" / "b"
    sub.mkdir(parents=True)
    (sub / "deep.txt").write_text("deep\n")
    (root / "emptydir").mkdir()
    (root / "link-to-blob").symlink_to("blob.bin")
    (root / "a" / "dangling").symlink_to("../nowhere")
    script = root / "run.sh"
    script.write_text("#!/bin/sh\necho hi\n")
    script.chmod(0o755)
    return root


def fingerprint(root: Path) -> dict[str, tuple]:
    """path -> (kind, sha256 or link target, mode) for every entry under root."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            rel = path.relative_to(root).as_posix()
            if path.is_symlink():
                out[rel] = ("l", os.readlink(path))
            elif path.is_dir():
                out[rel] = ("d",)
            else:
                out[rel] = (
                    "f",
                    hashlib.sha256(path.read_bytes()).hexdigest(),
                    path.stat().st_mode & 0o777,
                )
    return out
