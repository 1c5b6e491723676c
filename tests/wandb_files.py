"""Reading what W&B keeps of an offline run: its transaction log (run-ID.wandb, the records
`wandb sync` would send to the hub), to see the alerts a run sent without reaching the hub.

The file is a LevelDB-style log after a 7-byte W&B header: 32 KiB blocks of chunks, each a
7-byte header (crc32c, length as little-endian 16 bits, type: 1 full, 2 first, 3 middle, 4
last) and its bytes; a record is one protobuf `Record` (wandb.proto.wandb_internal_pb2).
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

BLOCK = 32768
HEADER = 7


def records(path: Path) -> list[bytes]:
    """Every record's bytes, in order (no checksum check: a test reads a finished file)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path}: not a W&B transaction log"
    out, parts, at = [], [], HEADER
    while at + HEADER <= len(data):
        left = BLOCK - at % BLOCK
        if left < HEADER:  # a block's trailer
            at += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[at : at + HEADER])
        if kind == 0 and length == 0:  # zero padding
            at += left
            continue
        chunk = data[at + HEADER : at + HEADER + length]
        at += HEADER + length
        if kind == 1:
            out.append(chunk)
        elif kind == 2:
            parts = [chunk]
        elif kind == 3:
            parts.append(chunk)
        elif kind == 4:
            out.append(b"".join([*parts, chunk]))
    return out


def alerts(run_dir: Path) -> list[dict[str, Any]]:
    """The alerts in every offline W&B run under `run_dir` (wandb/offline-run-*/run-*.wandb)."""
    from wandb.proto import wandb_internal_pb2 as pb

    found = []
    for log in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        for raw in records(log):
            record = pb.Record()
            record.ParseFromString(raw)
            if record.WhichOneof("record_type") == "alert":
                a = record.alert
                found.append({"title": a.title, "text": a.text, "level": a.level, "file": log})
    return found
