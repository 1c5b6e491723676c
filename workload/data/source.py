"""Where a run's conversations come from: `data.path` is a chat JSONL file, a directory of
`*.jsonl` shards, or a dataset made by `datagen` (a directory with `manifest.json` and `*.jsonl`
shards, CONTRACTS §7), which must be complete.

Errors are `DataError`, one line naming the path and what to do.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workload.common.jsonfile import write_json_atomic
from workload.common.layout import DATASET_MANIFEST as MANIFEST_NAME
from workload.data.chat import DataError


@dataclass(frozen=True)
class DataSource:
    path: Path  # as configured, made absolute
    kind: str  # file | shards | datagen
    files: tuple[Path, ...]  # read in this order
    manifest: dict[str, Any] | None = None  # a datagen dataset's manifest.json

    @property
    def bytes(self) -> int:
        return sum(f.stat().st_size for f in self.files)

    def describe(self) -> str:
        if self.kind == "file":
            return str(self.path)
        return f"{self.path} ({self.kind}, {len(self.files)} shard{'s' * (len(self.files) > 1)})"


def open_source(path: str | os.PathLike) -> DataSource:
    """The source at `path`; DataError when it is missing, holds no shards, or is a datagen
    dataset whose manifest does not say `complete`."""
    p = Path(os.path.abspath(Path(path).expanduser()))  # as the user spells it: errors name it
    if p.is_file():
        return DataSource(p, "file", (p,))
    if not p.is_dir():
        raise DataError(f"{path}: cannot read the data: no such file or directory")
    shards = tuple(sorted(f for f in p.glob("*.jsonl") if f.is_file()))
    manifest_path = p / MANIFEST_NAME
    if manifest_path.is_file():
        manifest = read_manifest(manifest_path)
        _check_complete(manifest, manifest_path)
        if not shards:
            raise DataError(f"data.path: {path}: the datagen dataset holds no *.jsonl shards")
        return DataSource(p, "datagen", shards, manifest)
    if not shards:
        raise DataError(f"data.path: {path}: a directory without *.jsonl files (or manifest.json)")
    return DataSource(p, "shards", shards)


def read_manifest(path: Path) -> dict[str, Any]:
    try:
        manifest = json.loads(path.read_text())
    except OSError as exc:
        raise DataError(f"data.path: {path}: cannot read the manifest: {exc.strerror}") from None
    except ValueError as exc:
        raise DataError(f"data.path: {path}: not valid JSON ({exc})") from None
    if not isinstance(manifest, dict):
        raise DataError(f"data.path: {path}: expected a JSON object (CONTRACTS §7)")
    return manifest


def _check_complete(manifest: dict[str, Any], path: Path) -> None:
    if manifest.get("complete") is True:
        return
    counts = ", ".join(f"{k} {manifest.get(k, '?')}" for k in ("done", "failed", "skipped"))
    raise DataError(
        f"data.path: {path.parent} is a datagen dataset that is not complete ({path.name}: "
        f"complete {json.dumps(manifest.get('complete'))}, {counts} of input "
        f"{manifest.get('input', '?')}); finish it (dflashops resume {path.parent.name}) or "
        "train on a complete one"
    )


def raw_lines(source: DataSource) -> Iterator[tuple[int, int, bytes]]:
    """(file index, line number, raw line) of every non-blank line, in order, streamed."""
    for index, path in enumerate(source.files):
        try:
            f = open(path, "rb")  # noqa: SIM115 - closed below; its error is one line
        except OSError as e:
            raise DataError(f"{path}: cannot read the data: {e.strerror}") from None
        with f:
            for lineno, raw in enumerate(f, 1):
                if raw.strip():
                    yield index, lineno, raw


def source_digest(source: DataSource, memo: Path | None = None) -> str:
    """sha256 over the shards' names and contents. `memo` (a JSON file) keeps each file's
    digest by (path, size, mtime, inode), so a second start reads no file again."""
    known = _read_memo(memo)
    h = hashlib.sha256()
    changed = False
    for path in source.files:
        st = path.stat()
        stamp = [st.st_size, st.st_mtime_ns, st.st_ino]
        entry = known.get(str(path))
        if not (isinstance(entry, dict) and entry.get("stamp") == stamp):
            entry = {"stamp": stamp, "sha256": file_sha256(path)}
            known[str(path)] = entry
            changed = True
        h.update(f"{path.relative_to(source.path.parent)}\0{entry['sha256']}\n".encode())
    if memo is not None and changed:
        with contextlib.suppress(OSError):  # a memo not written costs the next start a read
            write_json_atomic(memo, known)
    return h.hexdigest()


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _read_memo(memo: Path | None) -> dict[str, Any]:
    if memo is None:
        return {}
    try:
        data = json.loads(memo.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
