"""A checkpoint's format on disk (CONTRACTS §4): the atomic `checkpoints/step_<N>/` directory,
its MANIFEST.sha256, and reading which checkpoints are complete. No training code: the
evaluator reads checkpoints through this module, the trainer writes them through it
(workload/train/save_restore.py).

A checkpoint is written into a temporary directory beside its final place, every file is synced,
the manifest (sha256sum format, every other file) is written last, and the directory is renamed
into place. A `step_<N>` directory without a manifest that matches its files is incomplete:
nothing resumes from it, and the keep-policy never deletes it (someone may be writing it).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from workload.common.layout import CHECKPOINTS_DIR, MANIFEST, STEP_PREFIX, step_name
from workload.common.processes import pid_alive

_STEP_RE = re.compile(rf"^{STEP_PREFIX}(\d+)$")
_TEMP_PREFIX = ".tmp-step_"
_TEMP_RE = re.compile(r"^\.tmp-step_(\d+)-(\d+)-[0-9a-f]+$")
_OLD_RE = re.compile(r"^\.old-step_(\d+)-[0-9a-f]+$")  # a replaced step_N whose removal was cut


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: Path
    has_manifest: bool


def checkpoints_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / CHECKPOINTS_DIR


def step_dir(run_dir: str | os.PathLike, step: int) -> Path:
    return checkpoints_dir(run_dir) / step_name(step)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _files(directory: Path) -> list[Path]:
    return sorted(
        p
        for p in directory.rglob("*")
        if p.is_file() and p.relative_to(directory).as_posix() != MANIFEST
    )


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(directory: Path) -> None:
    """Sync every file, then write and sync MANIFEST.sha256 listing them (sha256sum format)."""
    lines = []
    for path in _files(directory):
        _fsync_path(path)
        lines.append(f"{_sha256(path)}  {path.relative_to(directory).as_posix()}\n")
    manifest = directory / MANIFEST
    with manifest.open("w") as f:
        f.writelines(lines)
        f.flush()
        os.fsync(f.fileno())
    _fsync_path(directory)


def read_manifest(directory: Path) -> dict[str, str] | None:
    """{relative path: sha256} or None when the manifest is missing or malformed."""
    try:
        text = (directory / MANIFEST).read_text()
    except OSError:
        return None
    entries: dict[str, str] = {}
    for line in text.splitlines():
        digest, sep, name = line.partition("  ")
        if not sep or len(digest) != 64 or not name:
            return None
        entries[name.lstrip("*")] = digest
    return entries or None


def verify(directory: str | os.PathLike, *, hashes: bool = True) -> bool:
    """True iff the manifest lists exactly the directory's other files (and their hashes match)."""
    directory = Path(directory)
    entries = read_manifest(directory)
    if entries is None:
        return False
    present = {p.relative_to(directory).as_posix(): p for p in _files(directory)}
    if set(present) != set(entries):
        return False
    return not hashes or all(_sha256(present[n]) == d for n, d in entries.items())


def list_checkpoints(run_dir: str | os.PathLike) -> list[CheckpointInfo]:
    """Every `step_<N>` directory, oldest first (temporary directories are not listed)."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        m = _STEP_RE.match(entry.name)
        if m and entry.is_dir():
            found.append(CheckpointInfo(int(m.group(1)), entry, (entry / MANIFEST).is_file()))
    return sorted(found, key=lambda c: c.step)


def latest_complete(run_dir: str | os.PathLike) -> Path | None:
    """The newest checkpoint whose manifest verifies (hashes included), or None."""
    for info in reversed(list_checkpoints(run_dir)):
        if info.has_manifest and verify(info.path):
            return info.path
    return None


def _remove(directory: Path) -> None:
    # The manifest goes first, so a deletion cut short leaves an incomplete directory.
    (directory / MANIFEST).unlink(missing_ok=True)
    shutil.rmtree(directory, ignore_errors=True)


def begin(run_dir: str | os.PathLike, step: int) -> Path:
    """A new temporary directory for `step_<step>`, to be written and then `complete`d (or
    `discard`ed). Its name carries this process's pid, so a resume can tell it is stale."""
    root = checkpoints_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f"{_TEMP_PREFIX}{step}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    return tmp


def discard(tmp: Path) -> None:
    shutil.rmtree(tmp, ignore_errors=True)


def complete(
    run_dir: str | os.PathLike,
    step: int,
    tmp: Path,
    write_files: Callable[[Path], None],
    *,
    keep_last: int | None = None,
    keep_every: int | None = None,
) -> Path:
    """Let `write_files(tmp)` add the rest of the payload, write the manifest, rename `tmp`
    into place as step_<step> and apply the keep-policy. `tmp` is removed on failure."""
    root = checkpoints_dir(run_dir)
    try:
        write_files(tmp)
        write_manifest(tmp)
        final = step_dir(run_dir, step)
        if final.exists():
            old = root / f".old-step_{step}-{uuid.uuid4().hex[:8]}"
            final.rename(old)
            _remove(old)
        tmp.rename(final)
        _fsync_path(root)
    except BaseException:
        discard(tmp)
        raise
    if keep_last is not None:
        apply_keep_policy(run_dir, keep_last=keep_last, keep_every=keep_every)
    return final


def save(
    run_dir: str | os.PathLike,
    step: int,
    write_files: Callable[[Path], None],
    *,
    keep_last: int | None = None,
    keep_every: int | None = None,
) -> Path:
    """Write a complete `step_<step>` atomically; `write_files(tmp_dir)` writes the payload."""
    tmp = begin(run_dir, step)
    return complete(run_dir, step, tmp, write_files, keep_last=keep_last, keep_every=keep_every)


def to_delete(steps: list[int], keep_last: int, keep_every: int | None) -> list[int]:
    """Complete checkpoint steps that the policy drops: not among the newest `keep_last` and
    not a multiple of `keep_every`."""
    newest = set(sorted(steps)[-keep_last:]) if keep_last > 0 else set()
    return [
        s for s in sorted(steps) if s not in newest and not (keep_every and s % keep_every == 0)
    ]


def apply_keep_policy(
    run_dir: str | os.PathLike, *, keep_last: int, keep_every: int | None = None
) -> list[int]:
    """Delete the complete checkpoints the policy drops; incomplete ones are never touched."""
    complete = {c.step: c.path for c in list_checkpoints(run_dir) if c.has_manifest}
    dropped = to_delete(list(complete), keep_last, keep_every)
    for s in dropped:
        _remove(complete[s])
    return dropped


def remove_stale_temps(run_dir: str | os.PathLike) -> list[Path]:
    """Delete temporary checkpoint directories whose writer (a pid on this machine) is gone,
    and replaced checkpoints whose removal was cut short (renamed away: nobody reads them)."""
    root = checkpoints_dir(run_dir)
    removed: list[Path] = []
    if not root.is_dir():
        return removed
    for entry in root.iterdir():
        m = _TEMP_RE.match(entry.name)
        if (m and not pid_alive(int(m.group(2)))) or _OLD_RE.match(entry.name):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def step_of(directory: str | os.PathLike) -> int:
    m = _STEP_RE.match(Path(directory).name)
    if not m:
        raise ValueError(f"{directory}: not a step_<N> checkpoint directory")
    return int(m.group(1))
