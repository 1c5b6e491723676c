"""Who made a data set: the digest of a target model, and how a datagen manifest compares with
the run that trains on it (for the recipe audit). Standard library only, so `datagen` (in
the engine's own environment) and the trainer compute the same digest.

`target_digest(dir)` is sha256 over `config.json` and the weights' index: the bytes of
`model.safetensors.index.json` when there is one, else the header of each `*.safetensors` file
(its 8-byte length and JSON header: tensor names, shapes, dtypes and offsets). So it changes
with the architecture or the checkpoint's layout, reads a few KB, and never reads the weights.
"""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path

INDEX_NAME = "model.safetensors.index.json"


def target_digest(path: str | os.PathLike) -> str | None:
    """The digest of the model directory `path` (None when it has no config.json)."""
    root = Path(path)
    try:
        h = hashlib.sha256(b"config.json\0" + (root / "config.json").read_bytes())
        index = root / INDEX_NAME
        if index.is_file():
            h.update(f"\0{INDEX_NAME}\0".encode() + index.read_bytes())
        else:
            for f in sorted(root.glob("*.safetensors")):
                h.update(f"\0{f.name}\0".encode() + _safetensors_header(f))
    except OSError:
        return None
    return h.hexdigest()


def _safetensors_header(path: Path) -> bytes:
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return head
        (size,) = struct.unpack("<Q", head)
        return head + f.read(min(size, 100 << 20))


def same_target(recorded: dict | None, path: str | None, digest: str | None) -> bool | None:
    """Whether a manifest's `target` ({path, digest}) names this target: by digest when both
    have one, else by resolved path; None when the manifest says nothing."""
    if not isinstance(recorded, dict) or not (recorded.get("digest") or recorded.get("path")):
        return None
    if recorded.get("digest") and digest:
        return recorded["digest"] == digest
    if recorded.get("path") and path:
        return os.path.realpath(str(recorded["path"])) == os.path.realpath(path)
    return None
